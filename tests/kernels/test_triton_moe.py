"""The fused mixture-of-experts kernels (pdserve/kernels/moe.py) against the torch path.

On a machine without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``,
set by ``import_kernels`` before ``triton`` is imported), on small shapes; with CUDA they run
compiled on the GPU. The whole module is skipped when Triton is not installed.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import import_kernels

moe, HAS_CUDA = import_kernels("pdserve.kernels.moe", "_grouped_gemm_kernel")
act, _ = import_kernels("pdserve.kernels.activation", "_silu_and_mul_kernel")

from pdserve.layers.fused_moe import FusedMoE, route_topk_softmax  # noqa: E402

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def _routing(t: int, e: int, k: int, seed: int, skew: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=gen)
    if skew:  # most tokens on expert 0, some experts without any
        logits[:, 0] += 4.0
        logits[:, e // 2:] -= 8.0
    weights, ids = route_topk_softmax(logits, k, True, torch.float32)
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("t, e, k, block_m", [(1, 4, 2, 16), (37, 8, 2, 16), (20, 6, 3, 64)])
def test_moe_align_groups_every_pair_once_by_expert(t, e, k, block_m):
    _, ids = _routing(t, e, k, seed=t, skew=t > 30)
    a = moe.moe_align(ids, e, block_m)
    rows = a.sorted_pairs.cpu()
    num_rows = int(a.num_rows.item())
    num_pairs = t * k
    assert num_rows % block_m == 0 and rows.numel() >= num_rows
    used = rows[:num_rows]
    real = used[used < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once
    assert (rows[num_rows:] == num_pairs).all()
    flat = ids.reshape(-1).cpu()
    for b in range(num_rows // block_m):
        block = used[b * block_m:(b + 1) * block_m]
        block = block[block < num_pairs]
        expert = int(a.block_expert[b])
        assert (flat[block] == expert).all(), f"block {b} mixes experts"
    # experts in increasing order, each run starting at a block boundary
    experts = [int(x) for x in a.block_expert[:num_rows // block_m].cpu()]
    assert experts == sorted(experts)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t, skew", [(1, False), (5, False), (70, True)])
def test_fused_moe_matches_torch_path(dtype, t, skew):
    e, h, i, k = 8, 64, 48, 2
    layer = FusedMoE(e, h, i, torch.float32, DEVICE)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        layer.w13_weight.copy_(0.1 * torch.randn(layer.w13_weight.shape, generator=gen))
        layer.w2_weight.copy_(0.1 * torch.randn(layer.w2_weight.shape, generator=gen))
    x = torch.randn(t, h, generator=gen).to(DEVICE)
    weights, ids = _routing(t, e, k, seed=t, skew=skew)
    ref = layer.forward_torch(x, weights, ids)
    layer = layer.to(dtype)
    got = moe.fused_moe(x.to(dtype), layer.w13_weight, layer.w2_weight, weights.to(dtype), ids)
    assert got.dtype == dtype and got.shape == (t, h)
    assert rel_err(got, ref) < REL_TOL[dtype]


def test_fused_moe_rejects_bad_shapes_and_handles_no_tokens():
    w13 = torch.zeros(4, 32, 16, device=DEVICE)
    w2 = torch.zeros(4, 16, 16, device=DEVICE)
    ids = torch.zeros(3, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="shapes"):
        moe.fused_moe(torch.zeros(3, 8, device=DEVICE), w13, w2, ids.float(), ids)
    out = moe.fused_moe(torch.zeros(0, 16, device=DEVICE), w13, w2,
                        torch.zeros(0, 2, device=DEVICE), ids[:0])
    assert out.shape == (0, 16)


@pytest.mark.slow  # a Triton kernel in the interpreter: seconds on a CPU
def test_moe_model_fused_path_matches_torch_path(tmp_path):
    """A tiny Qwen3-MoE on the Triton attention backend (fused MoE, attention, norms) gives the
    logits of the torch path on a mixed batch."""
    from pdserve import attention
    from pdserve.attention import build_attention_metadata
    from pdserve.layers.fused_moe import MoEConfig
    from pdserve.models.arch_config import ArchConfig
    from pdserve.models.qwen3_moe import Qwen3MoeCausalLM

    cfg = ArchConfig(architecture="Qwen3MoeForCausalLM", hidden_size=64, intermediate_size=96,
                     num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=97,
                     max_position_embeddings=128, qk_norm=True, rope_theta=1000.0,
                     moe=MoEConfig(num_experts=6, top_k=2, moe_intermediate_size=32,
                                   norm_topk_prob=True, mlp_only_layers=(1,)))
    bs = 4
    model = Qwen3MoeCausalLM(cfg, torch.float32, DEVICE, bs, 128)
    model.init_dummy_weights(seed=3)
    assert isinstance(model.layers[0].mlp.experts, FusedMoE)
    prefills = [(0, [3, 5], 6), (5, [0, 1, 2], 3)]
    decodes = [([7, 8, 9], 9), ([10], 0)]
    meta = build_attention_metadata(prefills, decodes, bs, DEVICE)
    gen = torch.Generator().manual_seed(10)
    ids = torch.randint(0, 97, (meta.num_tokens,), generator=gen).to(DEVICE)
    pos = torch.tensor([0, 1, 2, 3, 4, 5, 5, 6, 7, 9, 0], device=DEVICE)
    kv0 = torch.randn(16, 2, 2, 2, bs, 16, generator=gen).to(DEVICE)
    a = model.attn_backend
    args = (a.num_heads, a.num_kv_heads, a.head_dim, a.block_size, a.scale)
    logits = {}
    for fused in (False, True):
        backend = attention.TritonAttentionBackend if fused else attention.TorchAttentionBackend
        model.set_attention_backend(backend(*args))
        assert model.layers[0].mlp.experts.use_triton == fused
        logits[fused] = model(ids, pos, kv0.clone(), meta, torch.arange(meta.num_tokens))
    assert rel_err(logits[True], logits[False]) < 1e-4


@pytest.mark.slow
def test_grouped_gemm_compiles_for_hopper(hopper_compile):
    """The interpreter accepts code the compiler rejects: compile the grouped GEMM for sm_90 (no
    GPU needed; Triton's bundled ptxas) in a fresh process with the interpreter off
    (tests/kernels/compile_for_hopper.py, run once for the session)."""
    from tests.kernels.compile_for_hopper import EXPECTED

    ok, failed, stderr = hopper_compile
    assert not failed.get("moe") and not failed.get("script"), (failed, stderr[-3000:])
    assert ok.get("moe") == EXPECTED["moe"], (ok, stderr[-3000:])
