"""Packed (varlen) prefill attention: the metadata it needs (cumulative lengths, context slots),
the packed keys/values, and on CUDA the FlashAttention varlen call against per-request SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.attention import TorchAttentionBackend, build_attention_metadata, packed_prefill_kv
from pdserve.kernels.prefill_attention import flash_varlen_prefill

HQ, HKV, D, BS = 4, 2, 16, 4
NUM_BLOCKS, NUM_LAYERS = 40, 2


def _tables(lengths: list[int], first_block: int = 3) -> list[list[int]]:
    """Disjoint, non-contiguous block tables (every other block) for the given token counts."""
    tables, nxt = [], first_block
    for n in lengths:
        need = -(-n // BS)
        tables.append([nxt + 2 * i for i in range(need)])
        nxt += 2 * need
    return tables


def _reference_varlen(q, k, v, cu_q, cu_k, scale, window=None):
    """Bottom-right causal attention of each packed sequence, written out with a dense mask
    (each query over its last ``window`` positions when given)."""
    outs = []
    for i in range(len(cu_q) - 1):
        qi = q[cu_q[i]:cu_q[i + 1]].transpose(0, 1)  # [H, n, D]
        ki = k[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        vi = v[cu_k[i]:cu_k[i + 1]].transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        n, c = qi.shape[1], ki.shape[1]
        mask = torch.arange(c)[None, :] <= torch.arange(c - n, c)[:, None]
        if window is not None:
            mask &= torch.arange(c)[None, :] > torch.arange(c - n, c)[:, None] - window
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
        outs.append(o.transpose(0, 1))
    return torch.cat(outs)


def test_metadata_for_packed_prefill_with_cached_context():
    # (num_computed, query_len): a fresh prompt, a later chunk, another fresh prompt
    shape = [(0, 5), (9, 7), (0, 3)]
    tables = _tables([c + q for c, q in shape])
    decode_tables = _tables([6], first_block=30)
    meta = build_attention_metadata([(c, t, q) for (c, q), t in zip(shape, tables)],
                                    [(decode_tables[0], 5)], BS, torch.device("cpu"))
    assert meta.prefill_cu_seqlens_q.tolist() == [0, 5, 12, 15]
    assert meta.prefill_cu_seqlens_k.tolist() == [0, 5, 21, 24]
    assert meta.prefill_cu_seqlens_q.dtype == meta.prefill_cu_seqlens_k.dtype == torch.int32
    assert (meta.max_prefill_query_len, meta.max_prefill_context_len) == (7, 16)
    expect_kv, expect_new = [], []
    for (c, q), t in zip(shape, tables):
        ctx = [t[p // BS] * BS + p % BS for p in range(c + q)]
        expect_kv += ctx
        expect_new += ctx[c:]
    kv = meta.prefill_kv_block * BS + meta.prefill_kv_offset
    assert kv.tolist() == expect_kv
    assert meta.slot_mapping.tolist() == expect_new + [decode_tables[0][1] * BS + 1]
    assert [s.mask is not None for s in meta.prefills] == [False, True, False]
    assert meta.prefills[1].mask.shape == (7, 16)


def test_metadata_without_cached_context_packs_the_step_itself():
    tables = _tables([5, 6])
    meta = build_attention_metadata([(0, tables[0], 5), (0, tables[1], 6)], [], BS,
                                    torch.device("cpu"))
    assert meta.prefill_kv_block is None and meta.prefill_kv_offset is None
    assert meta.prefill_cu_seqlens_k.tolist() == meta.prefill_cu_seqlens_q.tolist() == [0, 5, 11]
    key = torch.randn(11, HKV, D)
    value = torch.randn(11, HKV, D)
    k, v = packed_prefill_kv(0, key, value, torch.empty(0), meta)
    assert k.data_ptr() == key.data_ptr() and v.data_ptr() == value.data_ptr()
    assert k.shape == (11, HKV, D)
    empty = build_attention_metadata([], [(tables[0], 2)], BS, torch.device("cpu"))
    assert empty.prefill_cu_seqlens_q is None and empty.max_prefill_query_len == 0


def _mixed_step(device, dtype, shape, seed=0):
    """A KV cache holding random cached context, the metadata of one step of prefills
    (``shape`` = [(num_computed, query_len)]) plus two decodes, and the step's q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    tables = _tables([c + q for c, q in shape])
    decode_tables = _tables([9, 3], first_block=NUM_BLOCKS - 8)
    kv_cache = torch.randn(NUM_BLOCKS, NUM_LAYERS, 2, HKV, BS, D, generator=gen).to(device, dtype)
    meta = build_attention_metadata([(c, t, q) for (c, q), t in zip(shape, tables)],
                                    [(decode_tables[0], 8), (decode_tables[1], 2)], BS, device)
    t = sum(q for _, q in shape) + 2
    q = torch.randn(t, HQ, D, generator=gen).to(device, dtype)
    k = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    v = torch.randn(t, HKV, D, generator=gen).to(device, dtype)
    return kv_cache, meta, q, k, v


@pytest.mark.parametrize("shape", [[(0, 5), (9, 7), (0, 3)], [(0, 6), (0, 2)]])
def test_packed_prefill_equals_per_request_sdpa(shape):
    """Packed keys/values with bottom-right causal masking give the per-request results."""
    kv_cache, meta, q, k, v = _mixed_step(torch.device("cpu"), torch.float32, shape)
    backend = TorchAttentionBackend(HQ, HKV, D, BS, D ** -0.5)
    layer = 1
    ref = backend.forward(layer, q, k, v, kv_cache, meta)  # writes the step's K/V too
    assert backend.last_prefill_impl == "sdpa"
    pk, pv = packed_prefill_kv(layer, k, v, kv_cache, meta)
    assert pk.shape[0] == meta.prefill_cu_seqlens_k[-1].item()
    p = meta.num_prefill_tokens
    got = _reference_varlen(q[:p], pk, pv, meta.prefill_cu_seqlens_q.tolist(),
                            meta.prefill_cu_seqlens_k.tolist(), D ** -0.5)
    torch.testing.assert_close(got, ref[:p], atol=1e-5, rtol=1e-5)


def test_prefill_mode_is_validated(monkeypatch):
    monkeypatch.setenv("PDSERVE_PREFILL_ATTENTION", "bogus")
    with pytest.raises(ValueError, match="PDSERVE_PREFILL_ATTENTION"):
        TorchAttentionBackend(HQ, HKV, D, BS, 1.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_cuda_varlen_prefill_matches_per_request_sdpa(backend_name, window):
    """bf16 on CUDA: the one-call varlen prefill agrees with per-request SDPA (no cuDNN), with
    and without a sliding window."""
    from pdserve import attention

    if backend_name == "triton":
        pytest.importorskip("triton")
        cls = attention.TritonAttentionBackend
    else:
        cls = attention.TorchAttentionBackend
    dev = torch.device("cuda")
    hq, hkv, d = HQ, HKV, 64  # flash needs head_dim % 8 == 0
    shape = [(0, 37), (21, 50), (0, 2), (64, 9)]
    outs = {}
    for mode in ("auto", "sdpa"):
        gen = torch.Generator().manual_seed(1)
        tables = _tables([c + q for c, q in shape])
        kv_cache = torch.randn(128, NUM_LAYERS, 2, hkv, BS, d,
                               generator=gen).to(dev, torch.bfloat16)
        meta = build_attention_metadata([(c, t, q) for (c, q), t in zip(shape, tables)],
                                        [(_tables([5], first_block=110)[0], 4)], BS, dev)
        t = sum(q for _, q in shape) + 1
        q = torch.randn(t, hq, d, generator=gen).to(dev, torch.bfloat16)
        k = torch.randn(t, hkv, d, generator=gen).to(dev, torch.bfloat16)
        v = torch.randn(t, hkv, d, generator=gen).to(dev, torch.bfloat16)
        backend = cls(hq, hkv, d, BS, d ** -0.5)
        backend.prefill_mode = mode
        outs[mode] = backend.forward(0, q, k, v, kv_cache, meta, sliding_window=window)
        assert backend.last_prefill_impl == ("varlen" if mode == "auto" else "sdpa")
    torch.testing.assert_close(outs["auto"], outs["sdpa"], atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 10])
def test_cuda_flash_varlen_kernel_matches_reference(window):
    gen = torch.Generator().manual_seed(2)
    lens_q, lens_k = [7, 30, 2], [7, 45, 19]
    q = torch.randn(sum(lens_q), HQ, 64, generator=gen)
    k = torch.randn(sum(lens_k), HKV, 64, generator=gen)
    v = torch.randn(sum(lens_k), HKV, 64, generator=gen)
    cu_q = [0, 7, 37, 39]
    cu_k = [0, 7, 52, 71]
    ref = _reference_varlen(q, k, v, cu_q, cu_k, 0.125, window)
    dev = torch.device("cuda")
    got = flash_varlen_prefill(
        q.to(dev, torch.bfloat16), k.to(dev, torch.bfloat16), v.to(dev, torch.bfloat16),
        torch.tensor(cu_q, dtype=torch.int32, device=dev),
        torch.tensor(cu_k, dtype=torch.int32, device=dev), max(lens_q), max(lens_k), 0.125,
        sliding_window=window)
    torch.testing.assert_close(got.float().cpu(), ref, atol=3e-2, rtol=3e-2)
