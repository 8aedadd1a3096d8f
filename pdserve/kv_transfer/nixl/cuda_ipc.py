"""Same-GPU KV reads by CUDA IPC: the owner exports its KV cache's IPC handle in the side
channel's handshake answer, the reader opens it once per peer and copies the claimed blocks
device to device on a side CUDA stream.

Why: with two engines on one GPU, UCX may not select its ``cuda_ipc`` transport and then moves
GPU memory by TCP emulation (0.54 GB/s measured on one H200 against about 2,000 GB/s for a
device copy in the same run), while CUDA IPC between the two processes works. The lease
protocol is unchanged (docs/architecture.md): the reader claims the blocks over the side
channel first, then copies, then tells the owner "done" like a NIXL READ's notification would;
completion is polled with a CUDA event, so the engine loop never waits for the copy.

The handshake fields are torch's own CUDA IPC description of a tensor
(``torch.multiprocessing.reductions.reduce_tensor`` / ``rebuild_cuda_tensor``, the mechanism
``torch.multiprocessing`` uses), with classes and dtypes as names so that msgpack carries them.

:func:`copy_blocks` is plain torch indexing and runs on CPU tensors too (tests stand in two
tensors for the two caches); :class:`CudaIpcPeer` also accepts CPU tensors, then copying
synchronously.
"""

from __future__ import annotations

import inspect
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer.nixl.agent import block_runs
from pdserve.kv_transfer.nixl.transfer_path import (
    PeerFacts,
    ReadPath,
    SameHostTransport,
    TransferPaths,
    choose_read_path,
)

logger = logging.getLogger(__name__)

# Up to this many runs of consecutive blocks are copied run by run (no temporary memory);
# beyond, blocks are gathered and scattered (index_select / index_copy_) in chunks of at most
# GATHER_CHUNK_BYTES of temporary device memory.
MAX_RUN_COPIES = 64
GATHER_CHUNK_BYTES = 64 << 20

# Fields of torch's CUDA tensor reduction that are sent as they are (ints, bools, bytes).
_PLAIN_FIELDS = ("tensor_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
                 "ref_counter_handle", "ref_counter_offset", "event_handle",
                 "event_sync_required")


def host_identity() -> str:
    """This machine's identity: hostname and kernel boot id (two processes with the same
    identity share the machine and its GPUs)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of a CUDA device, e.g. ``"6f2a...-..."`` (None for CPU, or when this torch
    build cannot tell: then reads use NIXL)."""
    if device.type != "cuda":
        return None
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        return None


@dataclass(frozen=True)
class IpcExport:
    """An owner's KV cache as torch's CUDA IPC description (see :func:`export_kv_cache`).

    Attributes:
        shape: the tensor's shape ``[num_blocks, L, 2, H_kv, block_size, D]``.
        stride: its strides (elements).
        dtype: torch dtype name, e.g. ``"bfloat16"``.
        fields: :data:`_PLAIN_FIELDS` of ``rebuild_cuda_tensor``.
    """

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    fields: dict[str, Any]

    def to_wire(self) -> dict[str, Any]:
        """The handshake form (msgpack-able)."""
        return {"shape": list(self.shape), "stride": list(self.stride), "dtype": self.dtype,
                **self.fields}

    @classmethod
    def from_wire(cls, data: Any) -> "IpcExport":
        """Parse the handshake form.

        Raises:
            ValueError: a missing field or one of the wrong type.
        """
        if not isinstance(data, dict):
            raise ValueError("cuda_ipc must be an object")
        shape, stride, dtype = data.get("shape"), data.get("stride"), data.get("dtype")
        if not (isinstance(shape, list) and isinstance(stride, list) and len(shape) == len(stride)
                and all(isinstance(x, int) and x >= 0 for x in shape + stride)):
            raise ValueError("cuda_ipc shape/stride must be lists of non-negative integers")
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"cuda_ipc dtype {dtype!r} is not a torch dtype")
        fields = {k: data.get(k) for k in _PLAIN_FIELDS}
        for key in ("storage_handle", "ref_counter_handle"):
            if not isinstance(fields[key], bytes):
                raise ValueError(f"cuda_ipc {key} must be bytes")
        if fields["event_handle"] is not None and not isinstance(fields["event_handle"], bytes):
            raise ValueError("cuda_ipc event_handle must be bytes")
        for key in ("tensor_offset", "storage_size_bytes", "storage_offset_bytes",
                    "ref_counter_offset"):
            if not isinstance(fields[key], int) or isinstance(fields[key], bool):
                raise ValueError(f"cuda_ipc {key} must be an integer")
        if not isinstance(fields["event_sync_required"], bool):
            raise ValueError("cuda_ipc event_sync_required must be true or false")
        return cls(tuple(shape), tuple(stride), dtype, fields)


def export_kv_cache(kv_cache: torch.Tensor) -> IpcExport:
    """torch's CUDA IPC description of the owner's KV cache (call once, at registration).

    Raises:
        ValueError: the tensor is not on CUDA.
        RuntimeError: torch cannot share it (for example with expandable segments).
    """
    if kv_cache.device.type != "cuda":
        raise ValueError("only a CUDA KV cache can be shared by CUDA IPC")
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(kv_cache)
    named = dict(zip(inspect.signature(rebuild).parameters, args))
    fields = {k: named[k] for k in _PLAIN_FIELDS}
    for key in ("tensor_offset", "storage_size_bytes", "storage_offset_bytes",
                "ref_counter_offset"):
        fields[key] = int(fields[key])
    fields["event_sync_required"] = bool(fields["event_sync_required"])
    return IpcExport(tuple(kv_cache.shape), tuple(kv_cache.stride()),
                     str(kv_cache.dtype).removeprefix("torch."), fields)


def handshake_fields(kv_cache: torch.Tensor) -> dict[str, Any]:
    """What an instance adds to its side channel's ``get_info`` answer: ``host_id``, ``pid``,
    ``gpu_uuid`` and ``cuda_ipc`` (:class:`IpcExport` wire form, or None when the cache is not
    on CUDA or torch cannot share it)."""
    export = None
    if kv_cache.device.type == "cuda":
        try:
            export = export_kv_cache(kv_cache).to_wire()
        except Exception as e:  # e.g. expandable segments: readers use NIXL instead
            logger.warning("the KV cache cannot be shared by CUDA IPC (%s); same-GPU readers "
                           "will use NIXL", e)
    return {"host_id": host_identity(), "pid": os.getpid(), "gpu_uuid": gpu_uuid(kv_cache.device),
            "cuda_ipc": export}


def local_facts(kv_cache: torch.Tensor) -> PeerFacts:
    """The reader's own :class:`PeerFacts`."""
    return PeerFacts(host_identity(), os.getpid(), gpu_uuid(kv_cache.device),
                     kv_cache.device.type == "cuda")


def remote_facts(info: dict[str, Any]) -> tuple[PeerFacts, IpcExport | None]:
    """The owner's :class:`PeerFacts` and IPC export from its handshake answer (an owner
    without these fields, or with malformed ones, simply gets NIXL reads)."""
    export = None
    if info.get("cuda_ipc") is not None:
        try:
            export = IpcExport.from_wire(info["cuda_ipc"])
        except ValueError as e:
            logger.warning("ignoring a malformed cuda_ipc handshake field: %s", e)
    host, pid, uuid = info.get("host_id"), info.get("pid"), info.get("gpu_uuid")
    return PeerFacts(host if isinstance(host, str) else "",
                     pid if isinstance(pid, int) else -1,
                     uuid if isinstance(uuid, str) else None,
                     export is not None), export


def copy_blocks(dst: torch.Tensor, src: torch.Tensor, dst_ids: list[int], src_ids: list[int],
                gather_chunk_bytes: int = GATHER_CHUNK_BYTES) -> int:
    """Copy blocks ``src[src_ids[i]]`` into ``dst[dst_ids[i]]`` (on the current stream).

    Runs of blocks consecutive on both sides are copied as slices when there are at most
    :data:`MAX_RUN_COPIES` of them; otherwise the blocks are gathered from ``src`` and
    scattered into ``dst`` by ``index_select`` / ``index_copy_`` in chunks of at most
    ``gather_chunk_bytes`` (at least one block).

    Args:
        dst: ``[num_dst_blocks, ...]`` destination cache.
        src: ``[num_src_blocks, ...]`` source cache; same per-block shape and dtype, same device.
        dst_ids, src_ids: block ids, same length.
        gather_chunk_bytes: temporary memory bound of the gather path.

    Returns:
        The number of copy operations issued (runs or chunks).

    Raises:
        ValueError: different lengths, per-block shapes or dtypes, or a block id out of range.
    """
    if len(dst_ids) != len(src_ids):
        raise ValueError("destination and source block lists differ in length")
    if dst.shape[1:] != src.shape[1:] or dst.dtype != src.dtype:
        raise ValueError(f"block shapes/dtypes differ: {tuple(dst.shape[1:])} {dst.dtype} vs "
                         f"{tuple(src.shape[1:])} {src.dtype}")
    if any(not 0 <= b < dst.shape[0] for b in dst_ids):
        raise ValueError(f"destination block id out of range (0..{dst.shape[0] - 1})")
    if any(not 0 <= b < src.shape[0] for b in src_ids):
        raise ValueError(f"source block id out of range (0..{src.shape[0] - 1})")
    if not dst_ids:
        return 0
    runs = block_runs(dst_ids, src_ids)
    if len(runs) <= MAX_RUN_COPIES:
        for d0, s0, n in runs:
            dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)
        return len(runs)
    if dst.element_size() == 1:  # fp8 caches: index_copy_ has no fp8 kernels; move the bytes
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    block_bytes = max(1, dst[0].numel() * dst.element_size())
    chunk = max(1, gather_chunk_bytes // block_bytes)
    d_idx = torch.tensor(dst_ids, dtype=torch.int64).to(dst.device, non_blocking=True)
    s_idx = torch.tensor(src_ids, dtype=torch.int64).to(src.device, non_blocking=True)
    ops = 0
    for i in range(0, len(dst_ids), chunk):
        dst.index_copy_(0, d_idx[i:i + chunk], src.index_select(0, s_idx[i:i + chunk]))
        ops += 1
    return ops


@dataclass
class _Copy:
    """One posted copy (the handle :class:`CudaIpcPeer` returns)."""

    nbytes: int
    num_ops: int
    post_s: float
    start: Any = None  # torch.cuda.Event (None on CPU: the copy is done)
    end: Any = None
    wall_s: float = 0.0


class CudaIpcPeer:
    """Reads from one owner's KV cache opened by CUDA IPC, with the interface of
    :class:`~pdserve.kv_transfer.nixl.agent.NixlAgent`'s transfers (post, check, telemetry,
    release), so the worker treats both alike.

    Args:
        local: the reader's KV cache ``[num_blocks, L, 2, H_kv, block_size, D]``.
        remote: the owner's KV cache as a tensor on the same device (:func:`open_peer`), or
            any tensor of the same per-block shape (tests use CPU tensors).
    """

    def __init__(self, local: torch.Tensor, remote: torch.Tensor):
        if local.shape[1:] != remote.shape[1:] or local.dtype != remote.dtype:
            raise ValueError(f"KV caches differ per block: local {tuple(local.shape)} "
                             f"{local.dtype}, remote {tuple(remote.shape)} {remote.dtype}")
        if local.device != remote.device:
            raise ValueError(f"KV caches on different devices: {local.device} vs {remote.device}")
        self.local = local
        self.remote = remote
        self.num_blocks = int(remote.shape[0])
        self.block_bytes = local[0].numel() * local.element_size()
        self._stream = torch.cuda.Stream(local.device) if local.is_cuda else None

    def post_read(self, local_ids: list[int], remote_ids: list[int]) -> tuple[_Copy, str]:
        """Start copying remote blocks into local blocks on the side stream (after the work
        already queued on the current stream, which may still use the destination blocks).

        Returns:
            ``(handle, state)`` with state ``"DONE"`` or ``"PROC"``.

        Raises:
            ValueError: a block id out of range (see :func:`copy_blocks`).
        """
        t0 = time.perf_counter()
        nbytes = len(local_ids) * self.block_bytes
        if self._stream is None:
            with torch.inference_mode():
                ops = copy_blocks(self.local, self.remote, local_ids, remote_ids)
            wall = time.perf_counter() - t0
            return _Copy(nbytes, ops, post_s=wall, wall_s=wall), "DONE"
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.local.device))
        # inference mode like the opened tensor (open_peer) and the engine's own KV writes
        with torch.inference_mode(), torch.cuda.stream(self._stream):
            start.record()
            ops = copy_blocks(self.local, self.remote, local_ids, remote_ids)
            end.record()
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
        """Forget a copy. An unfinished one is waited for (a same-GPU copy takes milliseconds),
        so that its destination blocks are not written after the caller frees them."""
        if handle.end is not None and not handle.end.query():
            handle.end.synchronize()

    def close(self) -> None:
        """Wait for copies in flight and drop the mapping of the owner's cache."""
        if self._stream is not None:
            self._stream.synchronize()
        self.remote = None  # type: ignore[assignment]


def open_peer(export: IpcExport, local: torch.Tensor) -> CudaIpcPeer:
    """Open an owner's KV cache on the reader's device (once per peer).

    Raises:
        ValueError: the geometry differs from the local cache.
        RuntimeError: CUDA cannot open the handle.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if local.device.type != "cuda":
        raise ValueError("CUDA IPC needs a CUDA KV cache")
    with torch.inference_mode():  # the same mode whatever the caller's (post_read copies in it)
        remote = rebuild_cuda_tensor(
            tensor_cls=torch.Tensor, tensor_size=torch.Size(export.shape),
            tensor_stride=export.stride, storage_cls=torch.UntypedStorage,
            dtype=getattr(torch, export.dtype), storage_device=local.device.index or 0,
            requires_grad=False, **export.fields)
    return CudaIpcPeer(local, remote)


def connect_peer(setting: SameHostTransport, local: torch.Tensor | None, info: dict[str, Any],
                 peer: str, paths: TransferPaths, local_mem: str) -> CudaIpcPeer | None:
    """After a handshake: choose the read path for engine ``peer`` (:func:`choose_read_path`),
    open its KV cache when that path is CUDA IPC, and record the outcome in ``paths``.

    Args:
        setting: this instance's ``same_host_transport``.
        local: the reader's KV cache (None before registration: NIXL).
        info: the owner's handshake answer.
        peer: the owner's engine id.
        paths: where the chosen path is recorded (and logged).
        local_mem: ``"VRAM"`` or ``"DRAM"``, the reader's NIXL memory type.

    Returns:
        The opened peer, or None when reads from it are NIXL READs (also when opening fails:
        logged as a warning).
    """
    remote_mem = str(info.get("mem_type", "?"))
    facts, export = remote_facts(info)
    if local is None:
        path, reason = ReadPath.NIXL, "no local KV cache registered"
    else:
        path, reason = choose_read_path(setting, local_facts(local), facts)
    opened = None
    if path is ReadPath.CUDA_IPC and export is not None and local is not None:
        try:
            opened = open_peer(export, local)
        except Exception as e:  # CUDA refused the handle: NIXL still works
            path, reason = ReadPath.NIXL, f"opening the peer's CUDA IPC handle failed: {e}"
    if setting is SameHostTransport.CUDA_IPC and path is not ReadPath.CUDA_IPC:
        logger.warning("same_host_transport is 'cuda_ipc' but reads from engine %s use NIXL: "
                       "%s", peer, reason)
    paths.set_path(peer, path, reason, remote_mem, local_mem)
    return opened
