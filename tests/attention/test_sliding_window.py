"""Sliding-window attention of the torch backend (prefill with and without cached context,
decode) against a dense reference written out position by position."""

from __future__ import annotations

import pytest
import torch

from pdserve.attention import TorchAttentionBackend, build_attention_metadata
from pdserve.attention.torch_backend import sliding_window_mask

HQ, HKV, D, BS, LAYERS = 4, 2, 16, 4, 2


def _reference(q, k, v, first_pos, window):
    """Attention of queries at positions ``first_pos ..`` over keys ``0 ..`` of one request,
    each query over the keys ``pos - window + 1 .. pos`` (all earlier keys when None)."""
    out = torch.empty_like(q, dtype=torch.float64)
    kk = k.double().repeat_interleave(HQ // HKV, 1)
    vv = v.double().repeat_interleave(HQ // HKV, 1)
    for i in range(q.shape[0]):
        pos = first_pos + i
        lo = 0 if window is None else max(0, pos - window + 1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), kk[lo:pos + 1]) * D ** -0.5
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), vv[lo:pos + 1])
    return out


@pytest.mark.parametrize("window", [None, 3, 6, 100])
def test_torch_backend_sliding_window_matches_dense_reference(window):
    gen = torch.Generator().manual_seed(1)
    # (num_computed, query_len) of prefills, num_computed of decodes
    prefills, decodes = [(0, 11), (7, 6), (0, 2)], [9, 0, 3]
    lengths = [c + n for c, n in prefills] + [c + 1 for c in decodes]
    tables, nxt = [], 1
    for n in lengths:
        need = -(-n // BS)
        tables.append(list(range(nxt, nxt + need)))
        nxt += need
    kv_cache = torch.zeros(nxt, LAYERS, 2, HKV, BS, D)
    seq_k = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    seq_v = [torch.randn(n, HKV, D, generator=gen) for n in lengths]
    seq_q = [torch.randn(n, HQ, D, generator=gen) for n in lengths]
    firsts = [c for c, _ in prefills] + decodes
    for table, k, v, first in zip(tables, seq_k, seq_v, firsts):  # the cached context
        for p in range(first):
            kv_cache[table[p // BS], 1, 0, :, p % BS] = k[p]
            kv_cache[table[p // BS], 1, 1, :, p % BS] = v[p]
    meta = build_attention_metadata(
        [(c, t, n) for (c, n), t in zip(prefills, tables)],
        [(t, c) for c, t in zip(decodes, tables[len(prefills):])], BS, torch.device("cpu"))
    q = torch.cat([x[f:] for x, f in zip(seq_q, firsts)])
    k = torch.cat([x[f:] for x, f in zip(seq_k, firsts)])
    v = torch.cat([x[f:] for x, f in zip(seq_v, firsts)])
    backend = TorchAttentionBackend(HQ, HKV, D, BS, D ** -0.5)
    out = backend.forward(1, q, k, v, kv_cache, meta, sliding_window=window)
    ref = torch.cat([_reference(x[f:], kk, vv, f, window)
                     for x, kk, vv, f in zip(seq_q, seq_k, seq_v, firsts)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_sliding_window_mask_shape_and_band():
    mask = sliding_window_mask(2, 3, 2, torch.device("cpu"))
    assert mask.tolist() == [[False, True, True, False, False],
                             [False, False, True, True, False],
                             [False, False, False, True, True]]
