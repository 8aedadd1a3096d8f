"""Same-GPU KV reads by CUDA IPC: the owner exports its KV cache's IPC handle in the side
channel's handshake answer, the reader opens it once per peer and copies the claimed blocks
device to device (:class:`~pdserve.kv_transfer.nixl.direct_read.DirectPeer`).

Why: with two engines on one GPU, UCX may not select its ``cuda_ipc`` transport and then moves
GPU memory by TCP emulation, orders of magnitude slower than a device copy (docs/benchmarks.md,
"Measurements moved out of the KV connector's comments"), while CUDA IPC between the two
processes works. The lease
protocol is unchanged (docs/architecture.md): the reader claims the blocks over the side
channel first, then copies, then tells the owner "done" like a NIXL READ's notification would.

The handshake fields are torch's own CUDA IPC description of a tensor
(``torch.multiprocessing.reductions.reduce_tensor`` / ``rebuild_cuda_tensor``, the mechanism
``torch.multiprocessing`` uses), with classes and dtypes as names so that msgpack carries them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer.nixl.direct_read import DirectPeer

# Fields of torch's CUDA tensor reduction that are sent as they are (ints, bools, bytes).
_PLAIN_FIELDS = ("tensor_offset", "storage_handle", "storage_size_bytes", "storage_offset_bytes",
                 "ref_counter_handle", "ref_counter_offset", "event_handle",
                 "event_sync_required")


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


def open_peer(export: IpcExport, local: torch.Tensor) -> DirectPeer:
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
    return DirectPeer(local, remote)
