"""Worker side of the NIXL connector: one per tensor-parallel rank, it composes the parts that
move KV blocks between instances.

One :class:`NixlConnectorWorker` per TP rank, in that rank's process. It owns the rank's NIXL
agent (its KV shard registered once) and, on rank 0, the instance's side-channel server (every
instance can be read from, in both directions; it answers handshakes for every rank, whose
agent metadata the ranks exchange at registration). The rest is done by parts it builds and
wires together:

- :class:`~.held.HeldBlocks`: the blocks held for remote readers and their leases;
- :class:`~.loads.LoadTracker`: this rank's own loads (handshake, claim, READ, failure), over
  the handshaken remotes of :class:`~.remotes.RemoteRegistry`;
- :class:`~.heartbeats.Heartbeats`: keeping a remote owner's lease alive while a request waits;
- :class:`~.notice_sender.NoticeSender` and :class:`~.notice_inbox.NoticeInbox`: notices to
  remote owners, and those received (rank 0 forwards side-channel notices to its sibling ranks);
- the wake-up :class:`~pdserve.kv_transfer.wakeup.Waker` and the engine thread's
  :class:`~.side_channel_client.SideChannelClient` (lease claims, sent without blocking over one
  persistent connection per remote).

Nothing here blocks the engine loop: handshakes and side-channel notices run on a small thread
pool (only ZMQ happens there); NIXL calls happen on the engine thread in :meth:`start_load_kv`
/ :meth:`get_finished`, which only post and poll. The engine loop does not poll on a fixed tick:
it sleeps until one of :meth:`wakeup_handles` is readable (a claim answer, a claim granted to a
reader, a side-channel notice, a finished handshake) or until :meth:`next_poll_in` says a step
is due (a posted READ, which NIXL cannot signal; notifications for held blocks, polled fast only
while a reader's READ may be under way; lease and heartbeat deadlines).

A peer whose KV cache is on this instance's GPU is read by a CUDA IPC copy instead of the READ
(:mod:`.cuda_ipc`); in host-buffer mode a peer on this host is read by a copy from its shared
host mirror (:mod:`.shared_host`), and otherwise the READ moves pinned host mirrors of the caches
and a copy to the GPU follows it (:mod:`.host_buffer`); the path of each peer is chosen at its
handshake (:mod:`.same_host`).

Restarted peers: every worker picks a random ``instance_id`` when its process starts (part of
its NIXL agent name, in its handshake info, and in every claim answer; rank 0's, with a request
id, is the reader id of this instance's claims and notices, :mod:`.readers`), so a reader tells a
restarted owner from the one it handshook with (:mod:`.loads`); a notification that cannot be
sent over NIXL (the peer vanished) drops the cached agent and goes by the side channel.

The module is one class and stays whole (past 450 lines): it is the connector's worker side of
the contract (:class:`~pdserve.kv_transfer.base.KVConnectorWorkerSide`) and the one place that
wires the parts above to each other and to the side-channel server's callbacks; what they do
lives in their own modules.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import secrets
import time
from typing import Any

from pdserve.types.outputs import KVConnectorOutput
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide, TPRank
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl import host_buffer, same_host
from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.compat import compat_fields, total_kv_heads
from pdserve.kv_transfer.nixl.handshake_info import instance_info, rank_entry
from pdserve.kv_transfer.nixl.heartbeats import Heartbeats
from pdserve.kv_transfer.nixl.held import HeldBlocks
from pdserve.kv_transfer.nixl.leases import ClaimAnswer, ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.loads import LoadTracker
from pdserve.kv_transfer.nixl.metadata import NixlConnectorMetadata
from pdserve.kv_transfer.nixl.notice_inbox import NoticeInbox
from pdserve.kv_transfer.nixl.notice_sender import BG_NOTICE_POLL_INTERVAL_S, NoticeSender
from pdserve.kv_transfer.nixl.readers import reader_id
from pdserve.kv_transfer.nixl.remotes import LocalKV, RemoteRegistry, RemoteState
from pdserve.kv_transfer.nixl.side_channel import SideChannelServer
from pdserve.kv_transfer.nixl.side_channel_client import SideChannelClient
from pdserve.kv_transfer.nixl.stats import StatsRecorder, TransferStats
from pdserve.kv_transfer.nixl.tp_plan import rank_heads
from pdserve.kv_transfer.nixl.transfer_path import ReadPath, SameHostTransport, TransferPaths
from pdserve.kv_transfer.wakeup import Waker

__all__ = ["NixlConnectorWorker"]

logger = logging.getLogger(__name__)

# TP ranks other than 0: a step this often while their loads or notices are under way (their
# handshake, claim answers and notices cannot wake the engine loop of rank 0).
TP_RANK_POLL_INTERVAL_S = 0.002


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
        self.spec: KVCacheSpec | None = None
        self._info: dict[str, Any] | None = None
        self._local: LocalKV | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="nixl-sidechan")
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
        self.leases = LeaseTable()
        self.held = HeldBlocks(self.leases, self.stats, self._lease_started,
                               records_handoff=tp.rank == 0, serve_restores=tp.size == 1)
        self.remotes = RemoteRegistry(config, self.agent, self._pool, self._client,
                                      lambda: self._local, self._waker.wake,
                                      self._connect_same_host)
        # the loads are built after the sender, which queues their notices; a failed NIXL
        # notification makes the loads forget that remote
        self.notices = NoticeSender(self.agent, self.remotes, self._pool, self.stats,
                                    lambda endpoint, why: self.loads.forget_remote(endpoint, why),
                                    config.kv_handshake_timeout,
                                    nixl_delivers=config.nixl_progress_thread,
                                    reader=self.reader_of)
        self.loads = LoadTracker(config, self.agent, self.remotes, self._client, self.stats,
                                 lambda: self._out, self.notices.queue,
                                 lambda: self._mirror, self.paths, reader=self.reader_of)
        self.heartbeats = Heartbeats(self.remotes, self.notices.send)
        self.inbox = NoticeInbox(self.agent, tp.rank, self.held.apply, self._waker.wake,
                                 self.stats)
        self.side_channel: SideChannelServer | None = None
        if tp.rank != 0:
            return
        self.side_channel = SideChannelServer(
            self.side_channel_host,
            self.side_channel_port,
            get_info=lambda: self._info,
            claim=self._answer_claim,
            notify=self.inbox.on_side_channel_notice,
            claim_wait_s=config.kv_handshake_timeout,
            instance_id=self.instance_id,
            claim_transfer=self._answer_transfer_claim,
            transfer_notice=self._transfer_notice,
        )

    def reader_of(self, request_id: str) -> str:
        """The reader id this instance's claims and notices for its request ``request_id``
        carry (:mod:`.readers`): with the instance id of TP rank 0 (every rank learns it at
        registration, so all ranks of one reading request send the same id)."""
        instance = self._info["instance_id"] if self._info is not None else self.instance_id
        return reader_id(instance, request_id)

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
            self.held.use_mirror(self._mirror)
        self.agent.register_kv_cache(self._mirror.host if mirrored else kv_cache, spec.block_bytes)
        self.spec = spec
        self._kv_cache = kv_cache
        compat = compat_fields(spec)
        self._local = LocalKV(self.engine_id, compat, self.tp, spec.num_kv_heads,
                              spec.block_size * spec.head_dim * spec.element_size)
        mine = rank_entry(self.agent, spec, self.tp, heads, self.instance_id)
        # every rank's agent, for rank 0's side channel (one collective, at the same point of
        # start-up on every rank)
        ranks = self.tp.all_gather(mine) if self.tp.size > 1 else [mine]
        info = instance_info(self.engine_id, compat, self.config.kv_lease_duration, spec, ranks)
        if self.tp.size == 1:  # same-host reads (CUDA IPC, shared host mirror): TP 1 both sides
            # host_id, pid, gpu_uuid, cuda_ipc, host_mirror
            info.update(same_host.handshake_fields(kv_cache, self._mirror))
        self._info = info
        if self.tp.rank == 0:  # rank 0 forwards side-channel notices to the other ranks
            self.inbox.set_siblings({r: ranks[r]["agent_metadata"]
                                     for r in range(1, self.tp.size)})
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
            self.held.send(request_id, send, now)
        for request_id in metadata.release_sends:  # its client left before the params
            self.held.release(request_id)
        for request_id, block_ids in metadata.early_releases.items():  # the proxy's
            self.held.release_early(request_id, block_ids)
        self.held.apply_turn_moves(metadata.demote_turns, metadata.restored_turns,
                                   metadata.lost_turns, metadata.keep_turns,
                                   metadata.serve_turns)
        self._take_held_finished()
        for endpoint in metadata.handshakes:
            self.remotes.ensure(endpoint)
        for request_id, ref in metadata.heartbeat_start.items():
            self.heartbeats.start(request_id, ref)
        for request_id, claim in metadata.pull_claims.items():
            remote = self.remotes.get(claim.remote.endpoint)
            if remote is not None and remote.direct is not None:  # claims.py: direct reads only
                self.loads.claims.send_early(request_id, claim)
        for request_id in metadata.heartbeat_stop:  # also a declined or ended pull's
            self.heartbeats.stop(request_id)
            self.loads.claims.drop(request_id)
        for notice in metadata.notices:
            self.notices.queue(notice)
        if metadata.expired_pulls:
            self.stats.current.num_kv_expired_reqs += metadata.expired_pulls
        for request_id, spec in metadata.reqs_to_recv.items():
            self.heartbeats.stop(request_id)
            self.loads.add(request_id, spec)
        for request_id in metadata.aborted_recvs:
            self.heartbeats.stop(request_id)
            self.loads.abort(request_id)

    def _take_held_finished(self) -> None:
        self._out.finished_sending |= self.held.take_finished()

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
        self.held.start_staged(time.monotonic())
        self.inbox.process()
        self.held.expire()
        self.loads.claims.drop_stale(time.monotonic())
        self._take_held_finished()
        self.held.report_turns(self._out)
        self.heartbeats.send_due()
        if self.notices.has_queued():
            self._finish_handshakes()
        self.notices.flush()
        out, self._out = self._out, KVConnectorOutput()
        self.loads.report_taken()
        out.stats = self.stats.take_delta()
        paths = self.paths.take_delta()
        if paths:  # each peer's read path, for the front end's /metrics
            out.stats = dict(out.stats or TransferStats().to_dict(), transfer_paths=paths)
        # for the scheduler side's expiry checks (bidirectional)
        out.remote_clock_offsets = self.remotes.take_clock_offsets()
        self.stats.maybe_log()
        return out

    def has_pending_work(self) -> bool:
        """True while loads, held blocks, heartbeats or notices need polling."""
        return bool(len(self.loads) or len(self.held) or len(self.heartbeats)
                    or self.notices.has_queued() or self.held.staging())

    # ------------------------------------------------------------------- engine loop wake-ups
    def _answer_claim(self, request_id: str, block_ids: list[int], num_tokens: Any = None,
                      digest: Any = None, reader: Any = None,
                      first_token: Any = None) -> ClaimAnswer:
        """Side-channel thread: answer a reader's claim from the lease table
        (:meth:`~.leases.LeaseTable.claim_answer`); a granted one wakes the engine loop, whose
        next wait then polls NIXL notifications at the read rate (its READ follows), and so
        does one that waits for a demoted turn lease (the engine thread reports it)."""
        answer = self.leases.claim_answer(request_id, block_ids, num_tokens, digest, reader,
                                          first_token)
        if answer.status is ClaimStatus.OK or (
                answer.status is ClaimStatus.WAIT and self.leases.has_restore_wanted()):
            self._waker.wake()
        return answer

    def _answer_transfer_claim(self, transfer_id: str, num_tokens: Any, digest: Any,
                               reader: Any = None) -> Any:
        """Side-channel thread: a reader's pending claim
        (:meth:`~.leases.LeaseTable.claim_transfer`); a granted one wakes the engine loop as
        :meth:`_answer_claim` does."""
        answer = self.leases.claim_transfer(transfer_id, num_tokens, digest, reader=reader)
        if answer.status is ClaimStatus.OK:
            self._waker.wake()
        return answer

    def _transfer_notice(self, kind: str, transfer_id: str, reader: str | None = None) -> None:
        """Side-channel thread: a reader's notice by transfer id, applied to the lease it
        names as a notice naming its blocks, from ``reader``, for every rank. An "abort"
        before the lease starts is remembered until it starts; a "heartbeat" then has nothing
        to renew."""
        if kind == "abort":
            found = self.leases.abort_transfer(transfer_id)
        else:
            found = self.leases.transfer_lease(transfer_id)
        if found is not None:
            self.inbox.on_side_channel_notice(kind, found[0], found[1], reader=reader)

    def _lease_started(self) -> None:
        """Engine thread: a lease of a concurrent hand-off started; its pending claim may be
        waiting at this rank's side channel."""
        if self.side_channel is not None:
            self.side_channel.wake()

    def wakeup_handles(self) -> list[Any]:
        """What the engine loop polls besides its input socket: a descriptor other threads
        make readable (side-channel notices, finished handshakes) and the engine thread's
        side-channel connections (lease-claim answers). Changes as remotes are added."""
        return [self._waker.fileno(), *self._client.sockets()]

    def handle_wakeup(self) -> None:
        """Consume wake-ups (never blocks); the next step acts on them."""
        self._waker.drain()
        self._client.poll()

    def expects_answer(self) -> bool:
        """True while a load waits for the claim answer that brings a prefiller's first token
        (the engine applies that answer while its step runs)."""
        return self.loads.awaits_first_token()

    def next_poll_in(self, now: float | None = None) -> float | None:
        """Seconds until this worker needs an engine step although nothing woke the loop, or
        None when only a wake-up can give it work.

        A rank other than 0 of a TP instance cannot wake the engine loop (its wake-ups are
        consumed in its own process): while it has loads in any phase or notices to send it
        asks for a step every :data:`TP_RANK_POLL_INTERVAL_S`.

        NIXL cannot wake the loop: a posted READ is polled every
        :data:`~pdserve.kv_transfer.nixl.loads.XFER_POLL_INTERVAL_S` (not at all for its first
        :data:`~pdserve.kv_transfer.nixl.loads.XFER_SPIN_S`, to catch short transfers at once),
        and notifications for held blocks every
        :data:`~pdserve.kv_transfer.nixl.held.READ_FAST_POLL_INTERVAL_S` for
        :data:`~pdserve.kv_transfer.nixl.held.READ_FAST_POLL_WINDOW_S` after a granted claim,
        then every :data:`~pdserve.kv_transfer.nixl.held.NOTIF_POLL_INTERVAL_S` while a reader's
        READ may be under way (a claim granted in the last
        :data:`~pdserve.kv_transfer.nixl.held.READ_POLL_WINDOW_S`; the claim woke the loop),
        every :data:`~pdserve.kv_transfer.nixl.held.HELD_NOTIF_POLL_INTERVAL_S` while blocks
        are merely held (an instance that only holds blocks sleeps until then, its next lease
        expiry, or a wake-up). Lease expiries, heartbeats, side-channel timeouts and the end of
        a pull's claim wait (``RecvSpec.claim_wait_s``) are deadlines; finished background
        side-channel notices are collected every
        :data:`~pdserve.kv_transfer.nixl.notice_sender.BG_NOTICE_POLL_INTERVAL_S`.
        """
        now = time.monotonic() if now is None else now
        if (self.notices.has_queued() or self.inbox.has_side_notices()
                or self._out.finished_sending):  # e.g. a lease bound after its step, ended
            return 0.0
        waits: list[float] = []
        if self.tp.rank != 0 and (len(self.loads) or self.notices.has_background()):
            waits.append(TP_RANK_POLL_INTERVAL_S)
        xfer = self.loads.next_poll_in()
        if xfer is not None:
            waits.append(xfer)
        waits.extend(self.held.waits(now))
        waits.extend(self.heartbeats.waits(now))
        deadline = self._client.next_deadline()
        if deadline is not None:
            waits.append(deadline - now)
        if self.notices.has_background():
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
            self.heartbeats.drop_remote(f.endpoint.key)
        self.loads.handshakes_failed(failures)

    def _progress(self) -> None:
        self._finish_handshakes()
        now = time.monotonic()
        self._client.poll(now)
        self.loads.progress(now)

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
