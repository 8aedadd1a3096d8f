"""Owner side of the NIXL connector: the blocks this instance holds for remote readers, from a
finished request's send to the end of its lease.

:class:`HeldBlocks` wraps the :class:`~pdserve.kv_transfer.nixl.leases.LeaseTable` (the lease of
every held request) with what the engine thread does to it: start a lease for each send of a
step (in host-buffer mode once the blocks are staged in the host mirror, :mod:`.host_buffer`),
end it on the proxy's release, a reader's "done" or "abort", or its expiry, extend it on a
heartbeat. Every request whose held blocks may be freed is reported once through
:meth:`HeldBlocks.take_finished` (the engine's ``finished_sending``). :meth:`HeldBlocks.waits`
says when the engine loop must step for them: fast while a reader's READ may be under way, slowly
while the blocks are merely held, and at each lease's expiry.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from pdserve.kv_transfer.nixl import host_buffer
from pdserve.kv_transfer.nixl.leases import LeaseTable
from pdserve.kv_transfer.nixl.loads import XFER_POLL_INTERVAL_S
from pdserve.kv_transfer.nixl.notifications import Notice
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.types.outputs import KVConnectorOutput

# the worker's logger: its log lines keep the name they always had
logger = logging.getLogger("pdserve.kv_transfer.nixl.worker")

# NIXL notifications for held blocks ("done", "abort", heartbeats) cannot wake the engine loop;
# they are polled (seconds between polls):
# - every READ_FAST_POLL_INTERVAL_S for READ_FAST_POLL_WINDOW_S after a claim was granted
#   (every reader claims over the side channel right before its READ, and a granted claim wakes
#   the loop, see worker.py): without NIXL's progress thread the owner's polls are what serve
#   the reader's READ over UCX's TCP and shared-memory transports, so a 10 ms poll made every
#   CPU READ take about 10 ms whatever its size (docs/benchmarks.md, "P/D hand-off overhead");
#   polled each millisecond, the READ takes what its bytes take, and its "done" is seen at once;
READ_FAST_POLL_INTERVAL_S = 0.001
READ_FAST_POLL_WINDOW_S = 0.5
# - every NOTIF_POLL_INTERVAL_S after that while a read may still be under way: a lease had a
#   claim granted in the last READ_POLL_WINDOW_S;
NOTIF_POLL_INTERVAL_S = 0.01
READ_POLL_WINDOW_S = 30.0
# - every HELD_NOTIF_POLL_INTERVAL_S while the blocks are merely held (no claim yet, or none
#   lately): what can come then (a heartbeat, an abort, a late "done") only extends a lease or
#   frees blocks a little later, and the notifications are always read right before the
#   leases' expiry is checked, so a heartbeat waiting in NIXL's queue still saves its lease.
HELD_NOTIF_POLL_INTERVAL_S = 0.5


class HeldBlocks:
    """The requests whose blocks this instance holds for a remote reader (engine thread).

    Args:
        leases: the lease table (shared with the side-channel server, which answers claims
            from it on its own thread).
        stats: the transfer counters (early releases, expiries).
        lease_started: called after a lease starts (the side channel then answers the
            pending claims waiting for it at once).
        records_handoff: count each prompt lease's hand-off time (``TransferStats.handoff_s``;
            TP rank 0 only, so a request is counted once).
        serve_restores: a restored turn lease answers claims at once (TP 1); at TP > 1 only
            once the scheduler says every rank took the blocks (``serve``).
    """

    def __init__(self, leases: LeaseTable, stats: StatsRecorder,
                 lease_started: Callable[[], None] = lambda: None,
                 records_handoff: bool = True, serve_restores: bool = True):
        self.leases = leases
        self._stats = stats
        self._lease_started = lease_started
        self._records_handoff = records_handoff
        self._started: dict[str, float] = {}  # prompt leases: request id -> lease start
        self._mirror: host_buffer.HostMirror | None = None
        self._finished: set[str] = set()
        self._serve_restores = serve_restores
        self._turns = KVConnectorOutput()  # the turn leases' answers not reported yet

    def use_mirror(self, mirror: host_buffer.HostMirror | None) -> None:
        """Host-buffer mode: a send's lease starts once its blocks are staged in ``mirror``."""
        self._mirror = mirror

    def take_finished(self) -> set[str]:
        """The requests whose held blocks may be freed since the last call (each once)."""
        out, self._finished = self._finished, set()
        for request_id in out:
            self._started.pop(request_id, None)
        return out

    def send(self, request_id: str, send: Any, now: float) -> None:
        """Hold a finished request's blocks (``send``: its ``SendSpec``) for a remote reader:
        start the lease, or in host-buffer mode stage the blocks first."""
        if self._mirror is not None:
            self._mirror.stage(request_id, send.block_ids, send)
            return
        self._start_lease(request_id, send, now)

    def _start_lease(self, request_id: str, send: Any, now: float) -> None:
        early = self.leases.add(request_id, send.block_ids, send.lease_duration,
                                send.renew_on_heartbeat, now, send.tokens, send.first_token,
                                send.transfer_id)
        if early is not None and self.leases.close(request_id, f"{early} before lease"):
            self._finished.add(request_id)
            return
        if send.renew_on_heartbeat and self._records_handoff:
            self._started[request_id] = time.monotonic()
        if send.transfer_id is not None:
            self._lease_started()

    def release(self, request_id: str) -> None:
        """The scheduler's release of a request its client left before it got the params."""
        if self._mirror is not None and self._mirror.cancel(request_id):
            self._finished.add(request_id)  # released while being staged
        elif self.leases.close(request_id, "released"):
            self._finished.add(request_id)
            self._stats.current.num_kv_leases_released_early += 1

    def start_staged(self, now: float) -> None:
        """Host-buffer mode: start the leases of the sends whose staging finished."""
        if self._mirror is not None:
            for request_id, (send,) in self._mirror.take_staged():
                self._start_lease(request_id, send, now)

    def release_early(self, request_id: str, block_ids: list[int]) -> None:
        """The proxy's early release (the decode leg will not read these blocks), as the engine
        core delivers it (``NixlConnectorMetadata.early_releases``): ends the lease only when it
        holds exactly ``block_ids`` for ``request_id``, and counts it."""
        if self.leases.release_early(request_id, block_ids):
            self._finished.add(request_id)
            self._stats.current.num_kv_leases_released_early += 1
            logger.debug("NIXL: lease of request %s released early", request_id)

    def apply(self, notice: Notice) -> None:
        """Apply a reader's notice about a held request: heartbeat, "done" or "abort" (each
        acts only on a lease holding exactly the blocks it names; a "done" or "abort" from a
        reader other than the one the lease is bound to is ignored, :mod:`.readers`)."""
        request_id, kind = notice.request_id, notice.kind
        if kind == "heartbeat":
            self.leases.renew(request_id, notice.block_ids)
        elif kind == "done":
            if self.leases.done(request_id, notice.expected, block_ids=notice.block_ids,
                                reader=notice.reader):
                self._finished.add(request_id)
                started = self._started.pop(request_id, None)
                if started is not None:
                    self._stats.current.handoff_s.append(time.monotonic() - started)
        elif kind == "abort":  # ignored unless it names the lease's own blocks (forged params)
            if self.leases.abort(request_id, notice.block_ids, reader=notice.reader):
                self._finished.add(request_id)

    def expire(self) -> None:
        """Free the held blocks whose lease ended unread (counted as expired requests)."""
        for request_id, lease in self.leases.expire_leases():
            self._finished.add(request_id)
            self._stats.current.num_kv_expired_reqs += 1
            if lease.renewable:
                logger.warning("NIXL: lease of request %s expired before a read; blocks freed",
                               request_id)
            else:  # a multi-turn decoder's TTL: nobody pulled this turn, as expected
                self._stats.current.num_kv_turns_expired += 1
                logger.debug("NIXL: turn blocks of request %s expired unpulled; freed", request_id)

    def apply_turn_moves(self, demote: set[str], restored: dict[str, list[int]],
                         lost: set[str], keep: set[str] = frozenset(),
                         serve: set[str] = frozenset()) -> None:
        """A decoder's turn leases under GPU pressure (:mod:`pdserve.engine.turn_demotion`;
        every TP rank gets the same moves, :mod:`.turn_leases`), reported by
        :meth:`report_turns`:

        - ``demote``: give up their GPU blocks: ``demoted_turns`` when the lease agreed,
          ``kept_turns`` when it refused (claimed, gone, or host-buffer mode, whose reads come
          from the mirror);
        - ``keep``: a rank refused the demotion: hold the advertised blocks again;
        - ``restored``: the blocks now holding a demoted lease's KV: ``restored_turns`` when the
          lease took them (served at once at TP 1, else after ``serve``), ``failed_turns``
          when it is gone;
        - ``serve``: every rank took the restored blocks: claims are answered;
        - ``lost``: no tier had the blocks any more, or a rank lost the lease: it ends (its
          waiting claim is rejected and the reader recomputes).
        """
        for request_id in demote:
            if self._mirror is None and self.leases.demote(request_id):
                self._turns.demoted_turns.add(request_id)
            else:
                self._turns.kept_turns.add(request_id)
        for request_id in keep:
            if self.leases.keep(request_id):
                self._lease_started()  # a claim may wait for it
        for request_id, block_ids in restored.items():
            if self.leases.restore(request_id, block_ids, serve=self._serve_restores):
                self._turns.restored_turns.add(request_id)
                if self._serve_restores:
                    self._lease_started()  # the waiting claim is answered at once
            else:
                self._turns.failed_turns.add(request_id)
        for request_id in serve:
            if self.leases.serve(request_id):
                self._lease_started()
        for request_id in lost:
            if self.leases.close(request_id, "its blocks left every KV cache tier"):
                self._finished.add(request_id)
                self._lease_started()

    def report_turns(self, out: KVConnectorOutput) -> None:
        """Add the turn leases' answers since the last call to ``out`` (each once):
        ``demoted_turns``, ``kept_turns``, ``restored_turns``, ``failed_turns`` and the
        demoted leases a claim waits for (``turns_to_restore``)."""
        turns, self._turns = self._turns, KVConnectorOutput()
        out.demoted_turns |= turns.demoted_turns
        out.kept_turns |= turns.kept_turns
        out.restored_turns |= turns.restored_turns
        out.failed_turns |= turns.failed_turns
        out.turns_to_restore.update(self.leases.take_restore_wanted())

    def staging(self) -> bool:
        """True while host-buffer mode stages blocks into the mirror."""
        return self._mirror is not None and self._mirror.pending()

    def __len__(self) -> int:
        return len(self.leases)

    def waits(self, now: float) -> list[float]:
        """Seconds until a step is due for the held blocks: staging polls, notification polls
        (:data:`NOTIF_POLL_INTERVAL_S` while a read may be under way,
        :data:`HELD_NOTIF_POLL_INTERVAL_S` while the blocks are merely held) and the next lease
        expiry; empty when nothing is held or staged (``now``: ``time.monotonic()``). Right after
        a granted claim the poll is :data:`READ_FAST_POLL_INTERVAL_S` (the READ follows)."""
        waits: list[float] = []
        if self.staging():
            waits.append(XFER_POLL_INTERVAL_S)
        if len(self.leases):
            claimed = self.leases.last_claim()
            since = now - claimed if claimed is not None else math.inf
            waits.append(READ_FAST_POLL_INTERVAL_S if since < READ_FAST_POLL_WINDOW_S else
                         NOTIF_POLL_INTERVAL_S if since < READ_POLL_WINDOW_S else
                         HELD_NOTIF_POLL_INTERVAL_S)
            expiry = self.leases.next_expiry()
            if expiry is not None:
                waits.append(expiry - now)
        return waits
