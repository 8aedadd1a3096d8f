"""The split-K MLA decode kernel (pdserve/kernels/mla_decode.py) against a float64 softmax over
the gathered latent entries and against the torch path (``decode_absorbed``), and the Triton MLA
backend against the torch one on a CUDA-graph decode batch (padding rows, no host metadata).

Without CUDA the kernels run under Triton's interpreter on small shapes (the tiny DeepSeek
models' latent: ``kv_lora_rank`` 32 + rotary 8, halves of 20 padded to 32 in registers)."""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import import_kernels

mk, HAS_CUDA = import_kernels("pdserve.kernels.mla_decode", "_mla_decode_split_kernel")
kvk, _ = import_kernels("pdserve.kernels.kv_cache", "_store_kv_kernel")
# the layers' Triton ops, for the whole-model test (interpreted on CPU)
import_kernels("pdserve.kernels.rms_norm", "_rms_norm_kernel")
import_kernels("pdserve.kernels.rotary", "_rotary_kernel")
import_kernels("pdserve.kernels.activation", "_silu_and_mul_kernel")
import_kernels("pdserve.kernels.moe", "_grouped_gemm_kernel")

from pdserve.attention.kv_quant import FP8_KV_DTYPE, dequantize  # noqa: E402
from pdserve.attention.metadata import build_attention_metadata, decode_metadata  # noqa: E402
from pdserve.attention.mla import MLAAttentionBackend, MLAGeometry, decode_absorbed  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
R, ROPE = 32, 8  # kv_lora_rank, qk_rope_head_dim
W, HALF, BS = R + ROPE, (R + ROPE) // 2, 16
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _case(context_lens: list[int], heads: int, dtype: torch.dtype, seed: int = 0,
          width: int = W):
    """Absorbed queries ``[B, H, W]``, a 2-layer latent cache with each sequence's blocks
    scattered, block tables (padded with an out-of-range id) and context lengths."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [max(1, -(-n // BS)) for n in context_lens]
    num_blocks = sum(per_seq) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(context_lens), max(per_seq) + 1), 10**6, dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    kv = torch.randn(num_blocks, 2, 2, 1, BS, width // 2, generator=gen)
    q = torch.randn(len(context_lens), heads, width, generator=gen) * 0.5
    return (q.to(DEVICE, dtype), kv.to(DEVICE, dtype), tables.to(DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE))


def _reference(q, kv, layer, tables, lens, scale, k_scale=1.0, v_scale=1.0, r=R):
    """float64 softmax of ``q . [c | k_pe]`` over each sequence's entries, averaging ``c``."""
    kv = kv.cpu()
    if kv.dtype == FP8_KV_DTYPE:
        k = dequantize(kv[:, :, 0], k_scale, torch.float64)
        v = dequantize(kv[:, :, 1], v_scale, torch.float64)
    else:
        k, v = kv[:, :, 0].double(), kv[:, :, 1].double()
    entries = torch.cat((k, v), dim=-1)  # [N, L, 1, BS, W]
    out = torch.zeros(q.shape[0], q.shape[1], r, dtype=torch.float64)
    for i, n in enumerate(lens.tolist()):
        if n == 0:
            continue
        pos = torch.arange(n)
        e = entries[tables[i].cpu().long()[pos // BS], layer, 0, pos % BS]  # [n, W]
        p = (q[i].double().cpu() @ e.T * scale).softmax(-1)
        out[i] = p @ e[:, :r]
    return out


def _rel(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize(("dtype", "heads", "num_splits"),
                         [(torch.float32, 4, 1), (torch.float32, 20, 3),
                          (torch.bfloat16, 16, 2)],
                         ids=["fp32-1split", "fp32-20heads-3splits", "bf16-2splits"])
def test_kernel_matches_float64_and_the_torch_path(dtype, heads, num_splits):
    lens = [1, 15, 16, 17, 70, 0]
    q, kv, tables, ctx = _case(lens, heads, dtype)
    scale = 24 ** -0.5
    out = mk.mla_decode_attention(q, kv, 1, tables, ctx, scale, R, num_splits=num_splits)
    ref = _reference(q, kv, 1, tables, ctx, scale)
    assert out.shape == (len(lens), heads, R)
    assert (out[-1] == 0).all(), "a sequence with no context gives zeros"
    for i in range(len(lens) - 1):
        assert _rel(out[i], ref[i]) < REL_TOL[dtype], f"context {lens[i]}"
    valid_tables = tables.clamp(max=kv.shape[0] - 1)
    torch_path = decode_absorbed(q, kv[:, 1], valid_tables, ctx, scale, R)
    assert _rel(torch_path[:-1], ref[:-1]) < REL_TOL[dtype]


@pytest.mark.parametrize(("r", "rope"), [(24, 8), (100, 4)],
                         ids=["halves-a-power-of-two", "values-in-the-v-tail"])
def test_kernel_tiles_of_other_latent_widths(r, rope):
    """Halves of 16 (no tail: its tile is all masked) and of 52 = 32 + 20 with latent values in
    the V slot's tail tile (``r - W/2 = 48 > 32``)."""
    lens = [3, 40, 17]
    q, kv, tables, ctx = _case(lens, 4, torch.float32, seed=2, width=r + rope)
    out = mk.mla_decode_attention(q, kv, 0, tables, ctx, 0.2, r, num_splits=2)
    assert out.shape == (3, 4, r)
    assert _rel(out, _reference(q, kv, 0, tables, ctx, 0.2, r=r)) < 1e-5


def test_kernel_reads_an_fp8_cache_with_the_layers_scales():
    lens = [5, 33, 48]
    q, kv, tables, ctx = _case(lens, 4, torch.float32, seed=1)
    k_scale, v_scale = 0.02, 0.05
    cache = torch.empty_like(kv, dtype=FP8_KV_DTYPE)
    cache[:, :, 0] = (kv[:, :, 0] / k_scale * 0.1).to(FP8_KV_DTYPE)
    cache[:, :, 1] = (kv[:, :, 1] / v_scale * 0.1).to(FP8_KV_DTYPE)
    scale = 0.3
    out = mk.mla_decode_attention(q, cache, 0, tables, ctx, scale, R, k_scale, v_scale,
                                  num_splits=2)
    ref = _reference(q, cache, 0, tables, ctx, scale, k_scale, v_scale)
    assert _rel(out, ref) < 1e-5
    # the scales matter: without them the result differs
    plain = mk.mla_decode_attention(q, cache, 0, tables, ctx, scale, R, num_splits=2)
    assert _rel(plain, ref) > 0.1


def test_kernel_refuses_bad_shapes():
    q, kv, tables, ctx = _case([3], 4, torch.float32)
    with pytest.raises(ValueError):
        mk.mla_decode_attention(q[..., :-2], kv, 0, tables, ctx, 1.0, R)
    with pytest.raises(ValueError):
        mk.mla_decode_attention(q, kv, 0, tables, ctx, 1.0, HALF - 1)
    with pytest.raises(ValueError):
        mk.mla_decode_attention(q, kv, 2, tables, ctx, 1.0, R)


@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8_KV_DTYPE])
def test_triton_backend_equals_torch_backend_on_a_graph_decode_batch(cache_dtype):
    """A pure-decode step on ``decode_metadata`` (as a CUDA graph replays it: a padding row with
    slot -1 and context 0): the Triton backend writes the same cache bits for the real rows,
    nothing for the padding row, and outputs what the torch backend outputs on the host-built
    metadata of the same step."""
    from pdserve.attention import mla_triton
    from pdserve.attention.kv_quant import KVCacheScales

    g = MLAGeometry(4, R, 16, ROPE, 16)
    tri = mla_triton.TritonMLAAttentionBackend(g, BS, 0.2)
    tri._kv_cache_kernels, tri._decode_kernels = kvk, mk  # the interpreted modules on CPU
    ref = MLAAttentionBackend(g, BS, 0.2)
    if cache_dtype == FP8_KV_DTYPE:
        scales = KVCacheScales((0.01, 0.01), (0.02, 0.02))
        tri.set_kv_cache_scales(scales)
        ref.set_kv_cache_scales(scales)
    gen = torch.Generator().manual_seed(3)
    cache = (torch.randn(8, 2, 2, 1, BS, HALF, generator=gen) * 0.1).to(DEVICE, cache_dtype)
    decodes = [([2, 5], 20), ([7], 3)]  # (blocks, tokens already cached)
    t = len(decodes)
    q_nope = torch.randn(t, 4, 16, generator=gen).to(DEVICE)
    q_pe = torch.randn(t, 4, ROPE, generator=gen).to(DEVICE)
    entry = torch.randn(t, W, generator=gen).to(DEVICE)
    kv_b = (torch.randn(4 * 32, R, generator=gen) * 0.2).to(DEVICE)
    host = build_attention_metadata([], decodes, BS, DEVICE)
    want_cache = cache.clone()
    want = ref.forward_mla(1, q_nope, q_pe, entry, kv_b, want_cache, host)
    pad = lambda x, v: torch.cat((x, torch.full_like(x[:1], v)))  # noqa: E731
    tables = torch.tensor([[2, 5], [7, 0], [0, 0]], dtype=torch.int32, device=DEVICE)
    meta = decode_metadata(pad(host.slot_mapping, -1), tables,
                           pad(host.decode_seq_lens, 0))
    got_cache = cache.clone()
    got = tri.forward_mla(1, pad(q_nope, 0.0), pad(q_pe, 0.0), pad(entry, 5.0), kv_b,
                          got_cache, meta)
    assert torch.equal(got_cache.float(), want_cache.float()), "the latent writes differ"
    assert _rel(got[:t], want) < (1e-4 if HAS_CUDA else 1e-5)


@pytest.mark.slow
def test_mla_kernel_compiles_for_hopper(hopper_compile):
    """The interpreter accepts code the compiler rejects: the MLA split kernel compiles for sm_90
    at DeepSeek-V2-Lite's shapes, bf16 and fp8 caches (tests/kernels/compile_for_hopper.py)."""
    from tests.kernels.compile_for_hopper import EXPECTED

    ok, failed, stderr = hopper_compile
    assert not failed.get("mla") and not failed.get("script"), (failed, stderr[-3000:])
    assert ok.get("mla") == EXPECTED["mla"], (ok, stderr[-3000:])


@pytest.mark.slow  # the whole model's Triton ops in the interpreter: about 10 s on a CPU
def test_whole_model_on_the_triton_path_gives_the_torch_paths_tokens(tmp_path):
    """A tiny DeepSeek-V2 (low-rank queries, group-limited routing) with the Triton MLA backend,
    so that every layer runs its Triton op (RMSNorm, rotary, SwiGLU, the fused MoE of the routed
    experts, the latent write and decode): greedy tokens of a mixed batch with a chunked prefill
    equal the torch path's."""
    import random

    from pdserve.attention.mla_triton import TritonMLAAttentionBackend
    from pdserve.runner.model_runner import ModelRunner
    from pdserve.testing.tiny_models import make_tiny_model
    from pdserve.types.engine_config import EngineConfig
    from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

    # two layers (the dense one and an MoE one) and a small vocabulary: the LM head's
    # interpreted GEMV would take most of the time
    path = str(make_tiny_model(tmp_path / "v2", "deepseek_v2", num_hidden_layers=2,
                               vocab_size=1024))

    def requests() -> list[DrivenRequest]:
        rng = random.Random(0)
        return [DrivenRequest(f"r{i}", [rng.randrange(3, 1024) for _ in range(n)], 4, greedy(4),
                              start_step=i, chunks=[n // 2, n - n // 2] if n > BS else None)
                for i, n in enumerate([1, BS + 9])]

    outputs = {}
    for triton_path in (False, True):
        # eager: the backend is swapped after start-up (on CUDA the runner starts on Triton)
        runner = ModelRunner(EngineConfig(model=path, device=str(DEVICE), dtype="float32",
                                          max_model_len=128, block_size=BS,
                                          num_gpu_blocks_override=32, enforce_eager=True))
        runner.allocate_kv_cache(32)
        started = runner.model.attn_backend
        if triton_path:
            backend = TritonMLAAttentionBackend(started.geometry, BS, started.scale)
            backend._kv_cache_kernels, backend._decode_kernels = kvk, mk
        else:
            backend = MLAAttentionBackend(started.geometry, BS, started.scale)
        runner.model.set_attention_backend(backend)
        reqs = requests()
        MiniScheduler(runner, 32).run(reqs)
        outputs[triton_path] = [r.output for r in reqs]
    assert outputs[True] == outputs[False]
    assert len({tuple(o) for o in outputs[False]}) == 2
