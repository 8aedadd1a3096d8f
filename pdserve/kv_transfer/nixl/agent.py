"""A thin wrapper over one NIXL agent: register the paged KV cache, prepare block descriptors
once per remote, post asynchronous READs and poll them, and exchange notifications.

Descriptors: both the local and each remote KV cache are prepared once as a list of
``num_blocks`` descriptors (descriptor ``i`` = block ``i``, ``block_bytes`` long), so a transfer
of whole blocks is just two index lists. A read of a head slice (instances of different TP
sizes, :mod:`.tp_plan`) names its byte regions instead (:meth:`NixlAgent.post_regions`). NIXL merges index runs that are contiguous on both sides into one
descriptor when it builds the request (docs/architecture.md, "KV cache layout": descriptor count, not link speed, decides the
transfer time); :func:`block_runs` computes the same runs for statistics.

Every call here must come from the engine thread (the agent is created in single-threaded
mode); background threads only talk ZMQ.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)


class NixlUnavailableError(RuntimeError):
    """NIXL cannot be used as configured (missing package or backend)."""


def block_runs(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int, int]]:
    """Merge a block mapping into runs that are consecutive on both sides.

    Args:
        local_ids: destination block ids.
        remote_ids: source block ids (same length).

    Returns:
        ``[(local_start, remote_start, num_blocks), ...]``; one run is one descriptor.
    """
    if len(local_ids) != len(remote_ids):
        raise ValueError("local and remote block lists differ in length")
    runs: list[tuple[int, int, int]] = []
    for lid, request_id in zip(local_ids, remote_ids):
        if runs:
            ls, rs, n = runs[-1]
            if lid == ls + n and request_id == rs + n:
                runs[-1] = (ls, rs, n + 1)
                continue
        runs.append((lid, request_id, 1))
    return runs


@dataclass
class RemoteAgent:
    """A remote agent whose KV cache descriptors are prepared.

    Attributes:
        name: the remote NIXL agent name.
        num_blocks: blocks in the remote KV cache (valid remote indices are ``0..num_blocks-1``).
        dlist: the prepared remote descriptor list (one per block).
    """

    name: str
    num_blocks: int
    dlist: Any
    base_addr: int = 0
    block_bytes: int = 0
    mem_type: str = "DRAM"
    device_id: int = 0


def _block_descs(base_addr: int, block_bytes: int, num_blocks: int, device_id: int) -> np.ndarray:
    descs = np.empty((num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = base_addr + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_bytes)
    descs[:, 1] = block_bytes
    descs[:, 2] = device_id
    return descs


class NixlAgent:
    """One NIXL agent with the local KV cache registered.

    Args:
        name: agent name (unique among the instances that talk to each other).
        backends: NIXL backends to create, e.g. ``["UCX"]``.
        progress_thread: run NIXL's own progress thread. It polls UCX in a loop without pause
            (one CPU core busy for as long as the agent lives); without it, transfers and
            notifications progress when this process polls them (:meth:`check`,
            :meth:`get_notifs`), which is enough for one-sided reads of host memory on one host
            (UCX's cma/shared-memory lanes need no work from the owner).

    Raises:
        NixlUnavailableError: ``nixl_cu13`` is not importable or a backend is missing from this
            NIXL build.
    """

    def __init__(self, name: str, backends: list[str], progress_thread: bool = True):
        try:
            from nixl_cu13._api import nixl_agent, nixl_agent_config
        except ImportError as e:  # pragma: no cover - the package is a hard dependency
            raise NixlUnavailableError(f"NIXL is not installed (nixl-cu13): {e}") from e
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=[],
                                   capture_telemetry=True)
        self._agent = nixl_agent(name, config)
        available = self._agent.get_plugin_list()
        missing = [b for b in backends if b not in available]
        if missing:
            raise NixlUnavailableError(
                f"NIXL backend(s) {missing} not available in this NIXL build; available: "
                f"{sorted(available)} (kv_connector_extra_config.backends)"
            )
        for backend in backends:
            try:
                self._agent.create_backend(backend)
            except Exception as e:
                raise NixlUnavailableError(
                    f"NIXL backend {backend!r} failed to start: {e}"
                ) from e
        self.name = name
        self.backends = list(backends)
        self._reg_descs = None
        self._kv_cache = None
        self._local_dlist = None
        self.mem_type = "DRAM"
        self.device_id = 0
        self.base_addr = 0
        self.block_bytes = 0
        self.num_blocks = 0
        self._remotes: dict[str, RemoteAgent] = {}

    # --------------------------------------------------------------------------- registration
    def register_kv_cache(self, kv_cache: Any, block_bytes: int) -> None:
        """Register the whole KV cache tensor (DRAM on CPU, VRAM on CUDA) and prepare the local
        per-block descriptor list.

        Args:
            kv_cache: contiguous tensor ``[num_blocks, ...]`` whose block ``i`` is bytes
                ``i*block_bytes .. (i+1)*block_bytes - 1``.
            block_bytes: bytes per block.
        """
        if not kv_cache.is_contiguous():
            raise ValueError("the KV cache tensor must be contiguous to be registered with NIXL")
        self.num_blocks = int(kv_cache.shape[0])
        self.block_bytes = int(block_bytes)
        if kv_cache.numel() * kv_cache.element_size() != self.num_blocks * self.block_bytes:
            raise ValueError("KV cache size does not match num_blocks * block_bytes")
        self.mem_type = "DRAM" if kv_cache.device.type == "cpu" else "VRAM"
        self.device_id = 0 if kv_cache.device.type == "cpu" else int(kv_cache.device.index or 0)
        self.base_addr = int(kv_cache.data_ptr())
        self._reg_descs = self._agent.register_memory(kv_cache)
        # keep the tensor alive while registered: remote readers hold its addresses
        self._kv_cache = kv_cache
        descs = _block_descs(self.base_addr, self.block_bytes, self.num_blocks, self.device_id)
        self._local_dlist = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self.mem_type)

    def metadata(self) -> bytes:
        """This agent's metadata (after :meth:`register_kv_cache`), for remote readers."""
        return self._agent.get_agent_metadata()

    # -------------------------------------------------------------------------------- remotes
    def add_remote(self, metadata: bytes, base_addr: int, block_bytes: int, num_blocks: int,
                   mem_type: str, device_id: int) -> RemoteAgent:
        """Load a remote agent's metadata and prepare its per-block descriptor list (once).
        Its ``block_bytes`` may differ from the local one (another TP size): whole-block reads
        then do not apply, only :meth:`post_regions`."""
        name = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        if name in self._remotes:
            return self._remotes[name]
        descs = _block_descs(base_addr, block_bytes, num_blocks, device_id)
        dlist = self._agent.prep_xfer_dlist(name, descs, mem_type)
        remote = RemoteAgent(name=name, num_blocks=num_blocks, dlist=dlist, base_addr=base_addr,
                             block_bytes=block_bytes, mem_type=mem_type, device_id=device_id)
        self._remotes[name] = remote
        return remote

    def load_agent(self, metadata: bytes) -> str:
        """Load an agent's metadata only, to send it notifications (the sibling TP ranks of
        this instance); returns its name."""
        name = self._agent.add_remote_agent(metadata)
        return name.decode() if isinstance(name, bytes) else name

    def remove_remote(self, name: str) -> None:
        """Forget a remote agent (it restarted or vanished): release its descriptor list and
        unload its metadata, so a later :meth:`add_remote` loads it afresh. Errors are
        logged (the peer may already be gone)."""
        remote = self._remotes.pop(name, None)
        if remote is None:
            return
        try:
            remote.dlist.release()
        except Exception as e:
            logger.debug("NIXL: releasing the descriptors of %s failed: %s", name, e)
        try:
            self._agent.remove_remote_agent(name)
        except Exception as e:
            logger.debug("NIXL: removing remote agent %s failed: %s", name, e)

    # ------------------------------------------------------------------------------ transfers
    def post_read(self, remote: RemoteAgent, local_ids: list[int], remote_ids: list[int],
                  notif: bytes) -> tuple[Any, str]:
        """Create and post a READ of remote blocks into local blocks.

        Args:
            remote: the prepared remote.
            local_ids: destination block ids (each ``< self.num_blocks``).
            remote_ids: source block ids (each ``< remote.num_blocks``).
            notif: notification the remote agent receives when the READ completes.

        Returns:
            ``(handle, state)`` with state ``"DONE"``, ``"PROC"`` or ``"ERR"``.

        Raises:
            ValueError: a block id out of range.
        """
        if any(not 0 <= b < self.num_blocks for b in local_ids):
            raise ValueError("local block id out of range")
        if any(not 0 <= b < remote.num_blocks for b in remote_ids):
            raise ValueError(
                f"remote block id out of range (remote has {remote.num_blocks} blocks)"
            )
        handle = self._agent.make_prepped_xfer(
            "READ",
            self._local_dlist,
            np.asarray(local_ids, dtype=np.int32),
            remote.dlist,
            np.asarray(remote_ids, dtype=np.int32),
            notif_msg=notif,
        )
        return handle, self._agent.transfer(handle)

    def post_regions(self, remote: RemoteAgent, regions: np.ndarray,
                     notif: bytes) -> tuple[Any, str]:
        """Create and post a READ of byte regions (a head slice of another TP size).

        Args:
            remote: the prepared remote.
            regions: ``int64 [n, 3]``: ``(local_offset, remote_offset, nbytes)`` from each cache's
                base (:func:`~pdserve.kv_transfer.nixl.tp_plan.read_regions`).
            notif: notification the remote agent receives when the READ completes.

        Returns:
            ``(handle, state)`` with state ``"DONE"``, ``"PROC"`` or ``"ERR"``.

        Raises:
            ValueError: a region outside either cache.
        """
        regions = np.asarray(regions, dtype=np.int64).reshape(-1, 3)
        ends_local = regions[:, 0] + regions[:, 2]
        ends_remote = regions[:, 1] + regions[:, 2]
        if regions.size and (regions.min() < 0
                             or ends_local.max() > self.num_blocks * self.block_bytes
                             or ends_remote.max() > remote.num_blocks * remote.block_bytes):
            raise ValueError("a transfer region lies outside a KV cache")
        local = np.empty((len(regions), 3), dtype=np.uint64)
        local[:, 0] = np.uint64(self.base_addr) + regions[:, 0].astype(np.uint64)
        local[:, 1] = regions[:, 2].astype(np.uint64)
        local[:, 2] = self.device_id
        far = np.empty((len(regions), 3), dtype=np.uint64)
        far[:, 0] = np.uint64(remote.base_addr) + regions[:, 1].astype(np.uint64)
        far[:, 1] = regions[:, 2].astype(np.uint64)
        far[:, 2] = remote.device_id
        handle = self._agent.initialize_xfer(
            "READ", self._agent.get_xfer_descs(local, self.mem_type),
            self._agent.get_xfer_descs(far, remote.mem_type), remote.name, notif)
        return handle, self._agent.transfer(handle)

    def check(self, handle: Any) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"`` (never blocks)."""
        return self._agent.check_xfer_state(handle)

    def telemetry(self, handle: Any) -> tuple[float, float, int, int] | None:
        """``(post_s, xfer_s, bytes, descriptors)`` of a finished transfer, or None."""
        try:
            t = self._agent.get_xfer_telemetry(handle)
            return t.postDuration * 1e-6, t.xferDuration * 1e-6, int(t.totalBytes), int(t.descCount)
        except Exception:
            return None

    def release(self, handle: Any) -> None:
        """Release a transfer handle (cancels it if still in progress; errors are logged)."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as e:
            logger.warning("NIXL: could not release a transfer handle: %s", e)

    # -------------------------------------------------------------------------- notifications
    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications: remote agent name -> messages."""
        return self._agent.get_new_notifs()

    def send_notif(self, remote_name: str, message: bytes) -> None:
        """Send a notification to a loaded remote agent (raises on failure)."""
        self._agent.send_notif(remote_name, message)

    # ------------------------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Release descriptor lists, remote agents and the registered memory."""
        for remote in self._remotes.values():
            try:
                remote.dlist.release()
                self._agent.remove_remote_agent(remote.name)
            except Exception:
                pass
        self._remotes.clear()
        if self._local_dlist is not None:
            try:
                self._local_dlist.release()
            except Exception:
                pass
            self._local_dlist = None
        if self._reg_descs is not None:
            try:
                self._agent.deregister_memory(self._reg_descs)
            except Exception:
                pass
            self._reg_descs = None
            self._kv_cache = None
