"""The tensor-core decode kernel of an fp8 cache (CUDA C++, ``pdserve.kernels.paged_decode_fp8``)
against a float64 reference and against the Triton split kernel, and when it is chosen.

The kernel itself needs a CUDA GPU of compute capability 8.9 or later; on the CPU the tests check
that it is never chosen and that its switch parses.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import import_kernels

pd, HAS_CUDA = import_kernels("pdserve.kernels.paged_decode", "_paged_decode_split_kernel")

from pdserve.attention.kv_quant import FP8_KV_DTYPE  # noqa: E402
from pdserve.kernels import paged_decode_fp8 as pf  # noqa: E402
from tests.kernels.test_triton_attention import (  # noqa: E402
    make_paged_case, reference_decode, rel_err)

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
HAS_FP8_MMA = HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9)
needs_kernel = pytest.mark.skipif(not HAS_FP8_MMA, reason="needs a CUDA GPU of capability 8.9+")

# Every position of a block past its sequence's context holds this byte: an e4m3 NaN.
NAN_BYTE = 0x7F


@pytest.fixture
def kernel_config(monkeypatch):
    """Set ``PDSERVE_DECODE_KERNEL_CONFIG`` for the test (a JSON string or ""), cleared after."""

    def set_config(raw: str) -> None:
        monkeypatch.setenv("PDSERVE_DECODE_KERNEL_CONFIG", raw)
        pd.decode_kernel_config.cache_clear()

    yield set_config
    monkeypatch.delenv("PDSERVE_DECODE_KERNEL_CONFIG", raising=False)
    pd.decode_kernel_config.cache_clear()


def fp8_case(lens: list[int], group: int, block_size: int, dtype: torch.dtype, seed: int = 0):
    """A paged fp8 case (head_dim 128, 2 KV heads) whose slots past each context hold NaN bytes."""
    q, kv, bt, ctx = make_paged_case(lens, 2 * group, 2, 128, block_size, torch.float32, seed=seed)
    kv = (kv * 2).to(FP8_KV_DTYPE)
    raw = kv.view(torch.uint8)
    for i, n in enumerate(lens):
        if n % block_size:
            raw[int(bt[i, n // block_size]), :, :, :, n % block_size:] = NAN_BYTE
    return q.to(dtype), kv, bt, ctx


def test_switch_parses_and_the_kernel_is_never_chosen_on_cpu(kernel_config):
    kernel_config('{"fp8_mma": 0}')
    assert pd.decode_kernel_config().fp8_mma == 0
    for bad in ('{"fp8_mma": 2}', '{"fp8_mma_warps": 0}'):
        kernel_config(bad)
        with pytest.raises(ValueError, match="PDSERVE_DECODE_KERNEL_CONFIG"):
            pd.decode_kernel_config()
    q, kv, _, _ = fp8_case([5], 2, 16, torch.bfloat16)
    assert not pf.supports(q.cpu(), kv.cpu()[:, 0], 2, None, torch.float16)


def test_a_kernel_that_does_not_compile_leaves_the_call_to_triton(monkeypatch, caplog):
    def refuse(*args):
        raise RuntimeError("Kernel compilation failed: no NVRTC")

    monkeypatch.setattr(pf, "_compiled", refuse)
    with caplog.at_level("WARNING", logger="pdserve.kernels"):
        assert pf._compiles.__wrapped__(2, 4, True, True, 0) is False
    assert "runs the Triton kernel" in caplog.text and "no NVRTC" in caplog.text


@needs_kernel
def test_kernel_applies_only_where_it_can():
    q, kv, _, _ = fp8_case([5], 2, 16, torch.bfloat16)
    layer = kv[:, 1]
    assert pf.supports(q, layer, 2, None, torch.float16)
    assert not pf.supports(q, layer, 2, 64, torch.float16)  # sliding window
    assert not pf.supports(q, layer, 2, None, torch.bfloat16)  # dot products in bf16
    assert not pf.supports(q.float(), layer, 2, None, torch.float16)
    assert not pf.supports(q, layer.to(torch.bfloat16), 2, None, torch.float16)
    q16, kv16, _, _ = fp8_case([5], 16, 16, torch.bfloat16)
    assert not pf.supports(q16, kv16[:, 1], 16, None, torch.float16)  # more than 8 heads a group
    q8, kv8, _, _ = fp8_case([5], 2, 8, torch.bfloat16)
    assert not pf.supports(q8, kv8[:, 1], 2, None, torch.float16)  # blocks under 16 tokens


@needs_kernel
@pytest.mark.parametrize("group", [1, 2, 4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_kernel_matches_reference_and_triton(kernel_config, group, dtype, block_size):
    lens = [1, 0, 15, 16, 17, 63, 64, 65, 300, 1000, 2047]
    q, kv, bt, ctx = fp8_case(lens, group, block_size, dtype, seed=group)
    k_scale, v_scale = 0.37, 1.9
    scales = torch.tensor([k_scale, v_scale], device=kv.device).view(1, 1, 2, 1, 1, 1)
    ref = reference_decode(q, kv.float() * scales,
                           1, bt, ctx, 128**-0.5)
    for splits in (None, 1, 7):
        kernel_config("")
        out = pd.paged_decode_attention(q, kv, 1, bt, ctx, 128**-0.5, num_splits=splits,
                                        k_scale=k_scale, v_scale=v_scale)
        kernel_config('{"fp8_mma": 0}')
        triton_out = pd.paged_decode_attention(q, kv, 1, bt, ctx, 128**-0.5, num_splits=splits,
                                               k_scale=k_scale, v_scale=v_scale)
        assert torch.isfinite(out).all()
        assert out[1].abs().max().item() == 0  # no context: zeros
        assert rel_err(out, ref) < 6e-3, splits
        assert rel_err(out, triton_out.float()) < 6e-3, splits


@needs_kernel
def test_kernel_replays_in_a_cuda_graph():
    q, kv, bt, ctx = fp8_case([40, 900, 7, 1500], 2, 16, torch.bfloat16, seed=3)
    out = torch.empty_like(q)
    eager = pd.paged_decode_attention(q, kv, 0, bt, ctx, 128**-0.5, num_splits=4).clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        pd.paged_decode_attention(q, kv, 0, bt, ctx, 128**-0.5, out=out, num_splits=4)  # compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pd.paged_decode_attention(q, kv, 0, bt, ctx, 128**-0.5, out=out, num_splits=4)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    ctx.copy_(torch.tensor([1, 2, 3, 4], dtype=torch.int32))  # the graph reads new lengths
    graph.replay()
    want = pd.paged_decode_attention(q, kv, 0, bt, ctx, 128**-0.5, num_splits=4)
    torch.cuda.synchronize()
    assert torch.equal(out, want)
