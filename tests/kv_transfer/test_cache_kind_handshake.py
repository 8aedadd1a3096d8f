"""The cache kind in the P/D handshake: a multi-head latent (MLA) cache and a per-head K/V cache
are refused as a pair, with a message that says why, before the head counts are compared; two
caches of one kind pass that check. In-process: the remote's ``get_info`` answer is given."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.base import KVCacheSpec, TPRank
from pdserve.kv_transfer.nixl.remotes import HandshakeMismatch, LocalKV, RemoteRegistry
from pdserve.kv_transfer.nixl.compat import (
    cache_kind_mismatch, compat_fields, compat_hash,
)
from pdserve.types.kv_cache_kind import KVCacheKind
from pdserve.types.remote_ref import RemoteEndpoint

# A DeepSeek-like latent cache (one head of half the latent entry) and a per-head one.
MLA = KVCacheSpec(num_blocks=8, block_size=16, num_layers=3, num_kv_heads=1, head_dim=20,
                  dtype="float32", element_size=4, model_name="m", total_num_kv_heads=1,
                  kind=KVCacheKind.MLA_LATENT)
PER_HEAD = KVCacheSpec(num_blocks=8, block_size=16, num_layers=3, num_kv_heads=2, head_dim=16,
                       dtype="float32", element_size=4, model_name="m", total_num_kv_heads=2)


def _local(spec: KVCacheSpec, tp: TPRank) -> LocalKV:
    return LocalKV(engine_id="local", compat=compat_fields(spec), tp=tp,
                   heads=spec.num_kv_heads,
                   head_bytes=spec.block_size * spec.head_dim * spec.element_size)


def _info(spec: KVCacheSpec, tp_size: int) -> dict:
    fields = compat_fields(spec)
    return {"engine_id": "remote", "compat": fields, "compat_hash": compat_hash(fields),
            "tp_size": tp_size, "num_heads": spec.num_kv_heads}


def _handshake(local: KVCacheSpec, remote: KVCacheSpec, monkeypatch, remote_tp: int = 1,
               local_tp: TPRank = TPRank()):
    """The reader's handshake checks and route against a remote of ``remote_tp`` ranks, each
    answering with ``remote``'s fields; returns the planned route."""
    registry = RemoteRegistry(config=None, agent=None, pool=None, client=None,
                              local=lambda: _local(local, local_tp), wake=lambda: None)
    monkeypatch.setattr(registry, "_request_info",
                        lambda endpoint, rank: _info(remote, remote_tp))
    return registry._fetch_info(RemoteEndpoint("remote", "127.0.0.1", 1))[2]


def test_compat_fields_carry_the_cache_kind():
    assert compat_fields(PER_HEAD)["cache_kind"] == "per_head"
    assert compat_fields(MLA)["cache_kind"] == "mla_latent"
    assert KVCacheSpec(1, 1, 1, 1, 1, "float32", 4, "m").kind is KVCacheKind.PER_HEAD
    assert cache_kind_mismatch(compat_fields(MLA), compat_fields(MLA)) is None


@pytest.mark.parametrize(("local", "remote"), [(MLA, PER_HEAD), (PER_HEAD, MLA)],
                         ids=["mla-reads-per-head", "per-head-reads-mla"])
def test_mla_and_per_head_are_refused_at_the_handshake(local, remote, monkeypatch):
    with pytest.raises(HandshakeMismatch) as err:
        _handshake(local, remote, monkeypatch)
    message = str(err.value)
    assert "incompatible" in message and "cache_kind" in message, message
    assert "'mla_latent'" in message and "'per_head'" in message, message
    assert "multi-head latent (MLA)" in message, message
    assert "not divisible" not in message and "pair instances that serve the same model" in message


@pytest.mark.parametrize(("remote_tp", "local_tp"), [(1, 1), (2, 1), (1, 2)],
                         ids=["tp1-tp1", "p-tp2-d-tp1", "p-tp1-d-tp2"])
def test_latent_caches_pair_and_every_reader_rank_reads_the_latent_once(
        remote_tp, local_tp, monkeypatch):
    """Two latent caches of any TP sizes pair; the latent is replicated on every rank, so each
    reader rank reads it once, whole blocks, from one owner rank (rank 0)."""
    for rank in range(local_tp):
        tp = TPRank(rank=rank, size=local_tp, all_gather=None)
        route = _handshake(MLA, MLA, monkeypatch, remote_tp, tp)
        assert len(route.reads) == 1 and route.reads[0].src_rank == 0, route.reads
        assert route.whole(route.reads[0]) and route.src.heads == route.dst.heads == 1


def test_a_latent_cache_of_more_than_one_head_is_refused(monkeypatch):
    """A latent cache that says it has the model's attention heads (4) instead of one latent
    entry is refused: the plan would otherwise read it per head slice."""
    wide = KVCacheSpec(num_blocks=8, block_size=16, num_layers=3, num_kv_heads=4, head_dim=20,
                       dtype="float32", element_size=4, model_name="m", total_num_kv_heads=4,
                       kind=KVCacheKind.MLA_LATENT)
    with pytest.raises(HandshakeMismatch, match="one latent entry per token"):
        _handshake(wide, wide, monkeypatch, 2, TPRank(rank=0, size=1, all_gather=None))
