"""Outgoing notices of the NIXL connector: "done", "abort" and "heartbeat" to a remote owner's
ranks, by NIXL notification when its agents are loaded and NIXL's progress thread runs, else by
its side channel in the background (so a notice never waits for a handshake). A "done" or
"abort" for a local request names its reader id (:mod:`.readers`), so that an owner whose lease
is bound to another reader leaves it alone."""

from __future__ import annotations

import concurrent.futures as cf
import logging
from collections.abc import Callable

from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.metadata import RemoteNotice
from pdserve.kv_transfer.nixl.notifications import encode_notif
from pdserve.kv_transfer.nixl.remotes import RemoteRegistry
from pdserve.kv_transfer.nixl.side_channel import side_channel_request
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.remote_ref import RemoteEndpoint, RemoteKVRef

# the worker's logger: its log lines keep the name they always had
logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")

# Finished background side-channel notices are collected this often (seconds).
BG_NOTICE_POLL_INTERVAL_S = 0.05


class NoticeSender:
    """Notices queued for remote owners and those under way by side channel (engine thread).

    Args:
        agent: this rank's NIXL agent.
        remotes: the handshaken remote engines (their agents and the TP route).
        pool: the thread pool that runs blocking side-channel requests.
        stats: the transfer counters (failed notifications).
        forget_remote: called with an endpoint and a reason when a NIXL notification to it
            failed (the peer vanished); its cached agent is dropped.
        timeout_s: seconds a side-channel notice waits for its answer.
        nixl_delivers: True when this rank's agent runs NIXL's progress thread
            (``nixl_progress_thread``). Without it a notification posted outside a transfer
            leaves only while the engine thread polls the agent, and its connection's wire-up
            takes several polls on both sides: an engine with nothing else to poll after the
            notice (a decoder that aborted its one waiting request) would never deliver it,
            and the owner would hold the blocks until the lease expires. So without the thread
            every notice goes by the side channel, which answers each one.
        reader: the reader id of a local request (:meth:`~.worker.NixlConnectorWorker.reader_of`),
            for the notices that name one (``RemoteNotice.reader_request``); None: none do.
    """

    def __init__(self, agent: NixlAgent, remotes: RemoteRegistry, pool: cf.Executor,
                 stats: StatsRecorder, forget_remote: Callable[[RemoteEndpoint, str], None],
                 timeout_s: float, nixl_delivers: bool = True,
                 reader: Callable[[str], str] | None = None):
        self._agent = agent
        self._reader = reader
        self._nixl_delivers = nixl_delivers
        self._remotes = remotes
        self._pool = pool
        self._stats = stats
        self._forget_remote = forget_remote
        self._timeout_s = timeout_s
        self._queued: list[RemoteNotice] = []
        self._background: list[cf.Future] = []

    def queue(self, notice: RemoteNotice) -> None:
        """Send ``notice`` at the next :meth:`flush`."""
        self._queued.append(notice)

    def has_queued(self) -> bool:
        """True while notices wait for :meth:`flush`."""
        return bool(self._queued)

    def has_background(self) -> bool:
        """True while side-channel notices are under way."""
        return bool(self._background)

    def send(self, ref: RemoteKVRef, kind: str, tp_rank: int | None = None,
             reader: str | None = None) -> None:
        """Send one notice naming the remote's request and block ids to the remote ranks this
        rank notifies (or to ``tp_rank``): by NIXL if the remote agents are loaded and NIXL
        delivers notifications on its own, else by the side channel in the background (one
        message per target rank, with its expected count, once the handshake is done; before
        it one that the remote's rank 0 applies and forwards to its ranks). A pending
        reference (its claim not answered yet) is named by its transfer id: only an "abort" or
        a "heartbeat" is sent, to the remote's side channel. ``reader``: the reader id the
        notice names (None: none)."""
        by_reader = {} if reader is None else {"reader": reader}
        if ref.pending:  # a concurrent hand-off whose claim was not answered: by transfer id
            if kind in ("abort", "heartbeat"):
                self._submit(ref.endpoint, {"type": "notify", "kind": kind,
                                            "transfer_id": ref.transfer_id, **by_reader})
            return
        remote = self._remotes.get(ref.endpoint)
        if remote is not None and remote.ready and self._nixl_delivers:
            route = remote.route
            ranks = route.targets if tp_rank is None else (tp_rank,)
            try:
                for rank in ranks:
                    self._agent.send_notif(remote.agents[rank].name, encode_notif(
                        kind, ref.request_id, route.expected[rank], ref.block_ids, reader))
                return
            except Exception as e:  # the peer vanished: forget it, send by the side channel
                self._forget_remote(ref.endpoint, f"a {kind} notification failed: {e}")
        message = {"type": "notify", "kind": kind, "request_id": ref.request_id,
                   "block_ids": list(ref.block_ids), **by_reader}
        route = remote.route if remote is not None else None
        if route is not None and (remote.ready or tp_rank is not None):
            for rank in (route.targets if tp_rank is None else (tp_rank,)):
                self._submit(ref.endpoint,
                             dict(message, tp_rank=rank, expected=route.expected[rank]))
        else:
            self._submit(ref.endpoint, message)

    def _submit(self, endpoint: RemoteEndpoint, message: dict) -> None:
        self._background.append(self._pool.submit(
            side_channel_request, endpoint.host, endpoint.port, message, self._timeout_s,
        ))

    def flush(self) -> None:
        """Send the queued notices; collect the side-channel notices that finished (a failed
        one is counted and logged)."""
        if self._queued:
            notices, self._queued = self._queued, []
            for notice in notices:
                reader = None if notice.reader_request is None or self._reader is None else \
                    self._reader(notice.reader_request)
                self.send(notice.remote, notice.kind, notice.tp_rank, reader)
        if self._background:
            still = []
            for fut in self._background:
                if not fut.done():
                    still.append(fut)
                elif fut.exception() is not None:
                    self._stats.current.num_failed_notifications += 1
                    logger.warning("NIXL: side-channel notice failed: %s", fut.exception())
            self._background = still
