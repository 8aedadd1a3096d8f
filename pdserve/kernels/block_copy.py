"""Paged KV block copies in one launch (Triton): ``dst[dst_ids[i]] = src[src_ids[i]]`` for every
``i``, between two KV caches of the same device (a peer's cache opened by CUDA IPC and the
reader's own, :mod:`pdserve.kv_transfer.nixl.direct_read`).

Why one kernel: a reader's blocks and the owner's are rarely consecutive on both sides, and
copying them run by run costs one ``copy_`` call per run on the host (tens of microseconds
each, on the hand-off's critical path), while a gather into a temporary and a scatter out of it
moves every byte twice. This kernel reads each source block once and writes it once, with the
block ids read on the device. Import only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl

#: 32-bit words each program copies (64 KiB): large enough that the per-program index loads
#: are negligible, small enough that a 16-token block of a small model still spreads over
#: several programs
WORDS_PER_PROGRAM = 16384


@triton.jit
def _copy_blocks_kernel(
    dst_ptr,  # [num_dst_blocks * words_per_block] int32 view of the destination cache
    src_ptr,  # [num_src_blocks * words_per_block] int32 view of the source cache
    dst_ids_ptr,  # [n] int32
    src_ids_ptr,  # [n] int32
    words_per_block,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    i = tl.program_id(0)
    j = tl.program_id(1)
    d = tl.load(dst_ids_ptr + i).to(tl.int64)
    s = tl.load(src_ids_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < words_per_block
    x = tl.load(src_ptr + s * words_per_block + offs, mask=mask)
    tl.store(dst_ptr + d * words_per_block + offs, x, mask=mask)


def word_view(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` (``[num_blocks, ...]``, contiguous, any dtype) as ``int32 [num_blocks * W]``
    where ``W`` is a block's size in 4-byte words.

    Raises:
        ValueError: the cache is not contiguous or a block is not a whole number of words.
    """
    if not cache.is_contiguous():
        raise ValueError("block copies need a contiguous KV cache")
    block_bytes = cache[0].numel() * cache.element_size()
    if block_bytes % 4:
        raise ValueError(f"a block of {block_bytes} bytes is not a whole number of 32-bit words")
    return cache.view(torch.uint8).view(-1).view(torch.int32)


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, dst_ids: torch.Tensor,
                src_ids: torch.Tensor) -> None:
    """Launch the copy ``dst[dst_ids[i]] = src[src_ids[i]]`` on the current stream.

    Args:
        dst, src: KV caches ``[num_blocks, ...]`` on one device, contiguous, with the same
            per-block shape and dtype (the caller checks; :func:`word_view` raises for layouts
            the kernel cannot address).
        dst_ids, src_ids: ``int32 [n]`` block ids on that device, each in range (the caller
            validates them: the kernel does not).

    Raises:
        ValueError: see :func:`word_view`.
    """
    n = int(dst_ids.numel())
    if n == 0:
        return
    words = dst[0].numel() * dst.element_size() // 4
    grid = (n, triton.cdiv(words, WORDS_PER_PROGRAM))
    _copy_blocks_kernel[grid](word_view(dst), word_view(src), dst_ids, src_ids, words,
                              BLOCK=WORDS_PER_PROGRAM, num_warps=8,
                              **pdl.launch_options(dst.device))
