"""Which path carries the KV reads from one peer (pdserve's same-GPU CUDA IPC copy, its copy
from a same-host peer's shared host mirror, or a NIXL READ), why, and how fast the first
sizable read went; torch-free.

Selection (:func:`choose_read_path`), per peer, once after its handshake: with
``same_host_transport`` ``auto`` (the default) or ``cuda_ipc``, reads use CUDA IPC when both KV
caches are on the *same GPU* (same host identity, same GPU UUID, different processes) and the
owner exported an IPC handle; in host-buffer mode (``kv_buffer_device: "cpu"``) they copy from
the owner's shared host mirror when both run on the *same host* and the owner shares its
mirror; otherwise they are NIXL READs. ``nixl`` always uses NIXL.

Monitoring (:class:`TransferPaths`): the chosen path is logged and reported to the front end in
the connector stats (key ``transfer_paths``, shown on ``/metrics`` as
``pdserve:kv_transfer_path_info`` and ``pdserve:kv_transfer_read_gbps``). The first read of at
least :data:`PROBE_MIN_BYTES` from a peer gives that path's bandwidth; a NIXL read of GPU memory
slower than :data:`SLOW_GPU_READ_GBPS` is logged as a warning: UCX then moves GPU memory by TCP
emulation (``UCX_PROTO_INFO=y`` on the engines prints the protocol it chose), far slower than a
device copy (docs/benchmarks.md, "Measurements moved out of the KV connector's comments").
"""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

# Reads smaller than this say little about a path's bandwidth (latency dominates).
PROBE_MIN_BYTES = 16 << 20
# A GPU-to-GPU NIXL read slower than this (GB/s) is taken as UCX's TCP emulation: the threshold
# lies between that emulation and PCIe host staging (docs/benchmarks.md, "Measurements moved
# out of the KV connector's comments").
SLOW_GPU_READ_GBPS = 5.0


class SameHostTransport(enum.Enum):
    """``kv_connector_extra_config.same_host_transport``: how reads from a peer on the same GPU
    travel."""

    AUTO = "auto"  # CUDA IPC (or a shared host mirror in host-buffer mode) when possible, else NIXL
    CUDA_IPC = "cuda_ipc"  # the same, with a warning when CUDA IPC is not possible
    NIXL = "nixl"  # always NIXL


class ReadPath(enum.Enum):
    """The path that carries one peer's reads."""

    CUDA_IPC = "cuda_ipc"  # pdserve's device-to-device copy (kv_transfer/nixl/cuda_ipc.py)
    SHARED_HOST = "shared_host"  # a copy from the peer's shared host mirror (shared_host.py)
    NIXL = "nixl"  # a NIXL READ (UCX picks the transport)


@dataclass(frozen=True)
class PeerFacts:
    """What one side advertises about where its KV cache lives (handshake fields).

    Attributes:
        host_id: hostname and boot id (:func:`pdserve.kv_transfer.nixl.same_host.host_identity`).
        pid: process id.
        gpu_uuid: UUID of the KV cache's GPU, or None for a CPU cache.
        has_ipc_handle: the owner exported a CUDA IPC handle of its KV cache.
        has_host_mirror: host-buffer mode: the owner shares its host mirror (a reader: it keeps
            one, i.e. runs in host-buffer mode).
    """

    host_id: str
    pid: int
    gpu_uuid: str | None
    has_ipc_handle: bool = False
    has_host_mirror: bool = False


def choose_read_path(setting: SameHostTransport, local: PeerFacts,
                     remote: PeerFacts) -> tuple[ReadPath, str]:
    """The path for reads from ``remote`` into ``local`` and the reason, in words.

    Args:
        setting: this instance's ``same_host_transport``.
        local: the reader's facts.
        remote: the owner's facts (from its handshake answer).
    """
    if setting is SameHostTransport.NIXL:
        return ReadPath.NIXL, "same_host_transport is 'nixl'"
    if local.host_id != remote.host_id:
        return ReadPath.NIXL, "the peer runs on another host"
    if local.has_host_mirror:  # host-buffer mode: host memory to this GPU, never CUDA IPC
        if not remote.has_host_mirror:
            return ReadPath.NIXL, "the peer shares no host mirror"
        return ReadPath.SHARED_HOST, "both instances keep a host mirror on this host"
    if local.gpu_uuid is None or remote.gpu_uuid is None:
        return ReadPath.NIXL, "a KV cache is not in GPU memory"
    if local.gpu_uuid != remote.gpu_uuid:
        return ReadPath.NIXL, "the peer's KV cache is on another GPU"
    if local.pid == remote.pid:
        return ReadPath.NIXL, "the peer is this process (CUDA IPC needs two processes)"
    if not remote.has_ipc_handle:
        return ReadPath.NIXL, "the peer exported no CUDA IPC handle"
    return ReadPath.CUDA_IPC, "both KV caches are on the same GPU"


_PATH_WORDS = {ReadPath.CUDA_IPC: "pdserve's CUDA IPC copy",
               ReadPath.SHARED_HOST: "pdserve's copy from the peer's shared host mirror",
               ReadPath.NIXL: "NIXL READs"}


@dataclass
class _PeerPath:
    path: ReadPath
    mem: str  # "VRAM->VRAM", "DRAM->VRAM", ...
    read_gbps: float | None = None


class TransferPaths:
    """The read path of every peer, for logs and the front end's metrics (one per worker)."""

    def __init__(self) -> None:
        self._peers: dict[str, _PeerPath] = {}
        self._changed: set[str] = set()

    def set_path(self, peer: str, path: ReadPath, reason: str, remote_mem: str,
                 local_mem: str) -> None:
        """Record (and log) the path chosen for reads from engine ``peer``."""
        mem = f"{remote_mem}->{local_mem}"
        self._peers[peer] = _PeerPath(path, mem)
        self._changed.add(peer)
        logger.info("KV reads from engine %s (%s) use %s: %s", peer, mem, _PATH_WORDS[path],
                    reason)

    def path_of(self, peer: str) -> ReadPath | None:
        """The recorded path of a peer, or None before its handshake."""
        entry = self._peers.get(peer)
        return entry.path if entry is not None else None

    def observe(self, peer: str, nbytes: int, seconds: float) -> None:
        """A finished read: the first one of at least :data:`PROBE_MIN_BYTES` sets the peer's
        bandwidth, and a slow NIXL read of GPU memory is warned about."""
        entry = self._peers.get(peer)
        if entry is None or entry.read_gbps is not None or nbytes < PROBE_MIN_BYTES \
                or seconds <= 0:
            return
        entry.read_gbps = nbytes / seconds / 1e9
        self._changed.add(peer)
        logger.info("KV reads from engine %s: first read of %.1f MiB at %.2f GB/s over %s",
                    peer, nbytes / 2**20, entry.read_gbps, entry.path.value)
        if entry.path is ReadPath.NIXL and "VRAM" in entry.mem \
                and entry.read_gbps < SLOW_GPU_READ_GBPS:
            logger.warning(
                "!!! KV reads from engine %s move GPU memory at %.2f GB/s: UCX is emulating "
                "the GPU transfer over TCP (it did not pick cuda_ipc or cuda_copy). Run both "
                "engines with UCX_PROTO_INFO=y to see the protocol; on one GPU use "
                "kv_connector_extra_config.same_host_transport 'auto' (pdserve's CUDA IPC "
                "path); across hosts check UCX_TLS and the UCX build's CUDA support !!!",
                peer, entry.read_gbps)

    def take_delta(self) -> dict[str, dict[str, Any]] | None:
        """Peers whose path or bandwidth changed since the last call:
        ``{peer: {"transport": str, "mem": str, "read_gbps": float | None}}``, or None."""
        if not self._changed:
            return None
        out = {peer: {"transport": self._peers[peer].path.value, "mem": self._peers[peer].mem,
                      "read_gbps": self._peers[peer].read_gbps}
               for peer in sorted(self._changed) if peer in self._peers}
        self._changed.clear()
        return out or None
