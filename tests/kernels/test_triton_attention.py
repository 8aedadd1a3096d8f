"""Triton decode-path kernels against pure-torch references, and the CUDA graph helper.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set
here before ``triton`` is imported), on small shapes; with CUDA they run compiled on the GPU. The
whole module is skipped when Triton is not installed.
"""

from __future__ import annotations


import pytest
import torch

from tests.support.triton_kernels import import_kernels

pd, HAS_CUDA = import_kernels("pdserve.kernels.paged_decode", "_paged_decode_split_kernel")
kvk, _ = import_kernels("pdserve.kernels.kv_cache", "_store_kv_kernel")
rn, _ = import_kernels("pdserve.kernels.rms_norm", "_rms_norm_kernel")
rot, _ = import_kernels("pdserve.kernels.rotary", "_rotary_kernel")
act, _ = import_kernels("pdserve.kernels.activation", "_silu_and_mul_kernel")

from pdserve.runner import cuda_graphs  # noqa: E402
from pdserve.runner.piecewise_graphs import PiecewiseGraphs  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# Relative-error bounds (||out - ref|| / ||ref||) by input dtype; see the module docstring of
# pdserve.kernels.paged_decode for what is computed in fp32.
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    # The references are built on the CPU (float64); compare there.
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def make_paged_case(
    context_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_layers: int = 2,
    seed: int = 0,
):
    """Random KV cache with each sequence's blocks scattered over a shuffled pool."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-n // block_size)) for n in context_lens]
    max_blocks = max(blocks_per_seq) + 1  # one unused column, filled with an out-of-range id
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    kv = torch.randn(num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim, generator=gen)
    block_tables = torch.full((len(context_lens), max_blocks), 10**6, dtype=torch.int32)
    used = 0
    for i, nb in enumerate(blocks_per_seq):
        block_tables[i, :nb] = perm[used : used + nb].to(torch.int32)
        used += nb
    q = torch.randn(len(context_lens), num_q_heads, head_dim, generator=gen)
    ctx = torch.tensor(context_lens, dtype=torch.int32)
    return (
        q.to(DEVICE, dtype),
        kv.to(DEVICE, dtype),
        block_tables.to(DEVICE),
        ctx.to(DEVICE),
    )


def reference_decode(q, kv, layer, block_tables, context_lens, scale, window=None):
    """Plain softmax attention in float64 over positions gathered through the block tables (the
    last ``window`` positions only, when given)."""
    num_seqs, num_q_heads, head_dim = q.shape
    num_kv_heads, block_size = kv.shape[3], kv.shape[4]
    kv = kv.cpu()
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=torch.float64)
    for i in range(num_seqs):
        n = int(context_lens[i])
        if n == 0:
            continue
        pos = torch.arange(0 if window is None else max(0, n - window), n)
        blocks = block_tables[i].cpu().long()[pos // block_size]
        k = kv[blocks, layer, 0, :, pos % block_size].double().cpu()  # [n, Hkv, D]
        v = kv[blocks, layer, 1, :, pos % block_size].double().cpu()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double().cpu(), k) * scale
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize(
    ("dtype", "num_q_heads", "num_kv_heads", "head_dim", "block_size", "num_splits"),
    [
        (torch.float32, 4, 2, 64, 16, 1),  # GQA group 2, single pass
        (torch.float32, 4, 2, 64, 16, 3),  # split-K path with a merge
        (torch.bfloat16, 8, 2, 128, 16, 4),  # group 4, head_dim 128
        (torch.float16, 2, 2, 64, 8, 2),  # MHA, another block size
        (torch.float32, 3, 1, 64, 32, 5),  # group 3 (not a power of two), more splits than blocks
        (torch.float32, 4, 2, 80, 16, 2),  # head_dim not a power of two (padded and masked)
    ],
)
def test_paged_decode_matches_reference(dtype, num_q_heads, num_kv_heads, head_dim, block_size, num_splits):
    context_lens = [1, 15, 16, 17, 100, 0]
    q, kv, bt, ctx = make_paged_case(context_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    pd.paged_decode_attention(q, kv, 1, bt, ctx, scale, out=out, num_splits=num_splits)
    ref = reference_decode(q, kv, 1, bt, ctx, scale)
    assert not out.isnan().any(), "some outputs were not written"
    assert (out[-1] == 0).all(), "a sequence with no context must give zeros"
    assert rel_err(out, ref) < REL_TOL[dtype]
    # Every sequence on its own, too (a row-wise error could hide in the global norm).
    for i, n in enumerate(context_lens[:-1]):
        assert rel_err(out[i], ref[i]) < REL_TOL[dtype], f"sequence with context {n}"


@pytest.mark.parametrize(("window", "num_splits"), [(7, 1), (16, 3), (1, 2), (40, 4)])
def test_paged_decode_sliding_window_matches_reference(window, num_splits):
    """Only the last ``window`` positions of each context are attended; contexts shorter than
    the window attend everything."""
    context_lens = [1, 15, 16, 17, 100, 0, 45]
    q, kv, bt, ctx = make_paged_case(context_lens, 4, 2, 64, 8, torch.float32, seed=5)
    out = torch.full_like(q, float("nan"))
    pd.paged_decode_attention(q, kv, 1, bt, ctx, 0.125, out=out, num_splits=num_splits,
                              block_n=16, sliding_window=window)
    ref = reference_decode(q, kv, 1, bt, ctx, 0.125, window=window)
    assert not out.isnan().any()
    for i, n in enumerate(context_lens):
        assert rel_err(out[i], ref[i]) < 1e-5 or n == 0, f"sequence with context {n}"
    with pytest.raises(ValueError, match="sliding_window"):
        pd.paged_decode_attention(q, kv, 1, bt, ctx, 0.125, sliding_window=0)


def test_paged_decode_short_sequence_next_to_long_one_never_reads_empty_pieces(monkeypatch):
    """Pieces are cut from the batch's longest context, so a short sequence's later pieces are
    empty and leave their partial output unwritten; the merge must not read it. Scratch buffers
    start as NaN here so that any such read shows."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    context_lens = [1, 300, 17, 0]
    q, kv, bt, ctx = make_paged_case(context_lens, 4, 2, 64, 16, torch.float32, seed=3)
    monkeypatch.setattr(torch, "empty", nan_empty)
    out = pd.paged_decode_attention(q, kv, 0, bt, ctx, 0.125, num_splits=8, block_n=16)
    monkeypatch.undo()
    ref = reference_decode(q, kv, 0, bt, ctx, 0.125)
    assert not out.isnan().any()
    for i, n in enumerate(context_lens):
        assert rel_err(out[i], ref[i]) < 1e-5 or n == 0, f"sequence with context {n}"
    assert (out[-1] == 0).all()


def test_decode_kernel_config_from_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_DECODE_KERNEL_CONFIG", '{"block_n": 64, "min_splits": 4}')
    pd.decode_kernel_config.cache_clear()
    try:
        cfg = pd.decode_kernel_config()
        assert (cfg.block_n, cfg.min_splits, cfg.num_warps) == (64, 4, pd.DecodeKernelConfig().num_warps)
        assert pd.choose_num_splits(4096, 8, torch.device("cpu")) == 4
        monkeypatch.setenv("PDSERVE_DECODE_KERNEL_CONFIG", '{"min_splits": 1}')
        pd.decode_kernel_config.cache_clear()
        assert pd.choose_num_splits(4096, 8, torch.device("cpu")) == 1
        for bad in ("{", '{"blockn": 1}', '{"block_n": 0}', "[1]", '{"num_warps": true}'):
            monkeypatch.setenv("PDSERVE_DECODE_KERNEL_CONFIG", bad)
            pd.decode_kernel_config.cache_clear()
            with pytest.raises(ValueError, match="PDSERVE_DECODE_KERNEL_CONFIG"):
                pd.decode_kernel_config()
    finally:
        monkeypatch.delenv("PDSERVE_DECODE_KERNEL_CONFIG")
        pd.decode_kernel_config.cache_clear()


def test_paged_decode_default_splits_and_layer_selection():
    q, kv, bt, ctx = make_paged_case([33, 7], 4, 2, 64, 16, torch.float32, num_layers=3, seed=1)
    for layer in range(3):
        out = pd.paged_decode_attention(q, kv, layer, bt, ctx, 0.2)
        assert rel_err(out, reference_decode(q, kv, layer, bt, ctx, 0.2)) < 1e-5


def test_paged_decode_rejects_bad_shapes():
    q, kv, bt, ctx = make_paged_case([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        pd.paged_decode_attention(q[:, :3], kv, 0, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="layer"):
        pd.paged_decode_attention(q, kv, 2, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="dtype"):
        pd.paged_decode_attention(q.half(), kv, 0, bt, ctx, 1.0)
    with pytest.raises(ValueError, match="num_splits"):
        pd.paged_decode_attention(q, kv, 0, bt, ctx, 1.0, num_splits=0)


def test_choose_num_splits_depends_on_batch_only_without_context_hint():
    dev = torch.device("cpu")
    assert pd.choose_num_splits(1, 8, dev) == pd.choose_num_splits(1, 8, dev, None)
    many = pd.choose_num_splits(4096, 8, dev)
    assert many == pd.decode_kernel_config().min_splits
    assert 1 <= pd.choose_num_splits(1, 1, dev) <= pd.MAX_NUM_SPLITS
    assert pd.choose_num_splits(1, 1, dev, max_context_len=10) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_cache_writes_slots_and_skips_negative(dtype):
    gen = torch.Generator().manual_seed(2)
    num_blocks, layers, heads, bs, dim = 6, 3, 3, 4, 64
    kv = torch.randn(num_blocks, layers, 2, heads, bs, dim, generator=gen).to(DEVICE, dtype)
    before = kv.clone()
    k = torch.randn(5, heads, dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(5, heads, dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([0, 7, 23, -1, 13], dtype=torch.int64, device=DEVICE)
    kvk.store_kv_cache(k, v, kv, 2, slots)
    expected = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expected[s // bs, 2, 0, :, s % bs] = k[t]
            expected[s // bs, 2, 1, :, s % bs] = v[t]
    assert torch.equal(kv, expected)


def test_store_kv_cache_from_strided_views():
    """k and v as views into a fused QKV projection output (non-contiguous token stride)."""
    gen = torch.Generator().manual_seed(3)
    heads, dim = 2, 64
    qkv = torch.randn(4, (4 + 2 * heads) * dim, generator=gen).to(DEVICE)
    k = qkv[:, 4 * dim : (4 + heads) * dim].view(4, heads, dim)
    v = qkv[:, (4 + heads) * dim :].view(4, heads, dim)
    kv = torch.zeros(3, 1, 2, heads, 4, dim, device=DEVICE)
    slots = torch.tensor([4, 5, 6, 11], dtype=torch.int32, device=DEVICE)
    kvk.store_kv_cache(k, v, kv, 0, slots)
    flat_k = kv[:, 0, 0].permute(0, 2, 1, 3).reshape(-1, heads, dim)
    flat_v = kv[:, 0, 1].permute(0, 2, 1, 3).reshape(-1, heads, dim)
    assert torch.equal(flat_k[slots.long()], k) and torch.equal(flat_v[slots.long()], v)


def test_store_then_attend_round_trip():
    """Write a sequence's K/V with store_kv_cache and read it back through attention."""
    gen = torch.Generator().manual_seed(4)
    n, hq, hkv, dim, bs = 21, 4, 2, 64, 8
    k = torch.randn(n, hkv, dim, generator=gen).to(DEVICE)
    v = torch.randn(n, hkv, dim, generator=gen).to(DEVICE)
    q = torch.randn(1, hq, dim, generator=gen).to(DEVICE)
    kv = torch.randn(5, 1, 2, hkv, bs, dim, generator=gen).to(DEVICE)
    table = torch.tensor([[4, 0, 2]], dtype=torch.int32, device=DEVICE)
    pos = torch.arange(n)
    slots = (table[0].cpu().long()[pos // bs] * bs + pos % bs).to(DEVICE)
    kvk.store_kv_cache(k, v, kv, 0, slots)
    lens = torch.tensor([n], dtype=torch.int32, device=DEVICE)
    out = pd.paged_decode_attention(q, kv, 0, table, lens, dim**-0.5, num_splits=2)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),  # [1, Hq, 1, D]
        k.repeat_interleave(2, 1).transpose(0, 1).unsqueeze(0),
        v.repeat_interleave(2, 1).transpose(0, 1).unsqueeze(0),
    )[0].transpose(0, 1)
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_kv_cache_equals_indexing(dtype):
    """The Triton gather of prefill contexts returns what the torch backend's advanced indexing
    of the same slots returns (3 KV heads: a padded head tile)."""
    gen = torch.Generator().manual_seed(6)
    num_blocks, layers, heads, bs, dim = 7, 3, 3, 4, 64
    kv = torch.randn(num_blocks, layers, 2, heads, bs, dim, generator=gen).to(DEVICE, dtype)
    blocks = torch.tensor([5, 5, 5, 0, 6, 2, 2, 3], dtype=torch.int64, device=DEVICE)
    offsets = torch.tensor([0, 1, 3, 2, 0, 3, 1, 0], dtype=torch.int64, device=DEVICE)
    k, v = kvk.gather_kv_cache(kv, 1, blocks, offsets, dtype)
    assert k.shape == (8, heads, dim) and k.is_contiguous() and k.dtype == dtype
    assert torch.equal(k, kv[blocks, 1, 0, :, offsets])
    assert torch.equal(v, kv[blocks, 1, 1, :, offsets])
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    assert kvk.gather_kv_cache(kv, 1, empty, empty, dtype)[0].shape == (0, heads, dim)
    with pytest.raises(ValueError, match="layer"):
        kvk.gather_kv_cache(kv, 3, blocks, offsets, dtype)


def test_gather_kv_cache_dequantizes_fp8():
    """From an fp8 cache the gather multiplies by the layer's scales, as the torch backend's
    dequantize does."""
    from pdserve.attention.kv_quant import FP8_KV_DTYPE, dequantize

    gen = torch.Generator().manual_seed(7)
    kv = (torch.randn(4, 2, 2, 2, 8, 32, generator=gen) * 50).to(FP8_KV_DTYPE).to(DEVICE)
    blocks = torch.tensor([3, 1, 1], dtype=torch.int64, device=DEVICE)
    offsets = torch.tensor([7, 0, 5], dtype=torch.int64, device=DEVICE)
    k, v = kvk.gather_kv_cache(kv, 0, blocks, offsets, torch.float32, 0.5, 0.25)
    assert torch.equal(k, dequantize(kv[blocks, 0, 0, :, offsets], 0.5, torch.float32))
    assert torch.equal(v, dequantize(kv[blocks, 0, 1, :, offsets], 0.25, torch.float32))


def torch_rms_norm(x, w, eps):
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_with_and_without_residual(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 96, generator=gen).to(DEVICE, dtype)
    r = torch.randn(3, 96, generator=gen).to(DEVICE, dtype)
    w = torch.randn(96, generator=gen).to(DEVICE, dtype)
    out = rn.rms_norm(x, w, 1e-6)
    assert rel_err(out, torch_rms_norm(x, w, 1e-6)) < REL_TOL[dtype]
    r_in = r.clone()
    out = rn.rms_norm(x, w, 1e-6, residual=r)
    summed = x + r_in
    if HAS_CUDA:
        assert torch.equal(r, summed), "residual must hold x + residual afterwards"
    else:
        # The interpreter truncates fp32 -> bf16 instead of rounding to nearest: allow one ulp.
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
        assert torch.allclose(r.float(), summed.float(), rtol=ulp, atol=0), "residual must hold x + residual"
    assert rel_err(out, torch_rms_norm(summed, w, 1e-6)) < REL_TOL[dtype]


def rope_tables(max_pos, dim, theta=10000.0):
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return ang.cos().float(), ang.sin().float()


def torch_rope(x, positions, cos, sin):
    half = x.shape[-1] // 2
    c = torch.cat([cos, cos], -1)[positions][:, None, :]
    s = torch.cat([sin, sin], -1)[positions][:, None, :]
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * c + rot * s


@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_embedding_in_place_on_qkv_view(with_norm):
    gen = torch.Generator().manual_seed(6)
    t, hq, hk, dim = 5, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * dim, generator=gen).to(DEVICE)
    q = qkv[:, : hq * dim].view(t, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(t, hk, dim)
    positions = torch.tensor([0, 3, 7, 100, 511], device=DEVICE)
    cos, sin = rope_tables(512, dim)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    w = torch.randn(dim, generator=gen).to(DEVICE) if with_norm else None
    q_in, k_in, v_in = q.clone(), k.clone(), qkv[:, (hq + hk) * dim :].clone()
    if with_norm:
        q_in, k_in = torch_rms_norm(q_in, w, 1e-6), torch_rms_norm(k_in, w, 1e-6)
    rot.rotary_embedding(q, positions, cos, sin, norm_weight=w)
    rot.rotary_embedding(k, positions, cos, sin, norm_weight=w)
    assert rel_err(q, torch_rope(q_in, positions, cos, sin)) < 1e-5
    assert rel_err(k, torch_rope(k_in, positions, cos, sin)) < 1e-5
    assert torch.equal(qkv[:, (hq + hk) * dim :], v_in), "v must be left alone"


@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_embedding_qk_one_launch_equals_two(with_norm):
    """Queries and keys in one launch, each with its own norm weight and epsilon, equal the
    reference; v (after k in the fused projection) is left alone."""
    gen = torch.Generator().manual_seed(7)
    t, hq, hk, dim = 4, 4, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * dim, generator=gen).to(DEVICE)
    q = qkv[:, : hq * dim].view(t, hq, dim)
    k = qkv[:, hq * dim : (hq + hk) * dim].view(t, hk, dim)
    positions = torch.tensor([1, 2, 50, 300], device=DEVICE)
    cos, sin = (x.to(DEVICE) for x in rope_tables(512, dim))
    wq, wk = (torch.randn(dim, generator=gen).to(DEVICE) if with_norm else None for _ in range(2))
    q_in, k_in, v_in = q.clone(), k.clone(), qkv[:, (hq + hk) * dim :].clone()
    if with_norm:
        q_in, k_in = torch_rms_norm(q_in, wq, 1e-6), torch_rms_norm(k_in, wk, 1e-3)
    rot.rotary_embedding_qk(q, k, positions, cos, sin, wq, wk, 1e-6, 1e-3)
    assert rel_err(q, torch_rope(q_in, positions, cos, sin)) < 1e-5
    assert rel_err(k, torch_rope(k_in, positions, cos, sin)) < 1e-5
    assert torch.equal(qkv[:, (hq + hk) * dim :], v_in), "v must be left alone"
    with pytest.raises(ValueError, match="both"):
        rot.rotary_embedding_qk(q, k, positions, cos, sin, wq if with_norm else cos[0], None)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rotary_with_kv_write_equals_rotary_then_store(cache_dtype, with_norm):
    """The fused launch leaves the same queries and keys (in place, on views of a QKV
    projection) and the same cache bits as the rotary launch followed by store_kv_cache, fp8
    scales included; a negative slot is rotated but not written."""
    gen = torch.Generator().manual_seed(17)
    t, hq, hk, dim, bs = 5, 4, 2, 32, 4
    qkv = torch.randn(t, (hq + 2 * hk) * dim, generator=gen).to(DEVICE, torch.bfloat16)
    positions = torch.tensor([0, 3, 7, 100, 511], device=DEVICE)
    cos, sin = (x.to(DEVICE) for x in rope_tables(512, dim))
    wq, wk = (torch.randn(dim, generator=gen).to(DEVICE) if with_norm else None for _ in range(2))
    slots = torch.tensor([3, -1, 9, 17, 0], device=DEVICE)
    kv0 = torch.randn(6, 3, 2, hk, bs, dim, generator=gen).to(DEVICE).to(cache_dtype)
    scales = dict(k_scale=0.5, v_scale=2.0)

    def views(x):
        return (x[:, : hq * dim].view(t, hq, dim), x[:, hq * dim : (hq + hk) * dim].view(t, hk, dim),
                x[:, (hq + hk) * dim :].view(t, hk, dim))

    ref_qkv, ref_kv = qkv.clone(), kv0.clone()
    q, k, v = views(ref_qkv)
    rot.rotary_embedding_qk(q, k, positions, cos, sin, wq, wk, 1e-6, 1e-3)
    kvk.store_kv_cache(k, v, ref_kv, 1, slots, **scales)
    got_qkv, got_kv = qkv.clone(), kv0.clone()
    q, k, v = views(got_qkv)
    rot.rotary_embedding_qk_store(q, k, v, positions, cos, sin, got_kv, 1, slots, wq, wk, 1e-6,
                                  1e-3, **scales)
    assert torch.equal(got_qkv, ref_qkv)
    assert torch.equal(got_kv.view(torch.uint8), ref_kv.view(torch.uint8))
    assert not torch.equal(got_kv.view(torch.uint8), kv0.view(torch.uint8))
    with pytest.raises(ValueError, match="does not match"):
        rot.rotary_embedding_qk_store(q, k, v, positions, cos, sin, got_kv[:, :, :, :1], 1, slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_torch(dtype):
    gen = torch.Generator().manual_seed(8)
    x = (3 * torch.randn(5, 2 * 80, generator=gen)).to(DEVICE, dtype)
    out = torch.full((5, 80), float("nan"), dtype=dtype, device=DEVICE)
    act.silu_and_mul(x, out=out)
    ref = torch.nn.functional.silu(x[:, :80].float()) * x[:, 80:].float()
    assert not out.isnan().any()
    assert rel_err(out, ref) < REL_TOL[dtype]
    with pytest.raises(ValueError):
        act.silu_and_mul(x[:, :79])


@pytest.fixture
def few_decode_splits(monkeypatch):
    """Under the interpreter, which runs every program in Python: the decode kernel splits a
    context only where there are fewer than 4 (sequence, KV head) programs (so a batch of one
    sequence with 2 KV heads still splits in two and runs the merge kernel). The split and merge
    arithmetic itself is checked against the reference by the paged-decode tests above. On a
    GPU this changes nothing."""
    if HAS_CUDA:
        yield
        return
    monkeypatch.setenv("PDSERVE_DECODE_KERNEL_CONFIG", '{"min_splits": 1, "programs_per_sm": 1}')
    pd.decode_kernel_config.cache_clear()
    yield
    monkeypatch.delenv("PDSERVE_DECODE_KERNEL_CONFIG")
    pd.decode_kernel_config.cache_clear()


def _tiny_model(qk_norm: bool, block_size: int = 4):
    from pdserve.models.arch_config import ArchConfig
    from pdserve.models.llama import CausalLM

    cfg = ArchConfig(architecture="Qwen3ForCausalLM" if qk_norm else "LlamaForCausalLM",
                     hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                     num_kv_heads=2, head_dim=32, vocab_size=97, max_position_embeddings=128,
                     qk_norm=qk_norm, rope_theta=1000.0)
    model = CausalLM(cfg, torch.float32, DEVICE, block_size, 128)
    model.init_dummy_weights(seed=3)
    with torch.no_grad():  # non-trivial norm weights, so a skipped norm shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    return model


def _use_kernels(model, enabled: bool):
    """Switch a model between the plain torch path and the fused Triton path."""
    from pdserve import attention

    a = model.attn_backend
    args = (a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.scale)
    if enabled:
        model.set_attention_backend(attention.TritonAttentionBackend(*args))
    else:
        model.set_attention_backend(attention.TorchAttentionBackend(*args))


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
@pytest.mark.parametrize("qk_norm", [False, True])
def test_fused_model_path_matches_torch_path(qk_norm, few_decode_splits):
    """Fused forward (mixed batch) and the graph-safe decode step equal the torch path."""
    from pdserve.attention import build_attention_metadata, decode_metadata

    model = _tiny_model(qk_norm)
    bs = 4
    gen = torch.Generator().manual_seed(10)
    prefills = [(0, [3, 5], 6), (5, [0, 1, 2], 3)]  # (num_computed, block_ids, query_len)
    decodes = [([7, 8, 9], 9), ([10], 0), ([11, 12, 13, 14], 13)]  # (block_ids, num_computed)
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    t = meta.num_tokens
    ids = torch.randint(0, 97, (t,), generator=gen).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7, 9, 0, 13], device=DEVICE)
    idx = torch.tensor([5, 8, 9, 10, 11], device=DEVICE)
    kv0 = torch.randn(16, 2, 2, 2, bs, 32, generator=gen).to(DEVICE)
    logits, caches = {}, {}
    for fused in (False, True):
        _use_kernels(model, fused)
        caches[fused] = kv0.clone()
        logits[fused] = model(ids, pos, caches[fused], meta, idx)
    assert rel_err(logits[True], logits[False]) < 1e-4
    assert rel_err(caches[True], caches[False]) < 1e-5

    # The same step through the stages of piecewise CUDA graphs (run eagerly): the projection
    # writes into their QKV buffer and attention (the Triton rotary with the KV write) works in
    # place on its views, without a copy.
    pieces = PiecewiseGraphs(model, [16], capture=False)
    assert pieces.capture()
    q, k, v, _ = model.layers[0].attention_inputs(model.embed(ids), qkv_out=pieces.buffers.projection[:t])
    assert [x.data_ptr() for x in (q, k, v)] == [b.data_ptr() for b in pieces.buffers.inputs]
    kv_pieces = kv0.clone()
    assert rel_err(pieces.run(ids, pos, kv_pieces, meta, idx), logits[False]) < 1e-4
    assert rel_err(kv_pieces, caches[False]) < 1e-5

    # Pure decode: the graph-safe decode step (with one padding row) against the torch path.
    dmeta = build_attention_metadata([], decodes, bs, DEVICE)
    d_ids, d_pos = ids[-3:], pos[-3:]
    _use_kernels(model, False)
    kv_ref = kv0.clone()
    ref = model(d_ids, d_pos, kv_ref, dmeta, torch.arange(3, device=DEVICE))
    _use_kernels(model, True)
    kv_got = kv0.clone()
    tables = torch.zeros(4, 6, dtype=torch.int32, device=DEVICE)
    tables[:3, :4] = dmeta.decode_block_tables
    got = model(
        torch.cat([d_ids, d_ids.new_zeros(1)]), torch.cat([d_pos, d_pos.new_zeros(1)]), kv_got,
        decode_metadata(torch.cat([dmeta.slot_mapping, dmeta.slot_mapping.new_full((1,), -1)]),
                        tables,
                        torch.cat([dmeta.decode_seq_lens, dmeta.decode_seq_lens.new_zeros(1)])))
    assert got.shape == (4, 97)
    assert rel_err(got[:3], ref) < 1e-4
    assert rel_err(kv_got, kv_ref) < 1e-5, "the padding row must not write the cache"


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_fused_gemma3_path_matches_torch_path():
    """Gemma 3 (a sliding layer with a 4-token window, then a global one) on the Triton path:
    the rotary kernel after Gemma's q/k norm and the windowed decode kernel equal the torch
    path on a mixed batch whose contexts are longer than the window."""
    from pdserve.attention import build_attention_metadata
    from pdserve.models.gemma3 import Gemma3ForCausalLM
    from pdserve.models.arch_config import ArchConfig

    cfg = ArchConfig(architecture="Gemma3ForCausalLM", hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=97,
                     max_position_embeddings=128, qk_norm=True, rope_theta=1e6,
                     tie_word_embeddings=True, sliding_window=4,
                     layer_types=["sliding_attention", "full_attention"],
                     rope_local_theta=1e4, query_pre_attn_scalar=24.0)
    bs = 4
    model = Gemma3ForCausalLM(cfg, torch.float32, DEVICE, bs, 128)
    model.init_dummy_weights(seed=3)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.copy_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(9)))
    gen = torch.Generator().manual_seed(11)
    prefills = [(0, [3, 5], 6), (5, [0, 1, 2], 3)]
    decodes = [([7, 8, 9], 9), ([10], 0), ([11, 12, 13, 14], 13)]
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    ids = torch.randint(0, 97, (meta.num_tokens,), generator=gen).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7, 9, 0, 13], device=DEVICE)
    kv0 = torch.randn(16, 2, 2, 2, bs, 32, generator=gen).to(DEVICE)
    logits, caches = {}, {}
    for fused in (False, True):
        _use_kernels(model, fused)
        caches[fused] = kv0.clone()
        logits[fused] = model(ids, pos, caches[fused], meta)
    assert rel_err(logits[True], logits[False]) < 1e-4
    assert rel_err(caches[True], caches[False]) < 1e-5


class _EagerReplay:
    """Stands in for a captured graph: "replay" runs the forward pass on the static buffers."""

    def __init__(self, graphs, bs):
        self.graphs, self.bs = graphs, bs

    def replay(self):
        self.graphs.replays.append(self.bs)
        self.graphs._outputs[self.bs] = self.graphs.forward(self.graphs._views(self.bs))


class _EagerGraphRunner(cuda_graphs.CUDAGraphRunner):
    """CUDAGraphRunner's buffers, padding and slicing without CUDA (forward runs eagerly)."""

    def __init__(self, forward, specs, sizes, device):
        self.forward, self.specs, self.device = forward, dict(specs), torch.device(device)
        self.capture_sizes, self.max_batch_size = sorted(sizes), max(sizes)
        self.buffers = {n: torch.full((self.max_batch_size, *sp.shape), sp.pad_value, dtype=sp.dtype)
                        for n, sp in self.specs.items()}
        self._graphs = {}
        self._outputs = {}
        self.replays = []

    def capture(self):
        self._graphs = {bs: _EagerReplay(self, bs) for bs in self.capture_sizes}


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_runner_graph_decode_path_matches_eager(tiny_qwen3_path, monkeypatch, request):
    """The runner's graph decode step (input building, padding to a captured size, sampling
    outside) gives the eager step's greedy tokens. On a GPU both runs use the fused kernels.
    Without CUDA the graph run uses them under the interpreter, with the graph replay replaced
    by an eager call, and the eager run takes the torch attention path (which the fused path
    equals: test_fused_model_path_matches_torch_path), halving the interpreter's work."""
    import random

    from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy
    from pdserve.types.engine_config import EngineConfig
    from pdserve.runner import decode_graphs
    from pdserve.runner import model_runner as runner_mod

    if not HAS_CUDA:  # on a GPU the real graphs are captured and replayed
        monkeypatch.setattr(decode_graphs, "CUDAGraphRunner", _EagerGraphRunner)
        request.getfixturevalue("few_decode_splits")  # both runs use the same configuration
    outputs = {}
    for use_graphs in (False, True):
        runner = runner_mod.ModelRunner(EngineConfig(
            model=tiny_qwen3_path, device=DEVICE.type, dtype="float32", max_model_len=64,
            block_size=4, max_num_seqs=5, num_gpu_blocks_override=64,
            piecewise_cuda_graph_max_tokens=0))  # prefills eager: decode graphs only
        _use_kernels(runner.model, use_graphs or HAS_CUDA)
        runner.use_cuda_graphs = use_graphs
        runner.allocate_kv_cache(64)
        assert (runner.decode_graphs is not None) == use_graphs
        if use_graphs:
            assert runner.decode_graphs.capture_sizes == [1, 2, 4, 5]
        rng = random.Random(0)
        reqs = [DrivenRequest(f"r{i}", [rng.randrange(3, 1000) for _ in range(n)], 5, greedy(5),
                              start_step=s)
                for i, (n, s) in enumerate([(3, 0), (9, 0), (1, 1), (5, 3)])]
        MiniScheduler(runner, 64).run(reqs)
        outputs[use_graphs] = [r.output for r in reqs]
        if use_graphs and not HAS_CUDA:  # pure-decode steps of 1..4 requests, padded (3 -> 4)
            assert 4 in runner.decode_graphs.replays and len(runner.decode_graphs.replays) >= 3
    assert outputs[True] == outputs[False]


def test_capture_sizes_and_padding_choice():
    sizes = cuda_graphs.default_capture_sizes(40)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 40 and sizes == sorted(set(sizes))
    assert cuda_graphs.default_capture_sizes(3) == [1, 2, 3]
    assert cuda_graphs.padded_batch_size(5, sizes) == 8
    assert cuda_graphs.padded_batch_size(8, sizes) == 8
    assert cuda_graphs.padded_batch_size(41, sizes) is None


def test_graph_runner_refuses_cpu():
    specs = {"x": cuda_graphs.StaticInputSpec((), torch.int64, 0)}
    with pytest.raises(ValueError, match="CUDA"):
        cuda_graphs.CUDAGraphRunner(lambda inp: inp["x"], specs, [1], torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_graph_replay_of_decode_attention_matches_eager():
    """Capture store_kv + paged attention for padded batch sizes and replay with fresh inputs."""
    hq, hkv, dim, bs, layers, max_blocks = 8, 2, 128, 16, 2, 8
    num_blocks = 64
    kv = torch.randn(num_blocks, layers, 2, hkv, bs, dim, device=DEVICE, dtype=torch.bfloat16)

    def forward(inp):
        q = inp["q"]
        kvk.store_kv_cache(inp["k"], inp["v"], kv, 1, inp["slot_mapping"])
        return pd.paged_decode_attention(q, kv, 1, inp["block_tables"], inp["context_lens"], dim**-0.5)

    specs = {
        "q": cuda_graphs.StaticInputSpec((hq, dim), torch.bfloat16, 0),
        "k": cuda_graphs.StaticInputSpec((hkv, dim), torch.bfloat16, 0),
        "v": cuda_graphs.StaticInputSpec((hkv, dim), torch.bfloat16, 0),
        "slot_mapping": cuda_graphs.StaticInputSpec((), torch.int64, -1),
        "block_tables": cuda_graphs.StaticInputSpec((max_blocks,), torch.int32, 0),
        "context_lens": cuda_graphs.StaticInputSpec((), torch.int32, 0),
    }
    runner = cuda_graphs.CUDAGraphRunner(forward, specs, [1, 2, 4, 8], DEVICE)
    runner.capture()
    for n in (1, 3, 8):
        # Contexts fit the narrower block tables passed below (max_blocks - 1 columns).
        ctx_list = [int(x) for x in torch.randint(1, (max_blocks - 1) * bs + 1, (n,))]
        tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in range(n)]).int().to(DEVICE)
        slots = torch.tensor(
            [int(tables[i, (c - 1) // bs]) * bs + (c - 1) % bs for i, c in enumerate(ctx_list)], device=DEVICE
        )
        inputs = {
            "q": torch.randn(n, hq, dim, device=DEVICE, dtype=torch.bfloat16),
            "k": torch.randn(n, hkv, dim, device=DEVICE, dtype=torch.bfloat16),
            "v": torch.randn(n, hkv, dim, device=DEVICE, dtype=torch.bfloat16),
            "slot_mapping": slots,
            "block_tables": tables[:, : max_blocks - 1],  # narrower than the static buffer
            "context_lens": torch.tensor(ctx_list, dtype=torch.int32, device=DEVICE),
        }
        got = runner.run(inputs).clone()
        ref = reference_decode(inputs["q"], kv, 1, tables, inputs["context_lens"], dim**-0.5)
        assert got.shape == (n, hq, dim)
        assert rel_err(got, ref) < REL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_paged_decode_long_context_on_gpu():
    """Long contexts through the default split heuristic on the GPU."""
    q, kv, bt, ctx = make_paged_case([4000, 1, 2500, 16], 16, 8, 128, 16, torch.bfloat16, num_layers=1)
    out = pd.paged_decode_attention(q, kv, 0, bt, ctx, 128**-0.5)
    assert rel_err(out, reference_decode(q, kv, 0, bt, ctx, 128**-0.5)) < REL_TOL[torch.bfloat16]


def test_triton_backend_matches_torch_backend_on_mixed_batch():
    """Prefill (fresh and with cached context) plus decodes through both backends."""
    from pdserve.attention import (
        TorchAttentionBackend, TritonAttentionBackend, build_attention_metadata)

    gen = torch.Generator().manual_seed(7)
    hq, hkv, dim, bs = 4, 2, 64, 4
    kv = torch.randn(16, 2, 2, hkv, bs, dim, generator=gen).to(DEVICE)
    prefills = [(0, [3, 5], 6), (5, [0, 1, 2], 3)]  # (num_computed, block_ids, query_len)
    decodes = [([7, 8, 9], 9), ([10], 0), ([11, 12, 13, 14], 13)]  # (block_ids, num_computed)
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    t = meta.num_tokens
    q = torch.randn(t, hq, dim, generator=gen).to(DEVICE)
    k = torch.randn(t, hkv, dim, generator=gen).to(DEVICE)
    v = torch.randn(t, hkv, dim, generator=gen).to(DEVICE)
    kv_ref, kv_tri = kv.clone(), kv.clone()
    ref = TorchAttentionBackend(hq, hkv, dim, bs, dim**-0.5).forward(1, q, k, v, kv_ref, meta)
    got = TritonAttentionBackend(hq, hkv, dim, bs, dim**-0.5).forward(1, q, k, v, kv_tri, meta)
    assert torch.equal(kv_tri, kv_ref), "both backends must write the same KV"
    assert rel_err(got, ref) < 1e-5


def test_triton_backend_matches_torch_backend_with_sliding_window():
    """Decodes whose contexts are longer than the window, through both backends."""
    from pdserve.attention import (
        TorchAttentionBackend, TritonAttentionBackend, build_attention_metadata)

    gen = torch.Generator().manual_seed(8)
    hq, hkv, dim, bs = 4, 2, 32, 4
    kv = torch.randn(16, 2, 2, hkv, bs, dim, generator=gen).to(DEVICE)
    prefills = [(2, [0, 1, 2], 9)]
    decodes = [([7, 8, 9], 9), ([10], 0), ([11, 12, 13, 14], 13)]
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, h, dim, generator=gen).to(DEVICE) for h in (hq, hkv, hkv))
    args = (hq, hkv, dim, bs, dim**-0.5)
    ref = TorchAttentionBackend(*args).forward(0, q, k, v, kv.clone(), meta, sliding_window=5)
    got = TritonAttentionBackend(*args).forward(0, q, k, v, kv.clone(), meta, sliding_window=5)
    full = TorchAttentionBackend(*args).forward(0, q, k, v, kv.clone(), meta)
    assert rel_err(got, ref) < 1e-5
    assert rel_err(full[-1], ref[-1]) > 1e-2, "the window must change a long decode"


@pytest.mark.slow
def test_kernels_compile_for_hopper(hopper_compile):
    """The interpreter accepts code the compiler rejects: every kernel of the decode path and the
    sampler compiles for sm_90 (no GPU needed; Triton's bundled ptxas) in a fresh process with
    the interpreter off (tests/kernels/compile_for_hopper.py, run once for the session)."""
    from tests.kernels.compile_for_hopper import EXPECTED

    ok, failed, stderr = hopper_compile
    assert not failed.get("attention") and not failed.get("script"), (failed, stderr[-3000:])
    assert ok.get("attention") == EXPECTED["attention"], (ok, stderr[-3000:])
