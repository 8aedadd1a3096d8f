"""Reads of a peer's KV blocks that this process can address directly: the owner's KV cache
opened by CUDA IPC on the same GPU (:mod:`.cuda_ipc`), or the owner's host mirror mapped from
shared memory in host-buffer mode (:mod:`.shared_host`). The reader copies the claimed blocks
itself on a side CUDA stream; :class:`DirectPeer` has the transfer interface of
:class:`~pdserve.kv_transfer.nixl.agent.NixlAgent` (post, check, telemetry, release), so the
load tracker treats it like a NIXL READ and sends the owner "done" when it completes.

Between two caches on one GPU, blocks in more than :data:`MAX_KERNEL_FREE_RUNS` runs are copied
by one kernel launch (:mod:`pdserve.kernels.block_copy`: each byte read and written once, the
block ids read on the device); fewer runs, and without Triton, on CPU tensors (tests stand in
two CPU tensors for the two caches; :class:`DirectPeer` then copies synchronously) and from host
memory, :func:`copy_blocks` uses plain torch copies.
"""

from __future__ import annotations

import functools
import importlib.util
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer.nixl.agent import block_runs
from pdserve.utils import phase_trace

# Same device: up to this many runs of consecutive blocks are copied run by run (no temporary
# memory); beyond, blocks are gathered and scattered (index_select / index_copy_) in chunks of
# at most GATHER_CHUNK_BYTES of temporary device memory. From host to device every run is one
# copy (an asynchronous DMA from pinned memory).
MAX_RUN_COPIES = 64
GATHER_CHUNK_BYTES = 64 << 20
# Same device with Triton: up to this many runs are still copied run by run (a run is one DMA
# copy, which moves a long run faster than the kernel and costs less host time), beyond them
# one launch of the block-copy kernel (docs/benchmarks.md, "same-GPU block copies").
MAX_KERNEL_FREE_RUNS = 4


@dataclass
class CopyPlan:
    """A validated block copy, ready to issue (:func:`plan_copy`).

    Attributes:
        runs: ``[(dst_start, src_start, num_blocks), ...]`` when copied run by run, else None.
        dst_idx, src_idx: ``int64 [n]`` block ids on the tensors' devices for the gather path.
        chunk: blocks per gather chunk; with ``kernel_ids``, the blocks to copy.
        kernel_ids: ``int32 [2, m]`` (destination ids, source ids, each row padded to a
            multiple of 4) in pinned host memory when the copy is one
            :mod:`pdserve.kernels.block_copy` launch, else None.
    """

    runs: list[tuple[int, int, int]] | None
    dst_idx: torch.Tensor | None = None
    src_idx: torch.Tensor | None = None
    chunk: int = 0
    kernel_ids: torch.Tensor | None = None


@functools.lru_cache(maxsize=1)
def _block_copy_kernels():
    """:mod:`pdserve.kernels.block_copy`, or None without Triton."""
    if importlib.util.find_spec("triton") is None:
        return None
    from pdserve.kernels import block_copy

    return block_copy


def _kernel_copies(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether a copy from ``src`` into ``dst`` is one block-copy kernel launch: both on one
    CUDA device, contiguous, blocks of whole 32-bit words, and Triton installed."""
    return (dst.is_cuda and dst.device == src.device and dst.is_contiguous()
            and src.is_contiguous() and (dst[0].numel() * dst.element_size()) % 4 == 0
            and _block_copy_kernels() is not None)


def plan_copy(dst: torch.Tensor, src: torch.Tensor, dst_ids: list[int], src_ids: list[int],
              gather_chunk_bytes: int = GATHER_CHUNK_BYTES) -> CopyPlan:
    """Validate a block copy ``src[src_ids[i]] -> dst[dst_ids[i]]`` and choose how to issue it
    (all host-side work, so that a timed copy measures the copy alone).

    Args:
        dst: ``[num_dst_blocks, ...]`` destination cache.
        src: ``[num_src_blocks, ...]`` source cache; same per-block shape and dtype, on the same
            device or in (pinned) host memory.
        dst_ids, src_ids: block ids, same length.
        gather_chunk_bytes: temporary memory bound of the gather path.

    Raises:
        ValueError: different lengths, per-block shapes or dtypes, or a block id out of range.
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError("destination and source block lists differ in length")
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"block shapes/dtypes differ: {tuple(dst.shape[1:])} {dst.dtype} vs "
                         f"{tuple(src.shape[1:])} {src.dtype}")
    if dst_ids and (min(dst_ids) < 0 or max(dst_ids) >= dst.shape[0]):
        raise ValueError(f"destination block id out of range (0..{dst.shape[0] - 1})")
    if src_ids and (min(src_ids) < 0 or max(src_ids) >= src.shape[0]):
        raise ValueError(f"source block id out of range (0..{src.shape[0] - 1})")
    runs = block_runs(dst_ids, src_ids)
    if len(runs) > MAX_KERNEL_FREE_RUNS and _kernel_copies(dst, src):
        # rows padded to 16 bytes: both rows keep one alignment, so the kernel compiled when
        # the peer was opened is the one every read launches (Triton specialises on it)
        pad = [0] * (-len(dst_ids) % 4)
        ids = torch.tensor([dst_ids + pad, src_ids + pad], dtype=torch.int32,
                           pin_memory=dst.is_cuda)
        return CopyPlan(None, kernel_ids=ids, chunk=len(dst_ids))
    if len(runs) <= MAX_RUN_COPIES or dst.device != src.device:
        return CopyPlan(runs)
    block_bytes = max(1, dst[0].numel() * dst.element_size())
    return CopyPlan(
        None,
        torch.tensor(dst_ids, dtype=torch.int64).to(dst.device, non_blocking=True),
        torch.tensor(src_ids, dtype=torch.int64).to(src.device, non_blocking=True),
        max(1, gather_chunk_bytes // block_bytes))


def issue_copy(dst: torch.Tensor, src: torch.Tensor, plan: CopyPlan) -> int:
    """Issue a planned copy on the current stream; returns the copy operations issued."""
    if plan.kernel_ids is not None:
        # allocated on the current stream, which also runs the kernel that reads it
        ids = plan.kernel_ids.to(dst.device, non_blocking=True)
        n = plan.chunk
        _block_copy_kernels().copy_blocks(dst, src, ids[0, :n], ids[1, :n])
        return 1
    if plan.runs is not None:
        for d0, s0, n in plan.runs:
            dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)
        return len(plan.runs)
    if dst.element_size() == 1:  # fp8 caches: index_copy_ has no fp8 kernels; move the bytes
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    ops = 0
    for i in range(0, len(plan.dst_idx), plan.chunk):
        dst.index_copy_(0, plan.dst_idx[i:i + plan.chunk],
                        src.index_select(0, plan.src_idx[i:i + plan.chunk]))
        ops += 1
    return ops


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, dst_ids: list[int], src_ids: list[int],
                gather_chunk_bytes: int = GATHER_CHUNK_BYTES) -> int:
    """Copy blocks ``src[src_ids[i]]`` into ``dst[dst_ids[i]]`` on the current stream
    (:func:`plan_copy` then :func:`issue_copy`): runs of blocks consecutive on both sides as
    slices when there are at most :data:`MAX_KERNEL_FREE_RUNS` of them; beyond, between two
    caches on one GPU, one block-copy kernel launch (Triton installed); otherwise as slices
    when there are at most :data:`MAX_RUN_COPIES` runs or the source is in host memory, else
    gathered and scattered in chunks of at most ``gather_chunk_bytes``.

    Returns:
        The number of copy operations issued (runs or chunks).

    Raises:
        ValueError: see :func:`plan_copy`.
    """
    return issue_copy(dst, src, plan_copy(dst, src, dst_ids, src_ids, gather_chunk_bytes))


@dataclass
class _Copy:
    """One posted copy (the handle :class:`DirectPeer` returns)."""

    nbytes: int
    num_ops: int
    post_s: float
    start: Any = None  # torch.cuda.Event (None on CPU: the copy is done)
    end: Any = None
    wall_s: float = 0.0


class DirectPeer:
    """Reads from one owner's KV blocks mapped into this process.

    Args:
        local: the reader's KV cache ``[num_blocks, L, 2, H_kv, block_size, D]``.
        remote: the owner's blocks with the same per-block shape and dtype: its KV cache
            opened by CUDA IPC on the reader's GPU, its host mirror mapped from shared memory
            (pinned for the reader's GPU), or any tensor on the reader's device (tests).
        on_close: called by :meth:`close` after the copies in flight finished (unmapping).

    Raises:
        ValueError: per-block shapes or dtypes differ, or the remote lives on another device
            (other than host memory read into a CUDA cache).
    """

    def __init__(self, local: torch.Tensor, remote: torch.Tensor, on_close: Any = None):
        if local.shape[1:] != remote.shape[1:] or local.dtype != remote.dtype:
            raise ValueError(f"KV caches differ per block: local {tuple(local.shape)} "
                             f"{local.dtype}, remote {tuple(remote.shape)} {remote.dtype}")
        if local.device != remote.device and not (local.is_cuda and remote.device.type == "cpu"):
            raise ValueError(f"KV caches on different devices: {local.device} vs {remote.device}")
        self.local = local
        self.remote = remote
        self.num_blocks = int(remote.shape[0])
        self.block_bytes = local[0].numel() * local.element_size()
        self._stream = torch.cuda.Stream(local.device) if local.is_cuda else None
        self._on_close = on_close
        if _kernel_copies(local, remote):
            self._compile_kernel()

    def _compile_kernel(self) -> None:
        """Compile the block-copy kernel for this cache's block size now (at connect time, not
        in the first read) by one copy between two scratch blocks of the same shape."""
        scratch = torch.zeros((2, *self.local.shape[1:]), dtype=self.local.dtype,
                              device=self.local.device)
        # a fresh allocation: 16-byte aligned like a read's padded id rows (plan_copy)
        ids = torch.tensor([0, 1], dtype=torch.int32, device=self.local.device)
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            _block_copy_kernels().copy_blocks(scratch, scratch, ids, ids)
        self._stream.synchronize()

    def post_read(self, local_ids: list[int], remote_ids: list[int]) -> tuple[_Copy, str]:
        """Start copying remote blocks into local blocks on the side stream (after the work
        already queued on the current stream, which may still use the destination blocks).
        The CUDA events around the copy are recorded after the host-side planning, so the
        telemetry's copy time is the copy's own.

        Returns:
            ``(handle, state)`` with state ``"DONE"`` or ``"PROC"``.

        Raises:
            ValueError: a block id out of range (see :func:`plan_copy`).
        """
        t0 = time.perf_counter()
        nbytes = len(local_ids) * self.block_bytes
        with torch.inference_mode():
            plan = plan_copy(self.local, self.remote, local_ids, remote_ids)
        phase_trace.mark("kv.copy_planned")
        if self._stream is None:
            with torch.inference_mode():
                ops = issue_copy(self.local, self.remote, plan)
            wall = time.perf_counter() - t0
            return _Copy(nbytes, ops, post_s=wall, wall_s=wall), "DONE"
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.local.device))
        # inference mode like the opened tensor and the engine's own KV writes
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            start.record()
            phase_trace.mark("kv.copy_issue")
            ops = issue_copy(self.local, self.remote, plan)
            phase_trace.mark("kv.copy_issued")
            end.record()
        for index in (plan.dst_idx, plan.src_idx):
            if index is not None:
                # Allocated on the current stream, read by the side stream's copy: without
                # this the caching allocator may hand their memory to the current stream's next
                # allocation while the copy is still queued, and the copy reads garbage ids.
                index.record_stream(self._stream)
        handle = _Copy(nbytes, ops, post_s=time.perf_counter() - t0, start=start, end=end)
        return handle, self.check(handle)

    def check(self, handle: _Copy) -> str:
        """``"DONE"`` or ``"PROC"`` (never blocks)."""
        return "DONE" if handle.end is None or handle.end.query() else "PROC"

    def telemetry(self, handle: _Copy) -> tuple[float, float, int, int]:
        """``(post_s, copy_s, bytes, copy operations)`` of a finished copy (the copy time is
        the CUDA events' elapsed time on CUDA)."""
        xfer = handle.wall_s if handle.end is None else handle.start.elapsed_time(handle.end) / 1e3
        return handle.post_s, xfer, handle.nbytes, handle.num_ops

    def release(self, handle: _Copy) -> None:
        """Forget a copy. An unfinished one is waited for (it takes milliseconds), so that its
        destination blocks are not written after the caller frees them."""
        if handle.end is not None and not handle.end.query():
            handle.end.synchronize()

    def close(self) -> None:
        """Wait for copies in flight and drop the mapping of the owner's blocks."""
        if self._stream is not None:
            self._stream.synchronize()
        self.remote = None  # type: ignore[assignment]
        if self._on_close is not None:
            self._on_close()
            self._on_close = None
