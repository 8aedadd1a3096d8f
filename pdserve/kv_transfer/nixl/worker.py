"""Worker side of the NIXL connector: moves KV blocks between instances.

One :class:`NixlConnectorWorker` per tensor-parallel rank, in that rank's process. It owns the
rank's NIXL agent (its KV shard registered once), on rank 0 the instance's side-channel server
(so every instance can be read from, in both directions; it answers handshakes for every rank,
whose agent metadata the ranks exchange at registration, and forwards side-channel notices to
the other ranks by NIXL notification), the lease table of blocks kept for remote readers
(:mod:`.leases`), heartbeats and notices to remote owners, and the wake-up and polling
schedule of the engine loop. Its own loads live in :mod:`.loads` (handshake, claim, READ,
failure) and the handshaken remote engines in
:mod:`.remotes`. Nothing here blocks the engine loop: handshakes and side-channel notices run on
a small thread pool (only ZMQ happens there); lease claims, on the transfer's critical path, are
sent without blocking from the engine thread over one persistent connection per remote
(:class:`~pdserve.kv_transfer.nixl.side_channel.SideChannelClient`); NIXL calls happen on the
engine thread in :meth:`start_load_kv` / :meth:`get_finished`, which only post and poll.

The engine loop does not poll on a fixed tick: it sleeps until one of :meth:`wakeup_handles`
is readable (a claim answer, a side-channel notice, a finished handshake) or until
:meth:`next_poll_in` says a step is due (a posted READ, which NIXL cannot signal; notifications
for held blocks; lease and heartbeat deadlines).

A peer whose KV cache is on this instance's GPU is read by a CUDA IPC copy instead of the READ
("done" sent when it completes; :mod:`.cuda_ipc`); in host-buffer mode a peer on this host is
read by a copy from its shared host mirror (:mod:`.shared_host`), and otherwise the READ moves
pinned host mirrors of the caches and a copy to the GPU follows it (:mod:`.host_buffer`); the
path of each peer is chosen at its handshake (:mod:`.same_host`).

Restarted peers: every worker picks a random ``instance_id`` when its process starts (part of
its NIXL agent name, in its handshake info, and in every claim answer), so a reader tells a
restarted owner from the one it handshook with (:mod:`.loads`); a notification that cannot be
sent over NIXL (the peer vanished) drops the cached agent and goes by the side channel.

The module stays whole (past 450 lines): leases, notices, heartbeats and wake-ups are the one
engine-thread state every hook of this class touches; the parts that stand alone are modules of
their own (loads, remotes, leases, side channel, the TP plan).
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import queue
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.types.outputs import KVConnectorOutput
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide, TPRank
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl import host_buffer, same_host
from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.leases import LeaseTable
from pdserve.kv_transfer.nixl.loads import XFER_POLL_INTERVAL_S, XFER_SPIN_S, LoadTracker
from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata, RemoteNotice
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef
from pdserve.kv_transfer.nixl.notifications import Notice, decode_notif, encode_notif
from pdserve.kv_transfer.nixl.release import RELEASE_NOTICE
from pdserve.kv_transfer.nixl.remotes import LocalKV, RemoteRegistry, RemoteState
from pdserve.kv_transfer.nixl.side_channel import (
    SideChannelClient,
    SideChannelServer,
    compat_fields,
    compat_hash,
    side_channel_request,
    total_kv_heads,
)
from pdserve.kv_transfer.nixl.stats import StatsRecorder, TransferStats
from pdserve.kv_transfer.nixl.tp_plan import rank_heads
from pdserve.kv_transfer.nixl.transfer_path import ReadPath, SameHostTransport, TransferPaths
from pdserve.kv_transfer.wakeup import Waker

__all__ = ["NixlConnectorWorker", "XFER_POLL_INTERVAL_S", "XFER_SPIN_S", "decode_notif",
           "encode_notif"]

logger = logging.getLogger(__name__)

# Engine-loop polling while nothing can wake it (seconds), besides posted READs (.loads):
# NIXL notifications for blocks held for a remote reader ("done", heartbeats) every
# NOTIF_POLL_INTERVAL_S (they only free blocks or extend leases, nothing waits on them);
# finished background side-channel notices every BG_NOTICE_POLL_INTERVAL_S.
NOTIF_POLL_INTERVAL_S = 0.01
BG_NOTICE_POLL_INTERVAL_S = 0.05
# TP ranks other than 0: a step this often while their loads or notices are under way (their
# handshake, claim answers and notices cannot wake the engine loop of rank 0).
TP_RANK_POLL_INTERVAL_S = 0.002


@dataclass
class _Heartbeat:
    remote: RemoteKVRef
    last_sent: float = field(default=-1e18)


class NixlConnectorWorker(KVConnectorWorkerSide):
    """NIXL worker side (see the module docstring).

    Args:
        config: the validated transfer configuration.
        data_parallel_rank: selects the side-channel port (``base + rank``).
        tp: this worker's tensor-parallel rank; rank 0 hosts the side channel.

    Raises:
        NixlUnavailableError: a configured backend is missing from this NIXL build.
        SideChannelBindError: the side-channel port is in use.
    """

    def __init__(self, config: KVTransferConfig, data_parallel_rank: int = 0,
                 tp: TPRank = TPRank()):
        if not 0 <= tp.rank < tp.size or (tp.size > 1 and tp.all_gather is None):
            raise ValueError(f"bad TP rank {tp.rank} of {tp.size} (TP > 1 needs all_gather)")
        self.tp = tp
        self.config = config
        self.engine_id = config.engine_id
        self.side_channel_host = config.side_channel_host
        self.side_channel_port = config.side_channel_port_for(data_parallel_rank)
        # New per process start: readers tell a restarted peer from the one they handshook with.
        self.instance_id = secrets.token_hex(8)
        self.agent = NixlAgent(
            f"pdserve-{config.engine_id}-dp{data_parallel_rank}-tp{tp.rank}-{self.instance_id}",
            config.backends, progress_thread=config.nixl_progress_thread,
        )
        self.leases = LeaseTable()
        self.spec: KVCacheSpec | None = None
        self._info: dict[str, Any] | None = None
        self._compat: dict[str, Any] | None = None
        self._local: LocalKV | None = None
        # rank 0: the other ranks' agent metadata, and the names of those loaded (on first use)
        self._sibling_metadata: dict[int, bytes] = {}
        self._siblings: dict[int, str] = {}
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="nixl-sidechan")
        self._heartbeats: dict[str, _Heartbeat] = {}
        self._pending_notices: list[RemoteNotice] = []
        self._bg_notices: list[cf.Future] = []
        self._out = KVConnectorOutput()
        self.stats = StatsRecorder(config.kv_metrics_log_interval)
        # Same-host reads (same_host.py); the path of every peer, for logs and metrics
        self._same_host = SameHostTransport(config.same_host_transport)
        self.paths = TransferPaths()
        self._kv_cache: Any = None
        self._mirror: host_buffer.HostMirror | None = None  # kv_buffer_device "cpu" on CUDA
        # Wakes the engine loop when another thread has work for it (see wakeup_handles()).
        self._waker = Waker()
        # Lease claims: non-blocking requests from the engine thread over persistent connections.
        self._client = SideChannelClient()
        self.remotes = RemoteRegistry(config, self.agent, self._pool, self._client,
                                      lambda: self._local, self._waker.wake,
                                      self._connect_same_host)
        self.loads = LoadTracker(config, self.agent, self.remotes, self._client, self.stats,
                                 lambda: self._out, lambda n: self._pending_notices.append(n),
                                 lambda: self._mirror, self.paths)
        # (notice, tp_rank) received by the side-channel thread (tp_rank None: for every rank),
        # applied or forwarded on the engine thread
        self._side_notices: queue.SimpleQueue[tuple[Notice, int | None]] = queue.SimpleQueue()
        self.side_channel: SideChannelServer | None = None
        if tp.rank != 0:
            return
        self.side_channel = SideChannelServer(
            self.side_channel_host,
            self.side_channel_port,
            get_info=lambda: self._info,
            claim=self.leases.claim_answer,
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
        mirrored = host_buffer.wanted(want, kv_cache.device.type)
        if want != "auto" and want != kv_cache.device.type and not mirrored:
            raise ValueError(
                f"kv_buffer_device={want!r} but the KV cache lives on {kv_cache.device.type!r}; "
                "pdserve transfers from the KV cache, or from a host mirror of a CUDA cache "
                "('cpu'), so use 'auto' or 'cpu'"
            )
        expected = (spec.num_blocks, spec.num_layers, 2, spec.num_kv_heads, spec.block_size,
                    spec.head_dim)
        if tuple(kv_cache.shape) != expected:
            raise ValueError(f"KV cache shape {tuple(kv_cache.shape)} != spec {expected}")
        if self.tp.size > 1 and not spec.total_num_kv_heads:
            raise ValueError("a TP > 1 KV cache spec must give total_num_kv_heads")
        heads = rank_heads(total_kv_heads(spec), self.tp.size, self.tp.rank)  # TPLayoutError
        if heads.count != spec.num_kv_heads:
            raise ValueError(
                f"TP rank {self.tp.rank} of {self.tp.size} must hold {heads.count} of the "
                f"{total_kv_heads(spec)} KV heads, the KV cache spec says {spec.num_kv_heads}")
        if mirrored:  # host-buffer mode (host_buffer.py): NIXL moves the pinned host mirror
            self._mirror = host_buffer.HostMirror(kv_cache)
        self.agent.register_kv_cache(self._mirror.host if mirrored else kv_cache, spec.block_bytes)
        self.spec = spec
        self._kv_cache = kv_cache
        self._compat = compat_fields(spec)
        self._local = LocalKV(self.engine_id, self._compat, self.tp, spec.num_kv_heads,
                              spec.block_size * spec.head_dim * spec.element_size)
        mine = {
            "agent_name": self.agent.name,
            "agent_metadata": self.agent.metadata(),
            "kv_base_addr": self.agent.base_addr,
            "block_bytes": spec.block_bytes,
            "num_blocks": spec.num_blocks,
            "mem_type": self.agent.mem_type,
            "device_id": self.agent.device_id,
            "tp_rank": self.tp.rank,
            "head_start": heads.start,
            "num_heads": heads.count,
            "instance_id": self.instance_id,
        }
        # every rank's agent, for rank 0's side channel (one collective, at the same point of
        # start-up on every rank)
        ranks = self.tp.all_gather(mine) if self.tp.size > 1 else [mine]
        info = {
            "engine_id": self.engine_id,
            "instance_id": ranks[0]["instance_id"],  # the instance's: rank 0 answers claims
            "compat": self._compat,
            "compat_hash": compat_hash(self._compat),
            "lease_duration": self.config.kv_lease_duration,
            "tp_size": self.tp.size,
            "total_num_kv_heads": total_kv_heads(spec),
            "ranks": [{k: v for k, v in r.items() if k != "instance_id"} for r in ranks],
        }
        if self.tp.size == 1:  # same-host reads (CUDA IPC, shared host mirror): TP 1 both sides
            # host_id, pid, gpu_uuid, cuda_ipc, host_mirror
            info.update(same_host.handshake_fields(kv_cache, self._mirror))
        self._info = info
        if self.tp.rank == 0:  # rank 0 forwards side-channel notices to the other ranks
            self._sibling_metadata = {r: ranks[r]["agent_metadata"]
                                      for r in range(1, self.tp.size)}
        logger.info(
            "NIXL: registered KV cache (%s, %d blocks x %d bytes, TP rank %d of %d, KV heads "
            "%d..%d) for engine %s; side channel %s:%d", self.agent.mem_type, spec.num_blocks,
            spec.block_bytes, self.tp.rank, self.tp.size, heads.start,
            heads.start + heads.count - 1, self.engine_id, self.side_channel_host,
            self.side_channel_port,
        )

    # --------------------------------------------------------------------------- step inputs
    def bind_connector_metadata(self, metadata: Any) -> None:
        """Take this step's :class:`NixlConnectorMetadata` and apply its bookkeeping at once."""
        if metadata is None:
            return
        if not isinstance(metadata, NixlConnectorMetadata):
            raise TypeError(f"expected NixlConnectorMetadata, got {type(metadata).__name__}")
        now = time.monotonic()
        for request_id, send in metadata.reqs_to_send.items():
            if self._mirror is not None:  # host-buffer mode: the lease starts once staged
                self._mirror.stage(request_id, send.block_ids, send)
                continue
            self._add_lease(request_id, send, now)
        for request_id in metadata.release_sends:
            if self._mirror is not None and self._mirror.cancel(request_id):
                self._out.finished_sending.add(request_id)  # released while being staged
            elif self.leases.close(request_id, "released"):  # its client left before the params
                self._out.finished_sending.add(request_id)
                self.stats.current.num_kv_leases_released_early += 1
        for request_id, block_ids in metadata.early_releases.items():  # the proxy's
            self._apply_notice(Notice(RELEASE_NOTICE, request_id, 1, block_ids))
        for endpoint in metadata.handshakes:
            self.remotes.ensure(endpoint)
        for request_id, ref in metadata.heartbeat_start.items():
            self._heartbeats[request_id] = _Heartbeat(ref)
            self.remotes.ensure(ref.endpoint)
        for request_id in metadata.heartbeat_stop:
            self._heartbeats.pop(request_id, None)
        self._pending_notices.extend(metadata.notices)
        if metadata.expired_pulls:
            self.stats.current.num_kv_expired_reqs += metadata.expired_pulls
        for request_id, spec in metadata.reqs_to_recv.items():
            self._heartbeats.pop(request_id, None)
            self.loads.add(request_id, spec)
        for request_id in metadata.aborted_recvs:
            self._heartbeats.pop(request_id, None)
            self.loads.abort(request_id)

    def _add_lease(self, request_id: str, send: Any, now: float) -> None:
        """Keep a finished request's blocks (``send``: its ``SendSpec``) for a remote reader."""
        early = self.leases.add(request_id, send.block_ids, send.lease_duration,
                                send.renew_on_heartbeat, now, send.token_ids, send.first_token)
        if early is not None and self.leases.close(request_id, f"{early} before lease"):
            self._out.finished_sending.add(request_id)

    def start_load_kv(self) -> None:
        """Advance handshakes and claims and post the READs that are ready (never blocks)."""
        self._progress()

    def get_finished(self, finished_request_ids: set[str]) -> KVConnectorOutput:
        """Poll transfers, notifications, leases and heartbeats; report what finished.

        Args:
            finished_request_ids: requests the scheduler finished this step (aborts of loads arrive
                through the metadata's ``aborted_recvs``).
        """
        self._progress()
        self.loads.poll(time.monotonic())
        if self._mirror is not None:
            for request_id, (send,) in self._mirror.take_staged():
                self._add_lease(request_id, send, time.monotonic())
        self._process_notifications()
        for request_id, lease in self.leases.expire_leases():
            self._out.finished_sending.add(request_id)
            self.stats.current.num_kv_expired_reqs += 1
            if lease.renewable:
                logger.warning("NIXL: lease of request %s expired before a read; blocks freed",
                               request_id)
            else:  # a multi-turn decoder's TTL: nobody pulled this turn, as expected
                self.stats.current.num_kv_turns_expired += 1
                logger.debug("NIXL: turn blocks of request %s expired unpulled; freed", request_id)
        self._send_heartbeats()
        self._send_notices()
        out, self._out = self._out, KVConnectorOutput()
        out.stats = self.stats.take_delta()
        paths = self.paths.take_delta()
        if paths:  # each peer's read path, for the front end's /metrics
            out.stats = dict(out.stats or TransferStats().to_dict(), transfer_paths=paths)
        # for the scheduler side's expiry checks (bidirectional)
        out.remote_clock_offsets = self.remotes.take_clock_offsets()
        self.stats.maybe_log()
        return out

    def has_pending_work(self) -> bool:
        """True while loads, leases, heartbeats or notices need polling."""
        return bool(len(self.loads) or len(self.leases) or self._heartbeats
                    or self._pending_notices
                    or (self._mirror is not None and self._mirror.pending()))

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

        A rank other than 0 of a TP instance cannot wake the engine loop (its wake-ups are
        consumed in its own process): while it has loads in any phase or notices to send it
        asks for a step every :data:`TP_RANK_POLL_INTERVAL_S`.

        NIXL cannot wake the loop: a posted READ is polled every
        :data:`~pdserve.kv_transfer.nixl.loads.XFER_POLL_INTERVAL_S` (not at all for its first
        :data:`~pdserve.kv_transfer.nixl.loads.XFER_SPIN_S`, to catch short transfers at once),
        and notifications for held blocks every :data:`NOTIF_POLL_INTERVAL_S`. Lease expiries,
        heartbeats and side-channel timeouts are deadlines.
        """
        now = time.monotonic() if now is None else now
        if self._pending_notices or not self._side_notices.empty():
            return 0.0
        waits: list[float] = []
        if self.tp.rank != 0 and (len(self.loads) or self._bg_notices):
            waits.append(TP_RANK_POLL_INTERVAL_S)
        if self._mirror is not None and self._mirror.pending():
            waits.append(XFER_POLL_INTERVAL_S)
        xfer = self.loads.next_poll_in()
        if xfer is not None:
            waits.append(xfer)
        if len(self.leases):
            waits.append(NOTIF_POLL_INTERVAL_S)
            expiry = self.leases.next_expiry()
            if expiry is not None:
                waits.append(expiry - now)
        for hb in self._heartbeats.values():
            remote = self.remotes.get(hb.remote.endpoint)
            if remote is not None and remote.ready:
                waits.append(hb.last_sent + self.remotes.lease_duration(remote) / 3 - now)
        deadline = self._client.next_deadline()
        if deadline is not None:
            waits.append(deadline - now)
        if self._bg_notices:
            waits.append(BG_NOTICE_POLL_INTERVAL_S)
        return max(0.0, min(waits)) if waits else None

    def next_stats_log_in(self) -> float | None:
        """Seconds until the ``KV Transfer metrics`` line of an interval with activity is due."""
        return self.stats.next_log_in()

    def log_stats(self) -> None:
        """Log the ``KV Transfer metrics`` line if its interval is over (engine idle or not)."""
        self.stats.maybe_log()

    # ------------------------------------------------------------------- handshakes, loads
    def _connect_same_host(self, remote: RemoteState, info: dict[str, Any]) -> Any:
        """At a finished handshake: the direct reader of a peer on this GPU (CUDA IPC) or, in
        host-buffer mode, on this host (its shared mirror), or None
        (:func:`~pdserve.kv_transfer.nixl.same_host.connect_peer`); NIXL unless both
        instances run TP 1 (a direct copy moves whole blocks)."""
        if not remote.route.src_tp == remote.route.dst_tp == 1:
            self.paths.set_path(remote.endpoint.engine_id, ReadPath.NIXL,
                                f"TP {remote.route.src_tp} -> {remote.route.dst_tp}",
                                str(info.get("mem_type", "?")), self.agent.mem_type)
            return None
        return same_host.connect_peer(self._same_host, self._kv_cache, self._mirror, info,
                                      remote.endpoint.engine_id, self.paths, self.agent.mem_type)

    def _finish_handshakes(self) -> None:
        failures = self.remotes.finish()
        for f in failures:
            for request_id in [r for r, hb in self._heartbeats.items()
                           if hb.remote.endpoint.key == f.endpoint.key]:
                del self._heartbeats[request_id]
        self.loads.handshakes_failed(failures)

    def remote_clock_offset(self, endpoint: RemoteEndpoint) -> float | None:
        """Seconds to add to a local ``time.time()`` to get the remote's clock (None before the
        handshake)."""
        return self.remotes.clock_offset(endpoint)

    def _progress(self) -> None:
        self._finish_handshakes()
        now = time.monotonic()
        self._client.poll(now)
        self.loads.progress(now)

    # -------------------------------------------------------------------------- notifications
    def _on_side_channel_notice(self, kind: str, request_id: str, block_ids: Any = None,
                                tp_rank: int | None = None, expected: int = 1) -> None:
        """Side-channel thread: queue a notice (for TP rank ``tp_rank``, None: every rank) for
        the engine thread and wake it."""
        self._side_notices.put((Notice(kind, request_id, expected, block_ids), tp_rank))
        self._waker.wake()

    def _apply_notice(self, notice: Notice) -> None:
        request_id, kind = notice.request_id, notice.kind
        if kind == RELEASE_NOTICE:  # the proxy: the decode leg will not read these blocks
            if self.leases.release_early(request_id, notice.block_ids):
                self._out.finished_sending.add(request_id)
                self.stats.current.num_kv_leases_released_early += 1
                logger.debug("NIXL: lease of request %s released early", request_id)
        elif kind == "heartbeat":
            self.leases.renew(request_id, notice.block_ids)
        elif kind == "done":
            if self.leases.done(request_id, notice.expected, block_ids=notice.block_ids):
                self._out.finished_sending.add(request_id)
        elif kind == "abort":  # ignored unless it names the lease's own blocks (forged params)
            if self.leases.abort(request_id, notice.block_ids):
                self._out.finished_sending.add(request_id)

    def _forward(self, notice: Notice, tp_rank: int | None) -> None:
        """Rank 0: pass a side-channel notice on to the rank(s) it is for, by NIXL (a rank not
        reached lets its lease expire)."""
        ranks = list(self._sibling_metadata) if tp_rank is None else \
            [tp_rank] if tp_rank in self._sibling_metadata else []
        for rank in ranks:
            try:
                if rank not in self._siblings:  # loaded on first use
                    self._siblings[rank] = self.agent.load_agent(self._sibling_metadata[rank])
                self.agent.send_notif(self._siblings[rank], encode_notif(
                    notice.kind, notice.request_id, notice.expected, notice.block_ids))
            except Exception as e:
                self.stats.current.num_failed_notifications += 1
                logger.warning("NIXL: forwarding a %s notice to TP rank %d failed: %s",
                               notice.kind, rank, e)

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
                self._apply_notice(parsed)
        while True:
            try:
                notice, tp_rank = self._side_notices.get_nowait()
            except queue.Empty:
                break
            if tp_rank is None or tp_rank == self.tp.rank:
                self._apply_notice(notice)
            if tp_rank != self.tp.rank:
                self._forward(notice, tp_rank)

    def _send_to(self, ref: RemoteKVRef, kind: str, tp_rank: int | None = None) -> None:
        """Send one notification naming the remote's request and block ids to the remote ranks
        this rank notifies (or to ``tp_rank``) by NIXL if the remote agents are loaded, else by
        the side channel in the background (so a notice never waits for a handshake)."""
        remote = self.remotes.get(ref.endpoint)
        if remote is not None and remote.ready:
            route = remote.route
            ranks = route.targets if tp_rank is None else (tp_rank,)
            try:
                for rank in ranks:
                    self.agent.send_notif(remote.agents[rank].name, encode_notif(
                        kind, ref.request_id, route.expected[rank], ref.block_ids))
                return
            except Exception as e:  # the peer vanished: forget it, send by the side channel
                self.loads.forget_remote(ref.endpoint, f"a {kind} notification failed: {e}")
        message = {"type": "notify", "kind": kind, "request_id": ref.request_id,
                   "block_ids": list(ref.block_ids)}
        if tp_rank is not None and remote is not None and remote.route is not None:
            message.update(tp_rank=tp_rank, expected=remote.route.expected[tp_rank])
        self._bg_notices.append(self._pool.submit(
            side_channel_request, ref.endpoint.host, ref.endpoint.port, message,
            self.config.kv_handshake_timeout,
        ))

    def _send_notices(self) -> None:
        if self._pending_notices:
            self._finish_handshakes()
            notices, self._pending_notices = self._pending_notices, []
            for notice in notices:
                self._send_to(notice.remote, notice.kind, notice.tp_rank)
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
            remote = self.remotes.get(hb.remote.endpoint)
            if remote is None or not remote.ready:
                self.remotes.ensure(hb.remote.endpoint)
                continue
            if now - hb.last_sent >= self.remotes.lease_duration(remote) / 3:
                hb.last_sent = now
                self._send_to(hb.remote, "heartbeat")

    # ------------------------------------------------------------------------------- shutdown
    def shutdown(self) -> None:
        """Stop the side channel and the thread pool, release transfers and the agent."""
        try:
            if self.side_channel is not None:
                self.side_channel.close()
        except Exception:
            pass
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
        self._waker.close()
        self.loads.close()
        self.remotes.close()
        self.agent.close()
        if self._mirror is not None:
            self._mirror.close()
