"""FP8 (e4m3) KV cache in the Triton kernels and both attention backends, against references.

The references dequantize the stored fp8 values with the layer's scales and attend in float64
(``reference_decode`` of the Triton attention tests); the kernels must read exactly what the write
stored, and the Triton write must store the bytes torch's rounding gives (subnormals included).
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import import_kernels

pd, HAS_CUDA = import_kernels("pdserve.kernels.paged_decode", "_paged_decode_split_kernel")
kvk, _ = import_kernels("pdserve.kernels.kv_cache", "_store_kv_kernel")

from pdserve.attention import kv_quant  # noqa: E402
from pdserve.attention.kv_quant import FP8_KV_DTYPE, KVCacheScales  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402
    make_paged_case, reference_decode, rel_err)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def test_quantize_saturates_rounds_and_dequantizes_with_the_scale():
    x = torch.tensor([0.0, 1.3, -3.7, 500.0, -1e4, 17.3, 0.1])
    q = kv_quant.quantize(x, 0.5)
    assert q.dtype == FP8_KV_DTYPE
    back = kv_quant.dequantize(q, 0.5, torch.float32)
    # saturates at +-448 * scale instead of giving NaN; rounds to 3 mantissa bits
    assert back.tolist()[:6] == [0.0, 1.25, -3.75, 224.0, -224.0, 18.0]
    assert abs(back[6].item() - 0.1) < 0.1 * 2 ** -4
    assert kv_quant.round_trip(x, 1.0, torch.float32) is x  # a full-precision cache: unchanged
    with pytest.raises(ValueError):
        KVCacheScales((1.0,), (0.0,))


def test_store_kv_cache_quantizes_with_the_layer_scales():
    gen = torch.Generator().manual_seed(11)
    num_blocks, layers, heads, bs, dim = 6, 3, 2, 4, 64
    kv = torch.zeros(num_blocks, layers, 2, heads, bs, dim, dtype=FP8_KV_DTYPE, device=DEVICE)
    k = (torch.randn(5, heads, dim, generator=gen) * 4).to(DEVICE)
    v = (torch.randn(5, heads, dim, generator=gen) * 0.05).to(DEVICE)  # many subnormals
    k[0, 0, :3] = torch.tensor([1000.0, -1000.0, 3.3])  # saturates (scale 0.5: max 224)
    slots = torch.tensor([0, 7, 23, -1, 13], dtype=torch.int64, device=DEVICE)
    kvk.store_kv_cache(k, v, kv, 1, slots, k_scale=0.5, v_scale=2.0)
    stored = kv.cpu().float()
    assert stored[:, [0, 2]].abs().sum() == 0, "other layers untouched"
    written = set()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        written.add((s // bs, s % bs))
        for which, x, scale in ((0, k[t], 0.5), (1, v[t], 2.0)):
            got = stored[s // bs, 1, which, :, s % bs]
            want = kv_quant.quantize(x.cpu(), scale).float()
            assert torch.equal(got, want)
    assert stored[0, 1, 0, 0, 0, :2].tolist() == [448.0, -448.0]
    for b in range(num_blocks):
        for off in range(bs):
            if (b, off) not in written:
                assert stored[b, 1, :, :, off].abs().sum() == 0, "a skipped slot was written"


@pytest.mark.parametrize("q_dtype,dot_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_reads_fp8_cache_with_scales(q_dtype, dot_dtype, num_splits):
    context_lens = [1, 15, 17, 100, 0]
    q, kv, bt, ctx = make_paged_case(context_lens, 4, 2, 64, 16, torch.float32, seed=5)
    k_scale, v_scale = 0.25, 2.0
    fp8 = torch.empty_like(kv, dtype=FP8_KV_DTYPE)
    fp8[:, :, 0] = kv_quant.quantize(kv[:, :, 0] * 3, k_scale)
    fp8[:, :, 1] = kv_quant.quantize(kv[:, :, 1], v_scale)
    # what the kernel must attend over: the stored values times the scales
    deq = torch.stack([kv_quant.dequantize(fp8[:, :, 0], k_scale, torch.float64),
                       kv_quant.dequantize(fp8[:, :, 1], v_scale, torch.float64)], dim=2)
    q = q.to(q_dtype)
    out = torch.full_like(q, float("nan"))
    pd.paged_decode_attention(q, fp8, 1, bt, ctx, 0.125, out=out, num_splits=num_splits,
                              k_scale=k_scale, v_scale=v_scale, fp8_dot_dtype=dot_dtype)
    ref = reference_decode(q, deq, 1, bt, ctx, 0.125)
    assert not out.isnan().any()
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    for i, n in enumerate(context_lens[:-1]):
        assert rel_err(out[i], ref[i]) < tol, f"sequence with context {n}"
    assert (out[-1] == 0).all()


def _mixed_batch():
    from pdserve.attention import build_attention_metadata

    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, bs = 4, 2, 64, 4
    kv = kv_quant.quantize(torch.randn(16, 2, 2, hkv, bs, dim, generator=gen), 1.0).to(DEVICE)
    prefills = [(0, [3, 5], 6), (5, [0, 1, 2], 3)]  # (num_computed, block_ids, query_len)
    decodes = [([7, 8, 9], 9), ([10], 0), ([11, 12, 13, 14], 13)]  # (block_ids, num_computed)
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, dim, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    return (hq, hkv, dim, bs), kv, q, k, v, meta


def test_triton_backend_matches_torch_backend_on_fp8_cache():
    """Prefill (fresh and over cached context) plus decodes through both backends on an fp8
    cache with per-layer scales; both store the same bytes and attend alike."""
    from pdserve.attention import TorchAttentionBackend, TritonAttentionBackend

    geo, kv, q, k, v, meta = _mixed_batch()
    scales = KVCacheScales((1.0, 0.5), (1.0, 2.0))
    backends = [TorchAttentionBackend(*geo, geo[2] ** -0.5), TritonAttentionBackend(*geo, geo[2] ** -0.5)]
    outs, caches = [], []
    for backend in backends:
        backend.set_kv_cache_scales(scales)
        cache = kv.clone()
        outs.append(backend.forward(1, q, k, v, cache, meta))
        caches.append(cache.cpu().float())
    ref_cache, tri_cache = caches
    assert torch.equal(tri_cache, ref_cache)
    assert torch.equal(ref_cache[:, 0], kv[:, 0].cpu().float()), "layer 0 untouched"
    assert rel_err(outs[1], outs[0]) < 1e-2


def test_fp8_attention_reads_what_it_stored():
    """The torch backend on an fp8 cache equals the torch backend on a float32 cache that holds
    the dequantized values (and gets the step's K/V already rounded): attention sees exactly
    the stored values, the fresh prefill included."""
    from pdserve.attention import TorchAttentionBackend

    geo, kv8, q, k, v, meta = _mixed_batch()
    k_scale, v_scale = 0.5, 2.0
    scales = KVCacheScales((1.0, k_scale), (1.0, v_scale))
    fp8_backend = TorchAttentionBackend(*geo, geo[2] ** -0.5)
    fp8_backend.set_kv_cache_scales(scales)
    out8 = fp8_backend.forward(1, q, k, v, kv8.clone(), meta)

    kv32 = kv8.float()
    kv32[:, 1, 0] *= k_scale
    kv32[:, 1, 1] *= v_scale
    k32 = kv_quant.round_trip(k, k_scale, FP8_KV_DTYPE)
    v32 = kv_quant.round_trip(v, v_scale, FP8_KV_DTYPE)
    out32 = TorchAttentionBackend(*geo, geo[2] ** -0.5).forward(1, q, k32, v32, kv32, meta)
    assert rel_err(out8, out32) < 1e-6
