"""Handshakes with remote engines: the cache of their NIXL agents, refreshed when a peer restarts.

One :class:`RemoteState` per remote engine (keyed by engine id, host and side-channel port).
The handshake (``get_info`` over the side channel: agent metadata, KV cache geometry, the
compatibility hash, the remote's TP size and KV heads, instance id and wall clock) runs on a
background thread: it asks for the remote's TP rank 0, checks that the two instances can
exchange KV (:func:`~pdserve.kv_transfer.nixl.tp_plan.pairing_error`; the TP sizes may differ),
plans this rank's reads (:func:`~pdserve.kv_transfer.nixl.tp_plan.plan_route`) and asks for the
other remote ranks the route names. The engine thread collects it in
:meth:`RemoteRegistry.finish` and loads the remote agents there (NIXL calls stay on the engine
thread).

A peer that restarted (another ``instance_id`` in a claim answer) or vanished (a NIXL transport
error) is dropped with :meth:`RemoteRegistry.forget`; its next use handshakes afresh.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.kv_transfer.base import TPRank
from pdserve.types.outputs import KVLoadFailure
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl.agent import NixlAgent, RemoteAgent
from pdserve.types.remote_ref import RemoteEndpoint
from pdserve.kv_transfer.nixl.tp_plan import Route, TPLayoutError, pairing_error, plan_route
from pdserve.kv_transfer.nixl.compat import cache_kind_mismatch, compat_hash, compat_mismatch
from pdserve.types.kv_cache_kind import KVCacheKind
from pdserve.kv_transfer.nixl.side_channel import (
    SideChannelError,
    SideChannelTimeout,
    side_channel_request,
)
from pdserve.kv_transfer.nixl.side_channel_client import SideChannelClient

logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")


class HandshakeMismatch(SideChannelError):
    """The remote answered the handshake but is another engine, or its KV cache differs."""


class WrongEngine(HandshakeMismatch):
    """The side channel the params point at belongs to another engine than they name: the
    params are stale (that engine restarted) or wrong, a fault of the reference."""


@dataclass(frozen=True)
class LocalKV:
    """What a handshake checks and plans against: this rank's side.

    Attributes:
        engine_id: this instance's engine id.
        compat: :func:`~pdserve.kv_transfer.nixl.compat.compat_fields` of this instance.
        tp: this worker's TP rank and size.
        heads: KV heads in this rank's cache.
        head_bytes: bytes of one head in one block, layer and K/V.
    """

    engine_id: str
    compat: dict[str, Any]
    tp: TPRank
    heads: int
    head_bytes: int


def describe_pairing(remote_id: str, remote_tp: Any, remote_heads: Any, remote_per_rank: Any,
                     local: LocalKV) -> str:
    """Both sides of a pairing in words (TP sizes and KV heads), for handshake errors."""
    return (f"engine {remote_id} has TP {remote_tp} with {remote_heads} KV heads "
            f"({remote_per_rank} per rank), this engine {local.engine_id} has TP {local.tp.size} "
            f"with {local.compat.get('total_num_kv_heads')} KV heads ({local.heads} per rank)")


@dataclass
class RemoteState:
    """Handshake state of one remote engine.

    Attributes:
        endpoint: where it listens and who it claims to be.
        future: the pending background handshake, or None.
        agent: the loaded agent of the remote's TP rank 0 once the handshake is done (every
            reader rank notifies it).
        agents: the loaded agents of the remote TP ranks this rank reads or notifies, by rank.
        route: what this rank reads from which remote rank, and whom it notifies.
        info: its rank 0's ``get_info`` payload (``instance_id``, ``lease_duration``, ...).
        clock_offset_s: remote ``time.time()`` minus local ``time.time()``.
        direct: the direct reader of a peer on this host (``same_host.py``: CUDA IPC on this
            GPU, or its shared host mirror in host-buffer mode), or None.
    """

    endpoint: RemoteEndpoint
    future: cf.Future | None = None
    agent: RemoteAgent | None = None
    agents: dict[int, RemoteAgent] | None = None
    route: Route | None = None
    info: dict[str, Any] | None = None
    clock_offset_s: float = 0.0
    direct: Any = None

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
        local: returns this rank's :class:`LocalKV` (None before registration).
        wake: called from the handshake thread when it finishes (wakes the engine loop).
        connect_same_host: ``connect_same_host(remote, info)`` at a finished handshake: the
            direct reader of a peer on this host (``same_host.py``), or None (NIXL reads it).
    """

    def __init__(self, config: KVTransferConfig, agent: NixlAgent, pool: cf.ThreadPoolExecutor,
                 client: SideChannelClient, local: Callable[[], LocalKV | None],
                 wake: Callable[[], None],
                 connect_same_host: Callable[[RemoteState, dict[str, Any]], Any]
                 = lambda r, i: None):
        self.config = config
        self._agent = agent
        self._pool = pool
        self._client = client
        self._local = local
        self._wake = wake
        self._connect_same_host = connect_same_host
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

    def _request_info(self, endpoint: RemoteEndpoint, tp_rank: int) -> dict[str, Any]:
        reply = side_channel_request(endpoint.host, endpoint.port,
                                     {"type": "get_info", "tp_rank": tp_rank},
                                     self.config.kv_handshake_timeout)
        if not reply.get("ok"):
            raise SideChannelError(
                f"remote {endpoint.host}:{endpoint.port} refused the handshake of its TP rank "
                f"{tp_rank}: {reply.get('reason')}"
            )
        return reply["info"]

    def _fetch_info(self, endpoint: RemoteEndpoint
                    ) -> tuple[dict[int, dict[str, Any]], float, Route]:
        """Background thread: ask the remote side channel for its ranks' agent info, check that
        the two instances can exchange KV and plan this rank's route."""
        t0 = time.time()
        info = self._request_info(endpoint, 0)
        t1 = time.time()
        if info.get("engine_id") != endpoint.engine_id:
            raise WrongEngine(
                f"the side channel at {endpoint.host}:{endpoint.port} belongs to engine "
                f"{info.get('engine_id')!r}, not {endpoint.engine_id!r} (restarted or wrong host)"
            )
        local = self._local()
        if local is None:
            raise SideChannelError("the local KV cache is not registered yet")
        remote_compat = info.get("compat") or {}
        remote_tp = info.get("tp_size", 1)
        remote_heads = remote_compat.get("total_num_kv_heads")
        sides = describe_pairing(endpoint.engine_id, remote_tp, remote_heads,
                                 info.get("num_heads"), local)
        kinds = cache_kind_mismatch(local.compat, remote_compat)
        if kinds is not None:
            raise HandshakeMismatch(f"KV cache of engine {endpoint.engine_id} is incompatible: "
                                    f"{kinds} ({sides})")
        kind = KVCacheKind(local.compat["cache_kind"])
        why = (pairing_error(remote_heads, remote_tp, local.compat["total_num_kv_heads"],
                             local.tp.size, kind)
               if isinstance(remote_tp, int) and isinstance(remote_heads, int)
               else "the remote did not say its TP size and KV heads")
        if why is not None:
            raise HandshakeMismatch(f"KV cannot move between these instances: {sides}: {why}")
        if info.get("compat_hash") != compat_hash(local.compat):
            raise HandshakeMismatch(
                f"KV cache of engine {endpoint.engine_id} is incompatible: "
                f"{compat_mismatch(local.compat, remote_compat)} ({sides})"
            )
        try:
            route = plan_route(remote_heads, remote_tp, local.tp.size, local.tp.rank,
                               local.compat["num_layers"], local.head_bytes, kind)
        except TPLayoutError as e:
            raise HandshakeMismatch(f"KV cannot move between these instances: {sides}: {e}")
        infos = {0: info}
        for rank in route.targets:
            if rank not in infos:
                infos[rank] = self._request_info(endpoint, rank)
        for rank in {r.src_rank for r in route.reads} | {0}:
            if infos[rank].get("num_heads") != route.src.heads:
                raise HandshakeMismatch(
                    f"TP rank {rank} of engine {endpoint.engine_id} holds "
                    f"{infos[rank].get('num_heads')} KV heads, not {route.src.heads} ({sides})")
        offset = float(info.get("time", (t0 + t1) / 2)) - (t0 + t1) / 2
        return infos, offset, route

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
                infos, offset, route = fut.result()
                agents = {
                    rank: self._agent.add_remote(
                        info["agent_metadata"], int(info["kv_base_addr"]),
                        int(info["block_bytes"]), int(info["num_blocks"]), str(info["mem_type"]),
                        int(info["device_id"]))
                    for rank, info in sorted(infos.items())
                }
                remote.agents, remote.agent, remote.route = agents, agents[0], route
                remote.info = infos[0]
                remote.clock_offset_s = offset
                remote.direct = self._connect_same_host(remote, infos[0])
                self._new_clock_offsets[ep.key] = offset
                logger.info("NIXL: handshake with engine %s at %s:%d done (%d remote blocks, "
                            "TP %d -> %d, reads from ranks %s)", ep.engine_id, ep.host, ep.port,
                            remote.agent.num_blocks, route.src_tp, route.dst_tp,
                            sorted({r.src_rank for r in route.reads}))
            except Exception as e:  # SideChannelError, NIXL errors, malformed info
                reason = f"NIXL handshake with engine {ep.engine_id} failed: {e}"
                logger.warning("%s", reason)
                del self._remotes[ep.key]
                reachable = not isinstance(e, SideChannelTimeout)
                kind = (KVLoadFailure.TIMEOUT if not reachable else
                        KVLoadFailure.INVALID_REFERENCE if isinstance(e, WrongEngine) else
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
        for agent in (remote.agents or {0: remote.agent}).values():
            self._agent.remove_remote(agent.name)
        if remote.direct is not None:
            remote.direct.close()
        return remote

    def lease_duration(self, remote: RemoteState) -> float:
        """The lease a remote owner grants (seconds), as its handshake said."""
        return float((remote.info or {}).get("lease_duration", self.config.kv_lease_duration))

    def take_clock_offsets(self) -> dict[tuple[str, str, int], float]:
        """Clock offsets measured since the last call (endpoint key ``(engine_id, host, port)``
        -> seconds)."""
        out, self._new_clock_offsets = self._new_clock_offsets, {}
        return out

    def close(self) -> None:
        """Close the direct (same-host) readers of the remotes."""
        for remote in self._remotes.values():
            if remote.direct is not None:
                remote.direct.close()
