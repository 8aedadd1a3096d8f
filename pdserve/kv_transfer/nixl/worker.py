"""Worker side of the NIXL connector: moves KV blocks between instances.

One :class:`NixlConnectorWorker` per engine-core process. It owns the NIXL agent (KV cache
registered once), the side-channel server (so every instance can be read from, in both
directions), the lease table of blocks kept for remote readers, and the state of this instance's
own loads. Nothing here blocks the engine loop: handshakes and side-channel notices run on a
small thread pool (only ZMQ happens there); lease claims, on the transfer's critical path, are
sent without blocking from the engine thread over one persistent connection per remote
(:class:`~pdserve.kv_transfer.nixl.side_channel.SideChannelClient`); NIXL calls happen on the
engine thread in :meth:`start_load_kv` / :meth:`get_finished`, which only post and poll.

The engine loop does not poll on a fixed tick: it sleeps until one of :meth:`wakeup_handles`
is readable (a claim answer, a side-channel notice, a finished handshake) or until
:meth:`next_poll_in` says a step is due (a posted READ, which NIXL cannot signal; notifications
for held blocks; lease and heartbeat deadlines).

Load life cycle (reader side)::

    handshake (once per remote engine, cached) -> claim (per request, checks and extends the
    owner's lease) -> READ posted (notification "done" rides on it) -> polled until DONE/ERR

Any failure ends the load with the request id in ``finished_recving``, its destination blocks
in ``invalid_block_ids`` and its :class:`~pdserve.kv_transfer.base.KVLoadError` in
``load_errors``; the owner is told to drop its lease ("abort") when it can be reached.

Restarted peers: every worker picks a random ``instance_id`` when its process starts (part of
its NIXL agent name, in its handshake info, and in every claim answer). A claim answered by
another instance than the one handshaken with (the remote restarted, with the same engine id
or on the same host and port) drops the cached remote agent and handshakes afresh before the
READ; a NIXL transport error (a READ or a notification to a peer that vanished) drops it too,
so the next load handshakes again instead of reusing a dead agent.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.outputs import KVConnectorOutput
from pdserve.kv_transfer.base import (
    KVCacheSpec,
    KVConnectorWorkerSide,
    KVLoadError,
    KVLoadFailure,
)
from pdserve.kv_transfer.config import KVTransferConfig
from pdserve.kv_transfer.nixl.agent import NixlAgent, RemoteAgent, block_runs
from pdserve.kv_transfer.nixl.leases import LeaseTable
from pdserve.kv_transfer.nixl.metadata import (
    NixlConnectorMetadata,
    RecvSpec,
    RemoteEndpoint,
    RemoteKVRef,
    RemoteNotice,
)
from pdserve.kv_transfer.nixl.release import RELEASE_NOTICE
from pdserve.kv_transfer.nixl.side_channel import (
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
    SideChannelTimeout,
    compat_fields,
    compat_hash,
    compat_mismatch,
    side_channel_request,
)
from pdserve.kv_transfer.nixl.stats import StatsRecorder, TransferStats
from pdserve.kv_transfer.wakeup import Waker

logger = logging.getLogger(__name__)

NOTIF_PREFIX = b"pdserve1|"
NOTIF_KINDS = ("done", "abort", "heartbeat")

# Engine-loop polling while nothing can wake it (seconds): a posted READ is checked without
# waiting for XFER_SPIN_S after posting, then every XFER_POLL_INTERVAL_S; NIXL notifications
# for blocks held for a remote reader ("done", heartbeats) every NOTIF_POLL_INTERVAL_S (they
# only free blocks or extend leases, nothing waits on them); finished background side-channel
# notices are collected every BG_NOTICE_POLL_INTERVAL_S.
XFER_SPIN_S = 0.002
XFER_POLL_INTERVAL_S = 0.001
NOTIF_POLL_INTERVAL_S = 0.01
BG_NOTICE_POLL_INTERVAL_S = 0.05


def encode_notif(kind: str, req_id: str) -> bytes:
    """Notification payload naming one of the owner's requests."""
    return NOTIF_PREFIX + kind.encode() + b"|" + req_id.encode()


def decode_notif(msg: bytes) -> tuple[str, str] | None:
    """``(kind, req_id)`` of a pdserve notification, or None for anything else."""
    if not msg.startswith(NOTIF_PREFIX):
        return None
    kind, sep, req = msg[len(NOTIF_PREFIX):].partition(b"|")
    if not sep:
        return None
    try:
        kind_s, req_s = kind.decode(), req.decode()
    except UnicodeDecodeError:
        return None
    return (kind_s, req_s) if kind_s in NOTIF_KINDS else None


# How often one load may go back to the handshake because the remote restarted under it.
MAX_REHANDSHAKES = 2


class HandshakeMismatch(SideChannelError):
    """The remote answered the handshake but is another engine, or its KV cache differs."""


@dataclass
class _Remote:
    """Handshake state of one remote engine."""

    endpoint: RemoteEndpoint
    future: cf.Future | None = None  # pending handshake
    agent: RemoteAgent | None = None  # ready
    info: dict[str, Any] | None = None
    clock_offset_s: float = 0.0  # remote time.time() - local time.time()


@dataclass
class _Load:
    """One request's load in progress."""

    spec: RecvSpec
    phase: str = "handshake"  # handshake -> claim -> xfer
    claim: int | None = None  # SideChannelClient ticket
    handle: Any = None
    t_start: float = field(default_factory=time.perf_counter)  # handed to the worker
    t_claim: float = 0.0  # claim sent
    claim_s: float = 0.0  # claim round trip
    t_post: float = 0.0
    post_s: float = 0.0
    deadline: float = 0.0
    aborted: bool = False
    rehandshakes: int = 0  # times the remote turned out to have restarted


@dataclass
class _Heartbeat:
    remote: RemoteKVRef
    last_sent: float = field(default=-1e18)


class NixlConnectorWorker(KVConnectorWorkerSide):
    """NIXL worker side (see the module docstring).

    Args:
        config: the validated transfer configuration.
        data_parallel_rank: selects the side-channel port (``base + rank``).

    Raises:
        NixlUnavailableError: a configured backend is missing from this NIXL build.
        SideChannelBindError: the side-channel port is in use.
    """

    def __init__(self, config: KVTransferConfig, data_parallel_rank: int = 0):
        self.config = config
        self.engine_id = config.engine_id
        self.side_channel_host = config.side_channel_host
        self.side_channel_port = config.side_channel_port_for(data_parallel_rank)
        # New per process start: readers tell a restarted peer from the one they handshook with.
        self.instance_id = secrets.token_hex(8)
        self.agent = NixlAgent(
            f"pdserve-{config.engine_id}-dp{data_parallel_rank}-{self.instance_id}",
            config.backends,
        )
        self.leases = LeaseTable()
        self.spec: KVCacheSpec | None = None
        self._info: dict[str, Any] | None = None
        self._compat: dict[str, Any] | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="nixl-sidechan")
        self._remotes: dict[tuple[str, str, int], _Remote] = {}
        self._loads: dict[str, _Load] = {}
        self._heartbeats: dict[str, _Heartbeat] = {}
        self._pending_notices: list[RemoteNotice] = []
        self._bg_notices: list[cf.Future] = []
        self._out = KVConnectorOutput()
        # "engine_id|host|port" -> clock offset, measured since the last report to the scheduler
        self._new_clock_offsets: dict[str, float] = {}
        self.stats = StatsRecorder(config.kv_metrics_log_interval)
        # Wakes the engine loop when another thread has work for it (see wakeup_handles()).
        self._waker = Waker()
        # Lease claims: non-blocking requests from the engine thread over persistent connections.
        self._client = SideChannelClient()
        # (kind, req_id, block_ids) notices received by the side-channel thread, applied on the
        # engine thread
        self._side_notices: queue.SimpleQueue[tuple[str, str, Any]] = queue.SimpleQueue()
        self.side_channel = SideChannelServer(
            self.side_channel_host,
            self.side_channel_port,
            get_info=lambda: self._info,
            claim=self.leases.claim,
            notify=self._on_side_channel_notice,
            claim_wait_s=config.kv_handshake_timeout,
            instance_id=self.instance_id,
        )

    # ------------------------------------------------------------------------- registration
    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        """Register the KV cache ``[num_blocks, L, 2, H_kv, block_size, D]`` with NIXL.

        Raises:
            ValueError: ``kv_buffer_device`` differs from the cache's device, or the tensor does
                not match ``spec``.
        """
        want = self.config.kv_buffer_device
        if want != "auto" and want != kv_cache.device.type:
            raise ValueError(
                f"kv_buffer_device={want!r} but the KV cache lives on {kv_cache.device.type!r}; "
                "pdserve transfers directly from the KV cache (use 'auto')"
            )
        expected = (spec.num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size,
                    spec.head_dim)
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} != spec {expected}")
        self.agent.register_kv_cache(kv_cache, spec.block_bytes)
        self.spec = spec
        self._compat = compat_fields(spec)
        info = {
            "engine_id": self.engine_id,
            "agent_name": self.agent.name,
            "instance_id": self.instance_id,
            "agent_metadata": self.agent.metadata(),
            "kv_base_addr": self.agent.base_addr,
            "block_bytes": spec.block_bytes,
            "num_blocks": spec.num_blocks,
            "mem_type": self.agent.mem_type,
            "device_id": self.agent.device_id,
            "compat": self._compat,
            "compat_hash": compat_hash(self._compat),
            "lease_duration": self.config.kv_lease_duration,
        }
        self._info = info
        logger.info(
            "NIXL: registered KV cache (%s, %d blocks x %d bytes) for engine %s; side channel "
            "%s:%d", self.agent.mem_type, spec.num_blocks, spec.block_bytes, self.engine_id,
            self.side_channel_host, self.side_channel_port,
        )

    # --------------------------------------------------------------------------- step inputs
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Take this step's :class:`NixlConnectorMetadata` and apply its bookkeeping at once."""
        if metadata is None:
            return
        if not isinstance(metadata, NixlConnectorMetadata):
            raise TypeError(f"expected NixlConnectorMetadata, got {type(metadata).__name__}")
        now = time.monotonic()
        for req_id, send in metadata.reqs_to_send.items():
            early = self.leases.add(req_id, send.block_ids, send.lease_duration,
                                    send.renew_on_heartbeat, now, send.token_ids)
            if early is not None and self.leases.close(req_id, f"{early} before lease"):
                self._out.finished_sending.add(req_id)
        for req_id in metadata.release_sends:
            if self.leases.close(req_id, "released"):
                self._out.finished_sending.add(req_id)
        for endpoint in metadata.handshakes:
            self._ensure_handshake(endpoint)
        for req_id, ref in metadata.heartbeat_start.items():
            self._heartbeats[req_id] = _Heartbeat(ref)
            self._ensure_handshake(ref.endpoint)
        for req_id in metadata.heartbeat_stop:
            self._heartbeats.pop(req_id, None)
        self._pending_notices.extend(metadata.notices)
        if metadata.expired_pulls:
            self.stats.current.num_kv_expired_reqs += metadata.expired_pulls
        for req_id, spec in metadata.reqs_to_recv.items():
            self._heartbeats.pop(req_id, None)
            self._loads[req_id] = _Load(spec)
            if spec.remote is not None and spec.error is None:
                self._ensure_handshake(spec.remote.endpoint)
        for req_id in metadata.aborted_recvs:
            self._heartbeats.pop(req_id, None)
            load = self._loads.get(req_id)
            if load is None:  # already reported (or never started): harmless repeat
                self._out.finished_recving.add(req_id)
            else:
                load.aborted = True

    def start_load_kv(self) -> None:
        """Advance handshakes and claims and post the READs that are ready (never blocks)."""
        self._progress()

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Poll transfers, notifications, leases and heartbeats; report what finished.

        Args:
            finished_req_ids: requests the scheduler finished this step (aborts of loads arrive
                through the metadata's ``aborted_recvs``).
        """
        self._progress()
        self._poll_transfers()
        self._process_notifications()
        for req_id, lease in self.leases.expire_leases():
            self._out.finished_sending.add(req_id)
            self.stats.current.num_kv_expired_reqs += 1
            if lease.renewable:
                logger.warning("NIXL: lease of request %s expired before a read; blocks freed",
                               req_id)
            else:  # a multi-turn decoder's TTL: nobody pulled this turn, as expected
                self.stats.current.num_kv_turns_expired += 1
                logger.debug("NIXL: turn blocks of request %s expired unpulled; freed", req_id)
        self._send_heartbeats()
        self._send_notices()
        out, self._out = self._out, KVConnectorOutput()
        out.stats = self.stats.take_delta()
        if self._new_clock_offsets:  # for the scheduler side's expiry checks (bidirectional)
            out.stats = dict(out.stats or TransferStats().to_dict(),
                             remote_clock_offsets=self._new_clock_offsets)
            self._new_clock_offsets = {}
        self.stats.maybe_log()
        return out

    def has_pending_work(self) -> bool:
        """True while loads, leases, heartbeats or notices need polling."""
        return bool(self._loads or len(self.leases) or self._heartbeats or self._pending_notices)

    # ------------------------------------------------------------------- engine loop wake-ups
    def wakeup_handles(self) -> list[Any]:
        """What the engine loop polls besides its input socket: a descriptor other threads
        make readable (side-channel notices, finished handshakes) and the engine thread's
        side-channel connections (lease-claim answers). Changes as remotes are added."""
        return [self._waker.fileno(), *self._client.sockets()]

    def handle_wakeup(self) -> None:
        """Consume wake-ups (never blocks); the next step acts on them."""
        self._waker.drain()
        self._client.poll()

    def next_poll_in(self, now: float | None = None) -> float | None:
        """Seconds until this worker needs an engine step although nothing woke the loop, or
        None when only a wake-up can give it work.

        NIXL cannot wake the loop: a posted READ is polled every :data:`XFER_POLL_INTERVAL_S`
        (not at all for its first :data:`XFER_SPIN_S`, to catch short transfers at once), and
        notifications for held blocks every :data:`NOTIF_POLL_INTERVAL_S`. Lease expiries,
        heartbeats and side-channel timeouts are deadlines.
        """
        now = time.monotonic() if now is None else now
        if self._pending_notices or not self._side_notices.empty():
            return 0.0
        waits: list[float] = []
        for load in self._loads.values():
            if load.phase == "xfer":
                spinning = time.perf_counter() - load.t_post < XFER_SPIN_S
                waits.append(0.0 if spinning else XFER_POLL_INTERVAL_S)
        if len(self.leases):
            waits.append(NOTIF_POLL_INTERVAL_S)
            expiry = self.leases.next_expiry()
            if expiry is not None:
                waits.append(expiry - now)
        for hb in self._heartbeats.values():
            remote = self._remotes.get(hb.remote.endpoint.key)
            if remote is not None and remote.agent is not None:
                lease = float((remote.info or {}).get("lease_duration",
                                                      self.config.kv_lease_duration))
                waits.append(hb.last_sent + lease / 3 - now)
        deadline = self._client.next_deadline()
        if deadline is not None:
            waits.append(deadline - now)
        if self._bg_notices:
            waits.append(BG_NOTICE_POLL_INTERVAL_S)
        return max(0.0, min(waits)) if waits else None

    # ------------------------------------------------------------------------------ handshake
    def _ensure_handshake(self, endpoint: RemoteEndpoint) -> _Remote:
        remote = self._remotes.get(endpoint.key)
        if remote is None:
            remote = _Remote(endpoint)
            self._remotes[endpoint.key] = remote
        if remote.agent is None and remote.future is None:
            remote.future = self._pool.submit(self._fetch_remote_info, endpoint)
            remote.future.add_done_callback(lambda _: self._waker.wake())
            self._client.connect(endpoint.host, endpoint.port)  # ready for the first claim
        return remote

    def _fetch_remote_info(self, endpoint: RemoteEndpoint) -> tuple[dict[str, Any], float]:
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
        local = self._compat or {}
        if info.get("compat_hash") != compat_hash(local):
            raise HandshakeMismatch(
                f"KV cache of engine {endpoint.engine_id} is incompatible: "
                f"{compat_mismatch(local, info.get('compat') or {})}"
            )
        offset = float(info.get("time", (t0 + t1) / 2)) - (t0 + t1) / 2
        return info, offset

    def _finish_handshakes(self) -> None:
        for remote in list(self._remotes.values()):
            fut = remote.future
            if fut is None or not fut.done():
                continue
            remote.future = None
            try:
                info, offset = fut.result()
                remote.agent = self.agent.add_remote(
                    info["agent_metadata"], int(info["kv_base_addr"]), int(info["block_bytes"]),
                    int(info["num_blocks"]), str(info["mem_type"]), int(info["device_id"]),
                )
                remote.info = info
                remote.clock_offset_s = offset
                ep = remote.endpoint
                self._new_clock_offsets[f"{ep.engine_id}|{ep.host}|{ep.port}"] = offset
                logger.info(
                    "NIXL: handshake with engine %s at %s:%d done (%d remote blocks)",
                    remote.endpoint.engine_id, remote.endpoint.host, remote.endpoint.port,
                    remote.agent.num_blocks,
                )
            except Exception as e:  # SideChannelError, NIXL errors, malformed info
                reason = f"NIXL handshake with engine {remote.endpoint.engine_id} failed: {e}"
                logger.warning("%s", reason)
                del self._remotes[remote.endpoint.key]
                reachable = not isinstance(e, SideChannelTimeout)
                kind = (KVLoadFailure.TIMEOUT if not reachable else
                        KVLoadFailure.ENGINE_MISMATCH
                        if isinstance(e, (HandshakeMismatch, ValueError)) else
                        KVLoadFailure.TRANSPORT)
                for req_id in [r for r, hb in self._heartbeats.items()
                               if hb.remote.endpoint.key == remote.endpoint.key]:
                    del self._heartbeats[req_id]
                for req_id, load in list(self._loads.items()):
                    if load.phase == "handshake" and load.spec.remote is not None and \
                            load.spec.remote.endpoint.key == remote.endpoint.key:
                        self._fail_load(req_id, kind, reason, notify_remote=reachable)

    def remote_clock_offset(self, endpoint: RemoteEndpoint) -> float | None:
        """Seconds to add to a local ``time.time()`` to get the remote's clock (None before the
        handshake)."""
        remote = self._remotes.get(endpoint.key)
        return remote.clock_offset_s if remote is not None and remote.agent is not None else None

    # ---------------------------------------------------------------------------------- loads
    def _progress(self) -> None:
        self._finish_handshakes()
        now = time.monotonic()
        self._client.poll(now)
        for req_id, load in list(self._loads.items()):
            spec = load.spec
            if load.phase == "handshake":
                if spec.error is not None or spec.remote is None:
                    self._fail_load(req_id, KVLoadFailure.INVALID_REFERENCE,
                                    spec.error or "no remote KV reference", notify_remote=False)
                    continue
                if load.aborted:
                    self._drop_aborted(req_id, load)
                    continue
                remote = self._ensure_handshake(spec.remote.endpoint)
                if remote.agent is None:
                    continue
                bad = [b for b in spec.remote_read_block_ids if b >= remote.agent.num_blocks]
                if bad or len(spec.local_block_ids) != len(spec.remote_read_block_ids):
                    self._fail_load(
                        req_id, KVLoadFailure.INVALID_REFERENCE,
                        f"remote block ids {bad[:8]} out of range (engine "
                        f"{spec.remote.endpoint.engine_id} has {remote.agent.num_blocks} blocks)"
                        if bad else "local/remote block counts differ",
                        notify_remote=True,
                    )
                    continue
                load.t_claim = time.perf_counter()
                load.claim = self._client.send(
                    spec.remote.endpoint.host, spec.remote.endpoint.port,
                    {"type": "claim", "request_id": spec.remote.request_id,
                     "block_ids": spec.remote.block_ids, "num_tokens": spec.digest_tokens,
                     "token_digest": spec.token_digest},
                    self.config.kv_handshake_timeout * 2,
                )
                load.phase = "claim"
            if load.phase == "claim":
                try:
                    reply = self._client.result(load.claim)
                except Exception as e:
                    timeout = isinstance(e, SideChannelTimeout)
                    self._fail_load(req_id, KVLoadFailure.TIMEOUT if timeout else
                                    KVLoadFailure.TRANSPORT, f"lease claim failed: {e}",
                                    notify_remote=not timeout)
                    continue
                if reply is None:
                    continue  # not answered yet
                if not reply.get("ok"):
                    self._fail_load(req_id, KVLoadFailure.LEASE_REFUSED,
                                    f"remote refused the read: {reply.get('reason')}",
                                    notify_remote=True)
                    continue
                if self._remote_restarted(req_id, load, reply):
                    continue
                load.claim_s = time.perf_counter() - load.t_claim
                left = float(reply.get("lease_expiry_in") or 0.0)
                if spec.min_lease_left_s > 0 and left < spec.min_lease_left_s:
                    self._fail_load(
                        req_id, KVLoadFailure.LEASE_REFUSED,
                        f"the remote frees the blocks in {left:.1f} s, less than the "
                        f"{spec.min_lease_left_s:g} s a read may need", notify_remote=True)
                    continue
                if load.aborted:
                    self._drop_aborted(req_id, load)
                    continue
                self._post(req_id, load, now)

    def _remote_restarted(self, req_id: str, load: _Load, reply: dict[str, Any]) -> bool:
        """True when a claim was answered by another instance than the handshaken one: the
        cached agent is dropped and the load goes back to the handshake (its lease claim,
        granted by the new instance, is repeated after it)."""
        endpoint = load.spec.remote.endpoint
        remote = self._remotes.get(endpoint.key)
        if remote is None or remote.agent is None:  # forgotten meanwhile (transport error)
            load.phase, load.claim = "handshake", None
            self._ensure_handshake(endpoint)
            return True
        answered = reply.get("instance_id")
        known = (remote.info or {}).get("instance_id")
        if answered is None or known is None or answered == known:
            return False
        self._forget_remote(endpoint, f"instance {known} was replaced by {answered}")
        if load.rehandshakes >= MAX_REHANDSHAKES:
            self._fail_load(req_id, KVLoadFailure.TRANSPORT,
                            f"engine {endpoint.engine_id} restarted again during the load",
                            notify_remote=True)
            return True
        load.rehandshakes += 1
        load.phase, load.claim = "handshake", None
        if load.aborted:
            self._drop_aborted(req_id, load)
        else:
            self._ensure_handshake(endpoint)
        return True

    def _forget_remote(self, endpoint: RemoteEndpoint, why: str) -> None:
        """Drop a remote engine's cached agent (restarted or vanished); the next use of that
        endpoint handshakes afresh. Loads still reading from that agent fail."""
        remote = self._remotes.pop(endpoint.key, None)
        if remote is None or remote.agent is None:
            return
        logger.info("NIXL: engine %s at %s:%d is no longer reachable as agent %s (%s); the next "
                    "transfer handshakes again", endpoint.engine_id, endpoint.host, endpoint.port,
                    remote.agent.name, why)
        for req_id, load in list(self._loads.items()):
            if load.phase == "xfer" and load.spec.remote.endpoint.key == endpoint.key:
                self._xfer_failed(req_id, load, KVLoadFailure.TRANSPORT,
                                  f"the NIXL READ's remote went away ({why})")
        self.agent.remove_remote(remote.agent.name)

    def _post(self, req_id: str, load: _Load, now: float) -> None:
        spec = load.spec
        remote = self._remotes[spec.remote.endpoint.key]
        t0 = time.perf_counter()
        try:
            handle, state = self.agent.post_read(
                remote.agent, spec.local_block_ids, spec.remote_read_block_ids,
                encode_notif("done", spec.remote.request_id),
            )
        except Exception as e:
            # The remote agent is gone (NIXL_ERR_REMOTE_DISCONNECT: the peer died or
            # restarted): forget it; this load handshakes afresh once, later loads too.
            self._forget_remote(spec.remote.endpoint, f"posting a READ failed: {e}")
            if load.rehandshakes < MAX_REHANDSHAKES and not load.aborted:
                load.rehandshakes += 1
                load.phase, load.claim = "handshake", None
                self._ensure_handshake(spec.remote.endpoint)
                return
            self._fail_load(req_id, KVLoadFailure.TRANSPORT,
                            f"posting the NIXL READ failed: {e}", notify_remote=True)
            return
        load.post_s = time.perf_counter() - t0
        load.t_post = t0
        load.handle = handle
        load.phase = "xfer"
        load.deadline = now + self.config.kv_transfer_timeout
        if state == "ERR":
            self._xfer_failed(req_id, load, KVLoadFailure.TRANSPORT,
                              "the NIXL READ failed when posted")
        elif state == "DONE":
            self._xfer_done(req_id, load)

    def _poll_transfers(self) -> None:
        now = time.monotonic()
        for req_id, load in list(self._loads.items()):
            if load.phase != "xfer":
                continue
            state = self.agent.check(load.handle)
            if state == "DONE":
                self._xfer_done(req_id, load)
            elif state == "ERR":
                self._xfer_failed(req_id, load, KVLoadFailure.TRANSPORT, "the NIXL READ failed")
            elif now > load.deadline:
                self._xfer_failed(
                    req_id, load, KVLoadFailure.TIMEOUT,
                    f"the NIXL READ did not finish within {self.config.kv_transfer_timeout:g} s",
                )

    def _xfer_done(self, req_id: str, load: _Load) -> None:
        spec = load.spec
        elapsed = time.perf_counter() - load.t_post
        tele = self.agent.telemetry(load.handle)
        self.agent.release(load.handle)
        nbytes = len(spec.local_block_ids) * self.agent.block_bytes
        ndesc = len(block_runs(spec.local_block_ids, spec.remote_read_block_ids))
        xfer_s = elapsed
        if tele is not None:
            if tele[1] > 0:
                xfer_s = tele[1]
            if tele[3] > 0:
                ndesc = tele[3]
        self.stats.current.record_transfer(xfer_s, load.post_s, nbytes, ndesc)
        del self._loads[req_id]
        self._out.finished_recving.add(req_id)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "NIXL: request %s loaded %d blocks in %.2f ms: handshake wait %.2f ms, claim "
                "%.2f ms, READ post %.2f ms, READ %.2f ms (from post to seen done %.2f ms)",
                req_id, len(spec.local_block_ids), 1e3 * (time.perf_counter() - load.t_start),
                1e3 * max(0.0, load.t_claim - load.t_start), 1e3 * load.claim_s,
                1e3 * load.post_s, 1e3 * xfer_s, 1e3 * elapsed)

    def _xfer_failed(self, req_id: str, load: _Load, kind: KVLoadFailure, reason: str) -> None:
        self.agent.release(load.handle)
        load.handle = None
        self._fail_load(req_id, kind, reason, notify_remote=True)
        if kind is KVLoadFailure.TRANSPORT and load.spec.remote is not None:
            self._forget_remote(load.spec.remote.endpoint, reason)

    def _fail_load(self, req_id: str, kind: KVLoadFailure, reason: str,
                   notify_remote: bool) -> None:
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        if load.claim is not None:
            self._client.cancel(load.claim)
        spec = load.spec
        self.stats.current.num_failed_transfers += 1
        logger.warning("NIXL: KV load of request %s failed (%s): %s", req_id, kind.value, reason)
        self._out.finished_recving.add(req_id)
        if not load.aborted:  # an aborted request's blocks are simply freed
            self._out.invalid_block_ids.update(spec.local_block_ids)
            self._out.load_errors[req_id] = KVLoadError(kind, reason)
        if notify_remote and spec.remote is not None:
            self._pending_notices.append(RemoteNotice(spec.remote, "abort"))

    def _drop_aborted(self, req_id: str, load: _Load) -> None:
        """A load aborted before its READ was posted: free locally, tell the owner."""
        del self._loads[req_id]
        if load.claim is not None:
            self._client.cancel(load.claim)
        self._out.finished_recving.add(req_id)
        if load.spec.remote is not None:
            self._pending_notices.append(RemoteNotice(load.spec.remote, "abort"))

    # -------------------------------------------------------------------------- notifications
    def _on_side_channel_notice(self, kind: str, req_id: str, block_ids: Any = None) -> None:
        """Side-channel thread: queue a notice for the engine thread and wake it."""
        self._side_notices.put((kind, req_id, block_ids))
        self._waker.wake()

    def _apply_notice(self, kind: str, req_id: str, block_ids: Any = None) -> None:
        if kind == RELEASE_NOTICE:  # the proxy: the decode leg will not read these blocks
            if self.leases.release_early(req_id, block_ids):
                self._out.finished_sending.add(req_id)
                self.stats.current.num_kv_leases_released_early += 1
                logger.debug("NIXL: lease of request %s released early", req_id)
        elif kind == "heartbeat":
            self.leases.renew(req_id)
        elif kind in ("done", "abort"):
            if self.leases.close(req_id, "read done" if kind == "done" else "aborted by reader"):
                self._out.finished_sending.add(req_id)
            else:
                self.leases.note_unknown(req_id, kind)

    def _process_notifications(self) -> None:
        try:
            notifs = self.agent.get_notifs()
        except Exception as e:
            logger.warning("NIXL: reading notifications failed: %s", e)
            notifs = {}
        for messages in notifs.values():
            for msg in messages:
                parsed = decode_notif(bytes(msg))
                if parsed is None:
                    logger.warning("NIXL: ignoring an unknown notification %r", bytes(msg)[:64])
                    continue
                self._apply_notice(*parsed)
        while True:
            try:
                kind, req_id, block_ids = self._side_notices.get_nowait()
            except queue.Empty:
                break
            self._apply_notice(kind, req_id, block_ids)

    def _send_to(self, ref: RemoteKVRef, kind: str) -> None:
        """Send one notification by NIXL if the remote agent is loaded, else by the side channel
        in the background (so a notice never waits for a handshake)."""
        remote = self._remotes.get(ref.endpoint.key)
        if remote is not None and remote.agent is not None:
            try:
                self.agent.send_notif(remote.agent.name, encode_notif(kind, ref.request_id))
                return
            except Exception as e:  # the peer vanished: forget it, send by the side channel
                self._forget_remote(ref.endpoint, f"a {kind} notification failed: {e}")
        self._bg_notices.append(self._pool.submit(
            side_channel_request, ref.endpoint.host, ref.endpoint.port,
            {"type": "notify", "kind": kind, "request_id": ref.request_id},
            self.config.kv_handshake_timeout,
        ))

    def _send_notices(self) -> None:
        if self._pending_notices:
            self._finish_handshakes()
            notices, self._pending_notices = self._pending_notices, []
            for notice in notices:
                self._send_to(notice.remote, notice.kind)
        if self._bg_notices:
            still = []
            for fut in self._bg_notices:
                if not fut.done():
                    still.append(fut)
                elif fut.exception() is not None:
                    self.stats.current.num_failed_notifications += 1
                    logger.warning("NIXL: side-channel notice failed: %s", fut.exception())
            self._bg_notices = still

    def _send_heartbeats(self) -> None:
        now = time.monotonic()
        for hb in self._heartbeats.values():
            remote = self._remotes.get(hb.remote.endpoint.key)
            if remote is None or remote.agent is None:
                self._ensure_handshake(hb.remote.endpoint)
                continue
            lease = float((remote.info or {}).get("lease_duration", self.config.kv_lease_duration))
            if now - hb.last_sent >= lease / 3:
                hb.last_sent = now
                self._send_to(hb.remote, "heartbeat")

    # ------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the side channel and the thread pool, release transfers and the agent."""
        try:
            self.side_channel.close()
        except Exception:
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self._waker.close()
        for load in self._loads.values():
            if load.handle is not None:
                self.agent.release(load.handle)
        self._loads.clear()
        self.agent.close()
