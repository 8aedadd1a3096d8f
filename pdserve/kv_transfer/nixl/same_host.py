"""The same-host read paths of a peer, from handshake to opened reader: what an instance
advertises about where its KV lives (host, process, GPU, CUDA IPC handle, shared host mirror),
and, after a peer's handshake, the choice of path (:func:`~.transfer_path.choose_read_path`)
and the opening of a CUDA IPC (:mod:`.cuda_ipc`) or shared-host-mirror (:mod:`.shared_host`)
reader for it.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import torch

from pdserve.kv_transfer.nixl import cuda_ipc, shared_host
from pdserve.kv_transfer.nixl.direct_read import DirectPeer
from pdserve.kv_transfer.nixl.host_buffer import HostMirror
from pdserve.kv_transfer.nixl.transfer_path import (
    PeerFacts,
    ReadPath,
    SameHostTransport,
    TransferPaths,
    choose_read_path,
)

logger = logging.getLogger(__name__)


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


def handshake_fields(kv_cache: torch.Tensor, mirror: HostMirror | None = None) -> dict[str, Any]:
    """What an instance adds to its side channel's ``get_info`` answer: ``host_id``, ``pid``,
    ``gpu_uuid``, ``cuda_ipc`` (:class:`~.cuda_ipc.IpcExport` wire form, or None when the cache
    is not on CUDA or torch cannot share it) and ``host_mirror`` (:class:`~.shared_host.
    MirrorExport` wire form in host-buffer mode with a shared mirror, else None)."""
    export = None
    if kv_cache.device.type == "cuda" and mirror is None:
        try:
            export = cuda_ipc.export_kv_cache(kv_cache).to_wire()
        except Exception as e:  # e.g. expandable segments: readers use NIXL instead
            logger.warning("the KV cache cannot be shared by CUDA IPC (%s); same-GPU readers "
                           "will use NIXL", e)
    shared = mirror.export() if mirror is not None else None
    return {"host_id": host_identity(), "pid": os.getpid(), "gpu_uuid": gpu_uuid(kv_cache.device),
            "cuda_ipc": export, "host_mirror": shared.to_wire() if shared is not None else None}


def local_facts(kv_cache: torch.Tensor, mirror: HostMirror | None = None) -> PeerFacts:
    """The reader's own :class:`PeerFacts` (``has_host_mirror``: it runs in host-buffer mode)."""
    return PeerFacts(host_identity(), os.getpid(), gpu_uuid(kv_cache.device),
                     kv_cache.device.type == "cuda", mirror is not None)


def remote_facts(info: dict[str, Any]) -> tuple[PeerFacts, cuda_ipc.IpcExport | None,
                                                 shared_host.MirrorExport | None]:
    """The owner's :class:`PeerFacts`, CUDA IPC export and shared-mirror export from its
    handshake answer (an owner without these fields, or with malformed ones, simply gets NIXL
    reads)."""
    export = mirror = None
    if info.get("cuda_ipc") is not None:
        try:
            export = cuda_ipc.IpcExport.from_wire(info["cuda_ipc"])
        except ValueError as e:
            logger.warning("ignoring a malformed cuda_ipc handshake field: %s", e)
    if info.get("host_mirror") is not None:
        try:
            mirror = shared_host.MirrorExport.from_wire(info["host_mirror"])
        except ValueError as e:
            logger.warning("ignoring a malformed host_mirror handshake field: %s", e)
    host, pid, uuid = info.get("host_id"), info.get("pid"), info.get("gpu_uuid")
    return PeerFacts(host if isinstance(host, str) else "",
                     pid if isinstance(pid, int) else -1,
                     uuid if isinstance(uuid, str) else None,
                     export is not None, mirror is not None), export, mirror


def connect_peer(setting: SameHostTransport, local: torch.Tensor | None,
                 mirror: HostMirror | None, info: dict[str, Any], peer: str,
                 paths: TransferPaths, local_mem: str) -> DirectPeer | None:
    """After a handshake: choose the read path for engine ``peer``, open its KV cache (CUDA
    IPC) or its host mirror (shared host memory) when that is the path, and record the outcome
    in ``paths``.

    Args:
        setting: this instance's ``same_host_transport``.
        local: the reader's KV cache (None before registration: NIXL).
        mirror: the reader's host mirror in host-buffer mode, else None.
        info: the owner's handshake answer.
        peer: the owner's engine id.
        paths: where the chosen path is recorded (and logged).
        local_mem: ``"VRAM"`` or ``"DRAM"``, the reader's NIXL memory type.

    Returns:
        The opened reader, or None when reads from the peer are NIXL READs (also when opening
        fails: logged as a warning).
    """
    remote_mem = str(info.get("mem_type", "?"))
    facts, export, shared = remote_facts(info)
    if local is None:
        path, reason = ReadPath.NIXL, "no local KV cache registered"
    else:
        path, reason = choose_read_path(setting, local_facts(local, mirror), facts)
    opened = None
    try:
        if path is ReadPath.CUDA_IPC and export is not None and local is not None:
            opened = cuda_ipc.open_peer(export, local)
        elif path is ReadPath.SHARED_HOST and shared is not None and local is not None:
            opened = shared_host.open_mirror(shared, local)
            remote_mem, local_mem = "DRAM", "VRAM" if local.is_cuda else "DRAM"
    except Exception as e:  # CUDA refused the handle, the mirror cannot be mapped: NIXL works
        path, reason = ReadPath.NIXL, f"opening the peer's {path.value} memory failed: {e}"
        logger.warning("KV reads from engine %s: %s", peer, reason)
    if setting is SameHostTransport.CUDA_IPC and path is not ReadPath.CUDA_IPC:
        logger.warning("same_host_transport is 'cuda_ipc' but reads from engine %s use %s: "
                       "%s", peer, path.value, reason)
    paths.set_path(peer, path, reason, remote_mem, local_mem)
    return opened
