"""Handshakes with remote engines: the cache of their NIXL agents, refreshed when a peer restarts.

One :class:`RemoteState` per remote engine (keyed by engine id, host and side-channel port).
The handshake (``get_info`` over the side channel: agent metadata, KV cache geometry, the
compatibility hash, the remote's instance id and wall clock) runs on a background thread; the
engine thread collects it in :meth:`RemoteRegistry.finish` and loads the remote agent there
(NIXL calls stay on the engine thread).

A peer that restarted (another ``instance_id`` in a claim answer) or vanished (a NIXL transport
error) is dropped with :meth:`RemoteRegistry.forget`; its next use handshakes afresh.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.kv_transfer.base import KVLoadFailure
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.nixl.agent import NixlAgent, RemoteAgent
from pdserve.kv_transfer.nixl.metadata import RemoteEndpoint
from pdserve.kv_transfer.nixl.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelTimeout,
    compat_hash,
    compat_mismatch,
    side_channel_request,
)

logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")


class HandshakeMismatch(SideChannelError):
    """The remote answered the handshake but is another engine, or its KV cache differs."""


@dataclass
class RemoteState:
    """Handshake state of one remote engine.

    Attributes:
        endpoint: where it listens and who it claims to be.
        future: the pending background handshake, or None.
        agent: the loaded remote agent once the handshake is done.
        info: its ``get_info`` payload (``instance_id``, ``lease_duration``, ...).
        clock_offset_s: remote ``time.time()`` minus local ``time.time()``.
        ipc: the CUDA IPC reader of a peer on this instance's GPU (``cuda_ipc.py``), or None.
    """

    endpoint: RemoteEndpoint
    future: cf.Future | None = None
    agent: RemoteAgent | None = None
    info: dict[str, Any] | None = None
    clock_offset_s: float = 0.0
    ipc: Any = None

    @property
    def ready(self) -> bool:
        return self.agent is not None

    @property
    def instance_id(self) -> str | None:
        """The remote process's instance id (new at every start), once handshaken."""
        return (self.info or {}).get("instance_id")


@dataclass(frozen=True)
class HandshakeFailure:
    """A handshake that failed (collected by :meth:`RemoteRegistry.finish`).

    Attributes:
        endpoint: the remote.
        kind: the load failure it means for requests waiting on it.
        reason: a sentence for the log and the client.
        reachable: the remote answered (so it can be told to drop leases).
    """

    endpoint: RemoteEndpoint
    kind: KVLoadFailure
    reason: str
    reachable: bool


class RemoteRegistry:
    """The remote engines this worker reads from or notifies.

    Args:
        config: the transfer configuration (handshake timeout).
        agent: the local NIXL agent (remote agents are loaded into it).
        pool: thread pool for the blocking handshake requests.
        client: the engine thread's side-channel client (connected ahead of the first claim).
        compat: returns the local compatibility fields (None before registration).
        wake: called from the handshake thread when it finishes (wakes the engine loop).
        connect_ipc: ``connect_ipc(remote, info)`` at a finished handshake: the CUDA IPC reader
            of a peer on this GPU, or None (NIXL reads it).
    """

    def __init__(self, config: KVTransferConfig, agent: NixlAgent, pool: cf.ThreadPoolExecutor,
                 client: SideChannelClient, compat: Callable[[], dict[str, Any] | None],
                 wake: Callable[[], None],
                 connect_ipc: Callable[[RemoteState, dict[str, Any]], Any] = lambda r, i: None):
        self.config = config
        self._agent = agent
        self._pool = pool
        self._client = client
        self._compat = compat
        self._wake = wake
        self._connect_ipc = connect_ipc
        self._remotes: dict[tuple[str, str, int], RemoteState] = {}
        # endpoint key -> clock offset, measured since the last take_clock_offsets()
        self._new_clock_offsets: dict[tuple[str, str, int], float] = {}

    def get(self, endpoint: RemoteEndpoint) -> RemoteState | None:
        """The cached state of a remote, or None."""
        return self._remotes.get(endpoint.key)

    def ensure(self, endpoint: RemoteEndpoint) -> RemoteState:
        """The state of a remote, starting its handshake in the background when needed."""
        remote = self._remotes.get(endpoint.key)
        if remote is None:
            remote = RemoteState(endpoint)
            self._remotes[endpoint.key] = remote
        if remote.agent is None and remote.future is None:
            remote.future = self._pool.submit(self._fetch_info, endpoint)
            remote.future.add_done_callback(lambda _: self._wake())
            self._client.connect(endpoint.host, endpoint.port)  # ready for the first claim
        return remote

    def _fetch_info(self, endpoint: RemoteEndpoint) -> tuple[dict[str, Any], float]:
        """Background thread: ask the remote side channel for its agent info and check it."""
        t0 = time.time()
        reply = side_channel_request(endpoint.host, endpoint.port, {"type": "get_info"},
                                     self.config.kv_handshake_timeout)
        t1 = time.time()
        if not reply.get("ok"):
            raise SideChannelError(
                f"remote {endpoint.host}:{endpoint.port} refused the handshake: "
                f"{reply.get('reason')}"
            )
        info = reply["info"]
        if info.get("engine_id") != endpoint.engine_id:
            raise HandshakeMismatch(
                f"the side channel at {endpoint.host}:{endpoint.port} belongs to engine "
                f"{info.get('engine_id')!r}, not {endpoint.engine_id!r} (restarted or wrong host)"
            )
        local = self._compat() or {}
        if info.get("compat_hash") != compat_hash(local):
            raise HandshakeMismatch(
                f"KV cache of engine {endpoint.engine_id} is incompatible: "
                f"{compat_mismatch(local, info.get('compat') or {})}"
            )
        offset = float(info.get("time", (t0 + t1) / 2)) - (t0 + t1) / 2
        return info, offset

    def finish(self) -> list[HandshakeFailure]:
        """Engine thread: load the agents of finished handshakes; drop and return the failed
        ones."""
        failures: list[HandshakeFailure] = []
        for remote in list(self._remotes.values()):
            fut = remote.future
            if fut is None or not fut.done():
                continue
            remote.future = None
            ep = remote.endpoint
            try:
                info, offset = fut.result()
                remote.agent = self._agent.add_remote(
                    info["agent_metadata"], int(info["kv_base_addr"]), int(info["block_bytes"]),
                    int(info["num_blocks"]), str(info["mem_type"]), int(info["device_id"]),
                )
                remote.info = info
                remote.clock_offset_s = offset
                remote.ipc = self._connect_ipc(remote, info)
                self._new_clock_offsets[ep.key] = offset
                logger.info("NIXL: handshake with engine %s at %s:%d done (%d remote blocks)",
                            ep.engine_id, ep.host, ep.port, remote.agent.num_blocks)
            except Exception as e:  # SideChannelError, NIXL errors, malformed info
                reason = f"NIXL handshake with engine {ep.engine_id} failed: {e}"
                logger.warning("%s", reason)
                del self._remotes[ep.key]
                reachable = not isinstance(e, SideChannelTimeout)
                kind = (KVLoadFailure.TIMEOUT if not reachable else
                        KVLoadFailure.ENGINE_MISMATCH
                        if isinstance(e, (HandshakeMismatch, ValueError)) else
                        KVLoadFailure.TRANSPORT)
                failures.append(HandshakeFailure(ep, kind, reason, reachable))
        return failures

    def forget(self, endpoint: RemoteEndpoint, why: str) -> RemoteState | None:
        """Drop a remote's cached agent (restarted or vanished); the next use handshakes
        afresh. Returns the dropped state (None when there was no loaded agent)."""
        remote = self._remotes.get(endpoint.key)
        if remote is None or remote.agent is None:
            return None
        del self._remotes[endpoint.key]
        logger.info("NIXL: engine %s at %s:%d is no longer reachable as agent %s (%s); the next "
                    "transfer handshakes again", endpoint.engine_id, endpoint.host, endpoint.port,
                    remote.agent.name, why)
        self._agent.remove_remote(remote.agent.name)
        if remote.ipc is not None:
            remote.ipc.close()
        return remote

    def lease_duration(self, remote: RemoteState) -> float:
        """The lease a remote owner grants (seconds), as its handshake said."""
        return float((remote.info or {}).get("lease_duration", self.config.kv_lease_duration))

    def clock_offset(self, endpoint: RemoteEndpoint) -> float | None:
        """Seconds to add to a local ``time.time()`` to get the remote's clock (None before the
        handshake)."""
        remote = self._remotes.get(endpoint.key)
        return remote.clock_offset_s if remote is not None and remote.agent is not None else None

    def take_clock_offsets(self) -> dict[tuple[str, str, int], float]:
        """Clock offsets measured since the last call (endpoint key ``(engine_id, host, port)``
        -> seconds)."""
        out, self._new_clock_offsets = self._new_clock_offsets, {}
        return out

    def close(self) -> None:
        """Close the CUDA IPC readers of the remotes."""
        for remote in self._remotes.values():
            if remote.ipc is not None:
                remote.ipc.close()
