"""The one-launch block copy (pdserve/kernels/block_copy.py) against torch indexing, for the
cache dtypes pdserve serves (float32, bf16, fp8 e4m3) and blocks larger than one program's
share; and that it compiles for sm_90.

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by
``import_kernels`` before ``triton`` is imported) on small shapes.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.triton_kernels import import_kernels

block_copy, HAS_CUDA = import_kernels("pdserve.kernels.block_copy", "_copy_blocks_kernel")

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("block_shape", [(2, 2, 2, 4, 8),  # 256 elements: part of a program
                                         (1, 2, 1, 16, 1100)])  # > WORDS_PER_PROGRAM words
def test_copies_the_named_blocks_and_nothing_else(dtype, block_shape):
    gen = torch.Generator().manual_seed(0)
    n_src, n_dst, n = 9, 11, 5
    src = torch.randn(n_src, *block_shape, generator=gen).clamp(-100, 100).to(dtype).to(DEVICE)
    dst = torch.zeros(n_dst, *block_shape, dtype=dtype, device=DEVICE)
    src_ids = torch.randperm(n_src, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(n_dst, generator=gen)[:n].tolist()
    block_copy.copy_blocks(dst, src, torch.tensor(dst_ids, dtype=torch.int32, device=DEVICE),
                           torch.tensor(src_ids, dtype=torch.int32, device=DEVICE))
    raw_dst, raw_src = dst.view(torch.uint8).cpu(), src.view(torch.uint8).cpu()
    for d, s in zip(dst_ids, src_ids):
        assert torch.equal(raw_dst[d], raw_src[s])
    untouched = sorted(set(range(n_dst)) - set(dst_ids))
    assert int(raw_dst[untouched].sum()) == 0


def test_refuses_layouts_it_cannot_address():
    with pytest.raises(ValueError, match="contiguous"):
        block_copy.word_view(torch.zeros(4, 8, device=DEVICE)[:, ::2])
    with pytest.raises(ValueError, match="32-bit words"):
        block_copy.word_view(torch.zeros(4, 3, dtype=torch.bfloat16, device=DEVICE))


@pytest.mark.parametrize("n", [6, 9, 12])
def test_the_same_gpu_read_plans_one_launch_with_padded_id_rows(monkeypatch, n):
    """The reader's copy (pdserve/kv_transfer/nixl/direct_read.py) through the kernel: one
    operation, id rows padded to 16 bytes and only the asked blocks copied (on CPU the kernel
    path is forced, the kernel interpreted)."""
    from pdserve.kv_transfer.nixl import direct_read

    monkeypatch.setattr(direct_read, "_kernel_copies", lambda dst, src: True)
    monkeypatch.setattr(direct_read, "_block_copy_kernels", lambda: block_copy)
    gen = torch.Generator().manual_seed(n)
    src = torch.randn(12, 2, 2, 4, 8, generator=gen).to(DEVICE)
    dst = torch.zeros(14, 2, 2, 4, 8, device=DEVICE)
    src_ids = torch.randperm(12, generator=gen)[:n].tolist()
    dst_ids = torch.randperm(14, generator=gen)[:n].tolist()
    assert len(direct_read.block_runs(dst_ids, src_ids)) > direct_read.MAX_KERNEL_FREE_RUNS
    plan = direct_read.plan_copy(dst, src, dst_ids, src_ids)
    assert plan.kernel_ids.shape == (2, n + (-n % 4)) and plan.chunk == n
    assert direct_read.issue_copy(dst, src, plan) == 1
    for d, s in zip(dst_ids, src_ids):
        assert torch.equal(dst[d].cpu(), src[s].cpu())
    untouched = sorted(set(range(14)) - set(dst_ids))
    assert float(dst[untouched].abs().sum()) == 0.0
    # a few runs stay slice copies (one DMA copy each)
    plan = direct_read.plan_copy(dst, src, [0, 1, 2, 7], [3, 4, 5, 0])
    assert plan.kernel_ids is None and plan.runs == [(0, 3, 3), (7, 0, 1)]


def test_block_copy_compiles_for_hopper(hopper_compile):
    """The interpreter accepts code the compiler rejects: compile the kernel for sm_90 (no GPU
    needed; tests/kernels/compile_for_hopper.py, run once for the session)."""
    from tests.kernels.compile_for_hopper import EXPECTED

    ok, failed, stderr = hopper_compile
    assert not failed.get("copy") and not failed.get("script"), (failed, stderr[-3000:])
    assert ok.get("copy") == EXPECTED["copy"], (ok, stderr[-3000:])
