"""Paged KV block copies in one launch (Triton): ``dst[dst_ids[i]] = src[src_ids[i]]`` for every
``i``, between two KV caches of the same device (a peer's cache opened by CUDA IPC and the
reader's own, :mod:`pdserve.kv_transfer.nixl.direct_read`), and one segment of every block (a
range of layers) out of the host tier's pinned pool into the KV cache
(:func:`copy_block_segments`, :mod:`pdserve.runner.kv_tier_store`).

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


#: 32-bit words each iteration of a segment-copy program moves (32 KiB)
SEGMENT_CHUNK_WORDS = 8192
#: programs of a segment copy from host memory. A program reads pinned host memory over the
#: host link (unified virtual addressing) and waits for it most of its time: four keep the link
#: as busy as the copy engines do, and each takes an SM from the kernels running beside it
#: (docs/benchmarks.md, "Host-tier LOADs by layer range")
SEGMENT_COPY_PROGRAMS = 4


@triton.jit(do_not_specialize=["n"])
def _copy_segments_kernel(
    dst_ptr,  # [num_dst_blocks * words_per_block] int32 view of the destination
    src_ptr,  # [num_src_blocks * words_per_block] int32 view of the source (may be pinned host)
    dst_ids_ptr,  # [n] int32
    src_ids_ptr,  # [n] int32
    n,
    words_per_block,
    seg_offset,
    seg_words,
    CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    chunks = tl.cdiv(seg_words, CHUNK)
    for t in range(pid, n * chunks, tl.num_programs(0)):
        i = t // chunks
        offs = (t % chunks) * CHUNK + tl.arange(0, CHUNK)
        mask = offs < seg_words
        d = tl.load(dst_ids_ptr + i).to(tl.int64)
        s = tl.load(src_ids_ptr + i).to(tl.int64)
        x = tl.load(src_ptr + s * words_per_block + seg_offset + offs, mask=mask)
        tl.store(dst_ptr + d * words_per_block + seg_offset + offs, x, mask=mask)


def copy_block_segments(dst: torch.Tensor, src: torch.Tensor, dst_ids: torch.Tensor,
                        src_ids: torch.Tensor, start: int, stop: int) -> None:
    """Launch ``dst[dst_ids[i], start:stop] = src[src_ids[i], start:stop]`` for every ``i`` on
    the current stream, with :data:`SEGMENT_COPY_PROGRAMS` programs (the host tier's LOADs by
    layer range: ``start:stop`` indexes dim 1, the layers of a ``[num_blocks, L, ...]`` cache).

    Args:
        dst: the KV cache ``[num_blocks, L, ...]`` on a CUDA device, contiguous.
        src: blocks of the same per-block shape and dtype, contiguous, on that device or in
            pinned host memory (read through unified virtual addressing).
        dst_ids, src_ids: ``int32 [n]`` block ids on ``dst``'s device, each in range (the
            caller validates them: the kernel does not).
        start, stop: the range of dim 1 to copy (``0 <= start < stop <= L``).

    Raises:
        ValueError: see :func:`word_view`; a range outside dim 1.
    """
    n = int(dst_ids.numel())
    if n == 0:
        return
    layers = dst.shape[1]
    if not 0 <= start < stop <= layers:
        raise ValueError(f"layer range {start}:{stop} outside 0:{layers}")
    words = dst[0].numel() * dst.element_size() // 4
    per_layer = words // layers
    seg_words = (stop - start) * per_layer
    programs = min(SEGMENT_COPY_PROGRAMS, n * triton.cdiv(seg_words, SEGMENT_CHUNK_WORDS))
    _copy_segments_kernel[(programs,)](word_view(dst), word_view(src), dst_ids, src_ids, n,
                                       words, start * per_layer, seg_words,
                                       CHUNK=SEGMENT_CHUNK_WORDS, num_warps=8,
                                       **pdl.launch_options(dst.device))
