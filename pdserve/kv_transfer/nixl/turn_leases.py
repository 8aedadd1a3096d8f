"""The moves of a decoder's turn lease under GPU pressure, on one TP rank's lease table: demoted
(no GPU blocks), restored into other blocks, served again (:mod:`pdserve.engine.turn_demotion`
decides them; :meth:`~.held.HeldBlocks.apply_turn_moves` applies them).

:class:`TurnLeaseMoves` is a part of :class:`~.leases.LeaseTable` (it works on the table's own
leases under its lock). A lease's :class:`LeaseBlocks` says where its KV is; a claim of a lease
that is not ``HELD`` waits. At TP > 1 every rank has its own lease of the turn (rank 0's answers
the claims): a restore is *taken* by every rank first (``RESTORED``) and served once the
scheduler saw that all ranks took it (``serve``), so a reader is never told blocks that some
rank does not hold yet; at TP 1 it is served at once.
"""

from __future__ import annotations

import enum
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.kv_transfer.nixl.leases import Lease


class LeaseBlocks(enum.Enum):
    """Where a lease's KV is (a decoder's turn lease may leave the GPU under pressure)."""

    HELD = "held"  # in the lease's GPU blocks
    DEMOTED = "demoted"  # no GPU blocks: in the prefix cache or a KV cache tier, if anywhere
    RESTORE_WANTED = "restore_wanted"  # demoted, and a reader's claim waits for it
    RESTORING = "restoring"  # demoted; the scheduler was asked to bring the blocks back
    RESTORED = "restored"  # back in GPU blocks on this rank; claims wait until it is served


_DEMOTED = (LeaseBlocks.DEMOTED, LeaseBlocks.RESTORE_WANTED, LeaseBlocks.RESTORING)


class TurnLeaseMoves:
    """The turn-lease methods of :class:`~.leases.LeaseTable` (``_lock``, ``_leases``: the
    table's lock and open leases by request id; ``_restore_wanted``: the open leases its claim
    set ``RESTORE_WANTED``, so that the engine thread's poll does not scan every lease)."""

    _lock: threading.RLock
    _leases: "dict[str, Lease]"
    _restore_wanted: set[str]

    def where(self, request_id: str) -> tuple[LeaseBlocks, list[int]] | None:
        """Where an open lease's KV is and the blocks it names now (empty while demoted), or
        None when there is no such lease."""
        with self._lock:
            lease = self._leases.get(request_id)
            return None if lease is None else (lease.where, list(lease.block_ids))

    def demote(self, request_id: str) -> bool:
        """Let a decoder's turn lease (not renewable) give up its GPU blocks: claims wait from
        now on until it is served again. Refused (False) for an unknown, renewable, already
        demoted or claimed lease (a granted claim's READ may be under way)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.renewable or lease.where is not LeaseBlocks.HELD or \
                    lease.claimed_at is not None:
                return False
            lease.advertised = lease.advertised or lease.block_ids
            lease.block_ids, lease.where = [], LeaseBlocks.DEMOTED
            return True

    def keep(self, request_id: str) -> bool:
        """Undo :meth:`demote` (another TP rank refused it, so the scheduler never freed the
        blocks): the lease holds its advertised blocks again and claims are answered. Returns
        True when the lease is open and held now."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            if lease.where in _DEMOTED and lease.advertised is not None:
                lease.block_ids, lease.where = list(lease.advertised), LeaseBlocks.HELD
                self._restore_wanted.discard(request_id)
            return lease.where is LeaseBlocks.HELD

    def take_restore_wanted(self) -> list[str]:
        """The demoted leases a reader's claim waits for, each reported once per demotion."""
        with self._lock:
            if not self._restore_wanted:
                return []
            out = []
            for request_id in self._restore_wanted:
                lease = self._leases.get(request_id)
                if lease is not None and lease.where is LeaseBlocks.RESTORE_WANTED:
                    lease.where = LeaseBlocks.RESTORING
                    out.append(request_id)
            self._restore_wanted.clear()
            return out

    def has_restore_wanted(self) -> bool:
        """True while a claim waits for a demoted lease not yet reported."""
        with self._lock:
            return bool(self._restore_wanted)

    def restore(self, request_id: str, block_ids: list[int], serve: bool = True) -> bool:
        """A demoted lease holds its KV again, in ``block_ids`` (the leading full blocks of the
        advertised ones, in token order). With ``serve`` claims are granted and answered with
        these ids at once (TP 1); without, they wait for :meth:`serve` (TP > 1: until every
        rank took them). Returns False when the lease is gone or not demoted (the caller
        reports the restore failed)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.where not in _DEMOTED:
                return False
            lease.block_ids = list(block_ids)
            lease.where = LeaseBlocks.HELD if serve else LeaseBlocks.RESTORED
            self._restore_wanted.discard(request_id)
            return True

    def serve(self, request_id: str) -> bool:
        """Every TP rank took a restored lease's blocks: claims are granted from now on.
        Returns True when the lease is open and held now."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                return False
            if lease.where is LeaseBlocks.RESTORED:
                lease.where = LeaseBlocks.HELD
            return lease.where is LeaseBlocks.HELD
