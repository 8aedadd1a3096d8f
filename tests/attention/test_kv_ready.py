"""Per-layer waits for a step's host-tier LOADs: :class:`KVReadyByLayer` makes the stream wait
for each group of layers once and in order, and the backends that declare
``waits_for_kv_by_layer`` wait for a layer's group before they write or read its cache."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import TorchAttentionBackend, build_attention_metadata
from pdserve.attention.metadata import KVReadyByLayer
from pdserve.attention.mla import MLAAttentionBackend


class LoggedEvent:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait(self) -> None:
        self.log.append(self.name)


def test_each_group_is_waited_for_once_in_layer_order():
    log: list = []
    ready = KVReadyByLayer([LoggedEvent(f"g{g}", log) for g in range(3)], layers_per_group=2)
    ready.wait(0)
    ready.wait(1)
    assert log == ["g0"]
    ready.wait(5)  # skipping a group still waits for it first
    assert log == ["g0", "g1", "g2"]
    ready.wait(3)
    ready.wait_all()
    assert log == ["g0", "g1", "g2"]
    fresh: list = []
    KVReadyByLayer([LoggedEvent(f"g{g}", fresh) for g in range(2)], 4).wait_all()
    assert fresh == ["g0", "g1"]


@pytest.mark.parametrize("events, per_group", [([], 1), ([object()], 0)])
def test_bad_arguments_are_refused(events, per_group):
    with pytest.raises(ValueError):
        KVReadyByLayer(events, per_group)


def test_the_torch_backend_waits_for_a_layers_group_before_it_writes_the_cache():
    hq, hkv, d, bs, layers = 2, 1, 8, 4, 3
    backend = TorchAttentionBackend(hq, hkv, d, bs, d ** -0.5)
    assert backend.waits_for_kv_by_layer and not MLAAttentionBackend.waits_for_kv_by_layer
    kv_cache = torch.zeros(4, layers, 2, hkv, bs, d)
    # one prefill of 3 new tokens after 4 cached ones (block 0 holds them), into block 1
    meta = build_attention_metadata([(4, [0, 1], 3)], [], bs, torch.device("cpu"))
    seen: list = []

    class Probe:
        """A group's event that records, when waited for, whether the layer was written."""

        def __init__(self, layer: int):
            self.layer = layer

        def wait(self) -> None:
            seen.append((self.layer, bool(kv_cache[1, self.layer].abs().sum())))

    meta.kv_ready = KVReadyByLayer([Probe(layer) for layer in range(layers)], 1)
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        q, k, v = (torch.randn(3, h, d, generator=g) for h in (hq, hkv, hkv))
        backend.forward(layer, q, k, v, kv_cache, meta)
        assert kv_cache[1, layer].abs().sum() > 0
    assert seen == [(0, False), (1, False), (2, False)]
