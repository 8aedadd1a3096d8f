"""Host-buffer mirrors shared between the processes of one host: the mirror lives in an
anonymous memory file (``memfd_create``), so that a reader on the same host maps the owner's
mirror through ``/proc/<pid>/fd/<fd>`` and copies the claimed blocks from it straight into its
GPU cache.

Why: in host-buffer mode (``kv_buffer_device: "cpu"``, :mod:`.host_buffer`) a NIXL READ
between the two processes' mirrors runs at UCX's CMA speed, most of it inside the post call,
and the reader then copies its mirror to the GPU. Reading the owner's mirror directly is one
host-to-device DMA from pinned memory, at the PCIe limit (docs/benchmarks.md, "Measurements
moved out of the KV connector's comments"). The memory
file has no name, so nothing is left in ``/dev/shm`` when a process dies; the kernel frees it
when the last process maps it no more.

Both sides pin the mapping for the GPU (``cudaHostRegister``), once per process; the owner's
pinning also faults the pages in, so it costs more than a reader's (docs/benchmarks.md, "P/D on
one GPU" and "Measurements moved out of the KV connector's comments"). On CPU the same file is
mapped without pinning (tests).
"""

from __future__ import annotations

import logging
import mmap
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.kv_transfer.nixl.direct_read import DirectPeer

logger = logging.getLogger(__name__)


def supported() -> bool:
    """Whether this platform has anonymous memory files and ``/proc/<pid>/fd`` (Linux)."""
    return hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")


def _pin(tensor: torch.Tensor) -> bool:
    """Pin a mapped CPU tensor's pages for CUDA (``cudaHostRegister``); False when CUDA refused."""
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(tensor.data_ptr(), tensor.numel() * tensor.element_size(), 0)
    if int(err) != 0:
        logger.warning("cudaHostRegister of a %.2f GiB host buffer failed (%s)",
                       tensor.numel() * tensor.element_size() / 2**30, err)
        return False
    return True


def _unpin(tensor: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())


class _Mapping:
    """A memory file mapped into this process as a tensor ``shape`` of ``dtype``."""

    def __init__(self, fd: int, nbytes: int, shape: tuple[int, ...], dtype: torch.dtype,
                 pin: bool):
        self.fd = fd
        self.nbytes = nbytes
        self._map = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED,
                              prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self.tensor: torch.Tensor | None = (
            torch.frombuffer(self._map, dtype=torch.uint8, count=nbytes).view(dtype).view(shape))
        self.pinned = pin and _pin(self.tensor)

    def close(self) -> None:
        if self.tensor is not None and self.pinned:
            _unpin(self.tensor)
        self.tensor = None
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere: the mapping goes with it
            pass
        os.close(self.fd)


@dataclass(frozen=True)
class MirrorExport:
    """How a reader finds an owner's shared mirror (handshake field ``host_mirror``).

    Attributes:
        pid: the owner's process id.
        fd: the memory file's descriptor in the owner.
        nbytes: its size.
        shape: the mirror's shape ``[num_blocks, L, 2, H_kv, block_size, D]``.
        dtype: torch dtype name, e.g. ``"bfloat16"``.
    """

    pid: int
    fd: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str

    def to_wire(self) -> dict[str, Any]:
        """The handshake form (msgpack-able)."""
        return {"pid": self.pid, "fd": self.fd, "nbytes": self.nbytes, "shape": list(self.shape),
                "dtype": self.dtype}

    @classmethod
    def from_wire(cls, data: Any) -> "MirrorExport":
        """Parse the handshake form.

        Raises:
            ValueError: a missing field or one of the wrong type.
        """
        if not isinstance(data, dict):
            raise ValueError("host_mirror must be an object")
        ints = [data.get(k) for k in ("pid", "fd", "nbytes")]
        if not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints):
            raise ValueError("host_mirror pid/fd/nbytes must be non-negative integers")
        shape, dtype = data.get("shape"), data.get("dtype")
        if not (isinstance(shape, list) and all(isinstance(x, int) and x >= 0 for x in shape)):
            raise ValueError("host_mirror shape must be a list of non-negative integers")
        if not isinstance(dtype, str) or not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"host_mirror dtype {dtype!r} is not a torch dtype")
        return cls(ints[0], ints[1], ints[2], tuple(shape), dtype)


class SharedHostBuffer:
    """The owner's mirror in an anonymous memory file, pinned for CUDA when ``pin``.

    Args:
        shape: ``[num_blocks, L, 2, H_kv, block_size, D]``.
        dtype: the KV cache's dtype.
        pin: register the pages with CUDA (a CUDA KV cache).

    Attributes:
        tensor: the mirror.

    Raises:
        OSError: the memory file cannot be created or sized (:func:`supported` first).
    """

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool):
        nbytes = max(1, int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size())
        fd = os.memfd_create("pdserve-kv-host-buffer", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            t0 = time.perf_counter()
            self._mapping = _Mapping(fd, nbytes, tuple(shape), dtype, pin)
        except BaseException:
            os.close(fd)
            raise
        self.tensor = self._mapping.tensor
        self.pinned = self._mapping.pinned
        if pin:
            logger.info("KV host buffer: %.2f GiB shared host memory %s in %.1f s",
                        nbytes / 2**30, "pinned" if self.pinned else "NOT pinned (slow copies)",
                        time.perf_counter() - t0)

    def export(self) -> MirrorExport:
        """What a same-host reader needs to map this buffer."""
        assert self.tensor is not None
        return MirrorExport(os.getpid(), self._mapping.fd, self._mapping.nbytes,
                            tuple(self.tensor.shape), str(self.tensor.dtype).removeprefix("torch."))

    def close(self) -> None:
        """Unpin and unmap (the memory goes once no reader maps it)."""
        self.tensor = None
        self._mapping.close()


def open_mirror(export: MirrorExport, local: torch.Tensor) -> DirectPeer:
    """Map an owner's shared mirror (once per peer) and return the reader that copies its
    blocks into ``local`` (pinned for ``local``'s GPU when it is on CUDA).

    Raises:
        OSError: the owner's memory file cannot be opened (another PID namespace, other user,
            the owner gone) or has another size.
        ValueError: the geometry differs from the local cache.
    """
    dtype = getattr(torch, export.dtype)
    if tuple(export.shape[1:]) != tuple(local.shape[1:]) or dtype != local.dtype:
        raise ValueError(f"the peer's host mirror {export.shape} {export.dtype} does not match "
                         f"this KV cache {tuple(local.shape)} {local.dtype}")
    fd = os.open(f"/proc/{export.pid}/fd/{export.fd}", os.O_RDWR | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size != export.nbytes:
            raise OSError(f"the peer's host mirror file has {size} bytes, not {export.nbytes}")
        t0 = time.perf_counter()
        mapping = _Mapping(fd, export.nbytes, export.shape, dtype, local.is_cuda)
    except BaseException:
        os.close(fd)
        raise
    if local.is_cuda:
        logger.info("mapped a peer's %.2f GiB host mirror (%s) in %.2f s", export.nbytes / 2**30,
                    "pinned" if mapping.pinned else "NOT pinned", time.perf_counter() - t0)
    assert mapping.tensor is not None
    return DirectPeer(local, mapping.tensor, on_close=mapping.close)
