"""Leases on the blocks this instance holds for a remote reader (thread-safe).

A finished request's blocks stay held (the scheduler side's ``hold_blocks``) until one of:
the reader's "done" notifications (the READs completed: as many as each notice says, one per
reader rank that tells this rank, see :mod:`.tp_plan`), a reader's "abort" notification, or the
end of the lease (counted as an expired request). Heartbeats from a reader whose request
still waits in its queue extend a renewable lease; a successful claim (the reader's check right
before its READ) extends it too. The side-channel thread claims; the engine thread does the rest.

Every reader notice (done, abort, heartbeat) and the proxy's early release name the lease's
block ids; a notice whose ids are not exactly the lease's is ignored. So a reader holding forged
params (the right request id, other block ids) whose claim is refused cannot end, or keep alive,
the lease of the request it named: the honest reader still finds it.

A concurrent hand-off (docs/proxy.md) names a lease by the router's ``transfer_id`` instead: the
reader's *pending claim* (:meth:`LeaseTable.claim_transfer`) waits for the lease of the request
that came with that id and, when the reader's tokens match, learns its request id and block ids;
from then on it names the lease as any reader does. An "abort" by transfer id that arrives
before the lease (the reader gave up while the prefill ran) closes the lease when it starts.

One reader per lease (:mod:`.readers`): the first granted claim that names a reader id binds the
lease to that reader; a claim from another reader is refused, and its "done" or "abort" leaves
the lease alone. A claim or notice that names no reader (an older pdserve) acts as before.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pdserve.kv_transfer.nixl.claim_answer import ClaimAnswer, ClaimStatus
from pdserve.kv_transfer.nixl.readers import LEASED_TO_ANOTHER, admits, is_reader
from pdserve.kv_transfer.nixl.turn_leases import LeaseBlocks, TurnLeaseMoves
from pdserve.types.remote_ref import PackedTokens

__all__ = ["ClaimAnswer", "ClaimStatus", "Lease", "LeaseBlocks", "LeaseTable"]

_CLOSED_MEMORY = 10_000  # how many closed leases are remembered (to answer late claims clearly)
_EARLY_NOTICE_TTL_S = 120.0


@dataclass
class Lease:
    """The lease of blocks held for a remote reader.

    Attributes:
        block_ids: the blocks, in token order (exactly what was advertised to the reader).
        duration_s: lease length in seconds.
        expiry: ``time.monotonic()`` deadline.
        renewable: heartbeats and claims extend the lease.
        tokens: the tokens whose KV the blocks hold, packed (None: claims are not checked
            against them).
        first_token: the first output token sampled after ``tokens`` (a prefiller's),
            given to a reader whose claim matches; None when there is none.
    """

    block_ids: list[int]
    duration_s: float
    expiry: float
    renewable: bool = True
    tokens: PackedTokens | None = None
    first_token: int | None = None
    dones: int = 0  # "done" notices received so far
    claimed_at: float | None = None  # ``time.monotonic()`` of the last granted claim
    transfer_id: str | None = None  # the router's concurrent hand-off id, if any
    # a demoted turn lease (:class:`LeaseBlocks`): the block ids its params named (claims and
    # notices may name them) while ``block_ids`` are the blocks holding the KV now
    where: LeaseBlocks = LeaseBlocks.HELD
    advertised: list[int] | None = None
    reader: str | None = None  # the reader id its first granted claim named (readers.py)


class LeaseTable(TurnLeaseMoves):
    """Request id -> :class:`Lease`, with the reasons of recently closed leases (and the moves
    of a decoder's turn leases, :class:`~.turn_leases.TurnLeaseMoves`)."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._leases: dict[str, Lease] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        # notices seen before their lease: (request_id, block ids named) -> (kind, forget-at, dones,
        # expected)
        self._early: dict[tuple[str, tuple[int, ...]], tuple[str, float, int, int]] = {}
        # concurrent hand-offs: transfer id -> request id of its open lease; the reasons of
        # closed ones; aborts by transfer id before the lease -> forget-at
        self._transfers: dict[str, str] = {}
        self._closed_transfers: OrderedDict[str, str] = OrderedDict()
        self._early_transfer_aborts: dict[str, float] = {}
        # demoted turn leases a claim waits for, not reported yet (turn_leases.py)
        self._restore_wanted: set[str] = set()

    def __len__(self) -> int:
        with self._lock:
            return len(self._leases)

    def __contains__(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._leases

    def add(self, request_id: str, block_ids: list[int], duration_s: float, renewable: bool = True,
            now: float | None = None, tokens: PackedTokens | None = None,
            first_token: int | None = None, transfer_id: str | None = None) -> str | None:
        """Start a lease (``tokens``, ``first_token``, ``transfer_id``: see :class:`Lease`).

        Returns:
            The kind of a notice (``"done"``/``"abort"``) that arrived before the lease; the
            caller then closes the lease at once. None otherwise.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            self._leases[request_id] = Lease(list(block_ids), duration_s, now + duration_s, renewable,
                                         tokens,
                                         first_token, transfer_id=transfer_id)
            self._closed.pop(request_id, None)
            if transfer_id is not None:
                self._transfers[transfer_id] = request_id
                if self._early_transfer_aborts.pop(transfer_id, None) is not None:
                    return "abort"
            # notices that named other blocks (forged params) are not this lease's: they expire
            early = self._early.pop((request_id, tuple(block_ids)), None)
            if early is None:
                return None
            kind, _, dones, expected = early
            if kind == "done" and dones < expected:
                self._leases[request_id].dones = dones
                return None
            return kind

    def close(self, request_id: str, reason: str) -> bool:
        """End a lease (read done, aborted, released). Returns True when it existed."""
        with self._lock:
            if request_id not in self._leases:
                return False
            self._end(request_id, reason)
            return True

    def release_early(self, request_id: str, block_ids: Any) -> bool:
        """The proxy's release of a lease its decode leg will not read: ends the lease when it
        holds exactly ``block_ids``. Returns True when it did."""
        with self._lock:
            if not self._holds(request_id, block_ids):
                return False
            self._end(request_id, "released: the decode leg will not read it")
            return True

    def abort(self, request_id: str, block_ids: Any, now: float | None = None,
              reader: str | None = None) -> bool:
        """A reader's "abort" notice (it will not read): ends the lease when it holds exactly
        ``block_ids`` and ``reader`` may act on it (:func:`~.readers.admits`; an abort for a
        lease not registered yet is remembered). Returns True when the lease ended."""
        with self._lock:
            if request_id not in self._leases:
                self.note_unknown(request_id, "abort", 1, now, block_ids)
                return False
            if not self._holds(request_id, block_ids, reader):
                return False
            self._end(request_id, "aborted by reader")
            return True

    def done(self, request_id: str, expected: int = 1, now: float | None = None,
             block_ids: Any = None, reader: str | None = None) -> bool:
        """A reader's "done" notice for the lease holding exactly ``block_ids``: ends the lease
        once ``expected`` of them arrived (a notice for a lease not registered yet is
        remembered; one naming other blocks, or a reader other than the lease's, is ignored).
        Returns True when the lease ended."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                self.note_unknown(request_id, "done", expected, now, block_ids)
                return False
            if not self._holds(request_id, block_ids, reader):
                return False
            lease.dones += 1
            if lease.dones < expected:
                return False
            self._end(request_id, "read done")
            return True

    def note_unknown(self, request_id: str, kind: str, expected: int = 1,
                     now: float | None = None, block_ids: Any = None) -> None:
        """Remember a done/abort notice naming ``block_ids`` for a lease not registered yet
        ("done" notices are counted; an "abort" wins; they apply to the lease only when it holds
        exactly those blocks)."""
        now = time.monotonic() if now is None else now
        if not _is_block_list(block_ids):
            return
        with self._lock:
            if request_id in self._closed:
                return
            key = (request_id, tuple(block_ids))
            prev = self._early.get(key)
            if kind == "done" and prev is not None and prev[0] == "abort":
                return
            dones = (prev[2] if prev is not None else 0) + (kind == "done")
            self._early[key] = (kind, now + _EARLY_NOTICE_TTL_S, dones, expected)

    def renew(self, request_id: str, block_ids: Any, now: float | None = None) -> bool:
        """Heartbeat naming ``block_ids``: extend a renewable lease holding exactly them to
        ``now + duration``. True if extended."""
        now = time.monotonic() if now is None else now
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or not lease.renewable or not self._holds(request_id, block_ids):
                return False
            lease.expiry = max(lease.expiry, now + lease.duration_s)
            return True

    def claim_answer(self, request_id: str, block_ids: list[int], num_tokens: Any = None,
                     digest: Any = None, reader: Any = None,
                     first_token: Any = None) -> ClaimAnswer:
        """:meth:`claim` as the side channel answers it: when :attr:`ClaimStatus.OK`, with the
        lease's first output token (only told to a reader whose tokens match the lease's, so a
        decoder gets the prefiller's own first token for exactly the prompt whose KV it reads,
        whatever a client relayed) and, for a restored turn lease, ``block_ids``: the blocks
        that hold the KV now instead of those advertised (None otherwise)."""
        with self._lock:
            status, reason, left = self.claim(request_id, block_ids, num_tokens, digest,
                                              reader=reader, first_token=first_token)
            if status is not ClaimStatus.OK:
                return ClaimAnswer(status, reason)
            lease = self._leases[request_id]
            moved = list(lease.block_ids) if lease.advertised is not None else None
            return ClaimAnswer(ClaimStatus.OK, "", left, lease.first_token, block_ids=moved)

    def claim(self, request_id: str, block_ids: list[int], num_tokens: Any = None,
              digest: Any = None, now: float | None = None,
              reader: Any = None, first_token: Any = None) -> tuple[ClaimStatus, str, float]:
        """A reader's check before its READ (side-channel thread).

        When the lease knows its tokens, the reader must send ``num_tokens`` and the
        :func:`~pdserve.types.remote_ref.token_digest` of its own first ``num_tokens``
        tokens, and they must equal the owner's: KV computed for other tokens (forged or stale
        params, a prompt that differs from the prefiller's) is never read, so it cannot end up
        in the reader's prefix cache under the wrong hashes.

        ``reader`` is the reader id the claim names (:mod:`.readers`): the first granted claim
        that names one binds the lease to it, and a claim from another reader is refused
        (:data:`~.readers.LEASED_TO_ANOTHER`). A claim without it (an older pdserve) is
        checked as before, whoever the lease is bound to; one whose reader is not a string is
        refused. ``first_token`` is the first token the reader's params relayed (None: none):
        a lease with another first token refuses the claim before binding it, so params with a
        forged first token cannot take the lease from the honest reader.

        Returns:
            A ``(ClaimStatus, reason, seconds_left)`` tuple: ``(ClaimStatus.OK, "",
            seconds_left)`` when the lease holds exactly ``block_ids`` for the same tokens (a
            renewable lease is extended for the read); ``(ClaimStatus.WAIT, reason, 0)`` for an
            unknown request (its lease may not be registered yet) or a demoted turn lease being
            restored; ``(ClaimStatus.REJECT, reason, 0)`` otherwise.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None:
                closed = self._closed.get(request_id)
                if closed is not None:
                    return (ClaimStatus.REJECT,
                            f"request {request_id!r} holds no blocks any more ({closed})", 0.0)
                return ClaimStatus.WAIT, f"no blocks are held for request {request_id!r}", 0.0
            if list(block_ids) != lease.block_ids and list(block_ids) != lease.advertised:
                return (
                    ClaimStatus.REJECT,
                    f"block ids {list(block_ids)[:8]}... do not match the {len(lease.block_ids)} "
                    f"blocks held for request {request_id!r}",
                    0.0,
                )
            if lease.tokens is not None:
                ok = (isinstance(num_tokens, int) and not isinstance(num_tokens, bool)
                      and 0 < num_tokens <= len(lease.tokens) and isinstance(digest, str)
                      and digest == lease.tokens.digest(num_tokens))
                if not ok:
                    return (ClaimStatus.REJECT, f"the reader's tokens differ from those whose KV "
                            f"request {request_id!r} holds", 0.0)
            if first_token is not None and lease.first_token is not None and \
                    first_token != lease.first_token:
                return (ClaimStatus.REJECT, f"the reader's first token ({first_token}) is not "
                        f"the one the prefill of request {request_id!r} sampled", 0.0)
            if reader is not None and not is_reader(reader):
                return ClaimStatus.REJECT, "the claim names no valid reader id", 0.0
            if not admits(lease.reader, reader):
                return ClaimStatus.REJECT, f"{LEASED_TO_ANOTHER} (request {request_id!r})", 0.0
            if lease.where is not LeaseBlocks.HELD:  # demoted: the engine thread restores it
                if lease.where is LeaseBlocks.DEMOTED:
                    lease.where = LeaseBlocks.RESTORE_WANTED
                    self._restore_wanted.add(request_id)
                return (ClaimStatus.WAIT,
                        f"the blocks of request {request_id!r} are being restored", 0.0)
            if lease.renewable:
                lease.expiry = max(lease.expiry, now + lease.duration_s)
            lease.claimed_at = now
            if reader is not None:
                lease.reader = reader  # bound from the first claim granted to a named reader
            return ClaimStatus.OK, "", lease.expiry - now

    def last_claim(self) -> float | None:
        """The ``time.monotonic()`` of the latest claim granted to an open lease (its reader's
        READ may be under way), or None when no open lease was claimed."""
        with self._lock:
            times = [lease.claimed_at for lease in self._leases.values()
                     if lease.claimed_at is not None]
        return max(times, default=None)

    def next_expiry(self) -> float | None:
        """The earliest ``time.monotonic()`` deadline among the open leases (and remembered
        early notices), or None when there is none."""
        with self._lock:
            times = [lease.expiry for lease in self._leases.values()]
            times.extend(early[1] for early in self._early.values())
            times.extend(self._early_transfer_aborts.values())
        return min(times, default=None)

    def expire(self, now: float | None = None) -> list[str]:
        """Close every lease whose deadline passed (all entries are scanned).

        Returns:
            The expired request ids.
        """
        return [request_id for request_id, _ in self.expire_leases(now)]

    def expire_leases(self, now: float | None = None) -> list[tuple[str, Lease]]:
        """:meth:`expire`, returning ``(request_id, lease)`` pairs (a lease that is not renewable
        is a decoder's multi-turn TTL)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            expired = [(request_id, lease) for request_id, lease in self._leases.items() if lease.expiry <= now]
            for request_id, _ in expired:
                self._end(request_id, "lease expired")
            for key in [k for k, early in self._early.items() if early[1] <= now]:
                del self._early[key]
            for transfer_id in [t for t, at in self._early_transfer_aborts.items() if at <= now]:
                del self._early_transfer_aborts[transfer_id]
        return expired

    def _holds(self, request_id: str, block_ids: Any, reader: str | None = None) -> bool:
        """True when an open lease of ``request_id`` holds exactly ``block_ids`` and ``reader``
        may act on it (:func:`~.readers.admits`; lock held)."""
        lease = self._leases.get(request_id)
        return lease is not None and _is_block_list(block_ids) and \
            list(block_ids) in (lease.block_ids, lease.advertised) and \
            admits(lease.reader, reader)

    def _end(self, request_id: str, reason: str) -> None:
        """Close the open lease of ``request_id`` and remember why (lock held)."""
        lease = self._leases.pop(request_id)
        self._remember(request_id, reason)
        self._restore_wanted.discard(request_id)
        if lease.transfer_id is not None:
            self._transfers.pop(lease.transfer_id, None)
            self._closed_transfers[lease.transfer_id] = reason
            while len(self._closed_transfers) > _CLOSED_MEMORY:
                self._closed_transfers.popitem(last=False)

    def _remember(self, request_id: str, reason: str) -> None:
        self._closed[request_id] = reason
        while len(self._closed) > _CLOSED_MEMORY:
            self._closed.popitem(last=False)

    # ------------------------------------------------------------- concurrent hand-offs
    def claim_transfer(self, transfer_id: str, num_tokens: Any, digest: Any,
                       now: float | None = None, reader: Any = None) -> ClaimAnswer:
        """A reader's pending claim (side-channel thread): the lease of the request that came
        with ``transfer_id``, checked, extended and bound to ``reader`` as :meth:`claim` does
        (a second reader's pending claim is refused, and learns no blocks).

        Returns:
            A :class:`ClaimAnswer`: :attr:`ClaimStatus.OK` with the lease's request id, block
            ids and first token when the reader's tokens match the lease's;
            :attr:`ClaimStatus.WAIT` while no such lease started; :attr:`ClaimStatus.REJECT`
            when it already ended, or the tokens differ (the lease is left to its honest
            reader).
        """
        with self._lock:
            request_id = self._transfers.get(transfer_id)
            if request_id is None:
                closed = self._closed_transfers.get(transfer_id)
                if closed is not None:
                    return ClaimAnswer(ClaimStatus.REJECT, f"transfer {transfer_id!r} holds no "
                                       f"blocks any more ({closed})")
                return ClaimAnswer(ClaimStatus.WAIT,
                                   f"no blocks are held for transfer {transfer_id!r}")
            lease = self._leases[request_id]
            status, reason, left = self.claim(request_id, lease.block_ids, num_tokens, digest,
                                              now, reader)
            if status is not ClaimStatus.OK:
                return ClaimAnswer(status, reason)
            return ClaimAnswer(ClaimStatus.OK, "", left, lease.first_token, request_id,
                               list(lease.block_ids))

    def transfer_lease(self, transfer_id: str) -> tuple[str, list[int]] | None:
        """``(request_id, block_ids)`` of the open lease that came with ``transfer_id``, or
        None."""
        with self._lock:
            request_id = self._transfers.get(transfer_id)
            if request_id is None:
                return None
            return request_id, list(self._leases[request_id].block_ids)

    def abort_transfer(self, transfer_id: str, now: float | None = None
                       ) -> tuple[str, list[int]] | None:
        """A reader's "abort" by transfer id (it gave up before its claim was answered).

        Returns:
            ``(request_id, block_ids)`` of the open lease it names (the caller applies the
            abort to it as a notice naming those blocks); None when there is none yet, and
            then a lease starting with that id within the early-notice TTL closes at once.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            found = self.transfer_lease(transfer_id)
            if found is None and transfer_id not in self._closed_transfers:
                self._early_transfer_aborts[transfer_id] = now + _EARLY_NOTICE_TTL_S
            return found


def _is_block_list(block_ids: Any) -> bool:
    return isinstance(block_ids, list) and all(
        isinstance(b, int) and not isinstance(b, bool) for b in block_ids)
