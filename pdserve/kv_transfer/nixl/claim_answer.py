"""The owner's answer to a reader's lease claim (:mod:`.leases` decides it, :mod:`.side_channel`
sends it): its :class:`ClaimStatus` and the :class:`ClaimAnswer` with what a granted claim
tells the reader; :func:`is_token`, the check of the ids a claim or its answer carries."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["ClaimAnswer", "ClaimStatus", "is_token"]


class ClaimStatus(enum.Enum):
    """The outcome of a reader's claim (:meth:`~.leases.LeaseTable.claim`, :class:`ClaimAnswer`).

    What each means for the reader:

    - ``OK``: granted; the lease holds the blocks for the reader's own tokens (and was
      extended when renewable), so the reader may READ them now.
    - ``WAIT``: not yet; no lease of that name started (its request may still be running), or
      a demoted turn lease is being restored. The side channel asks again until the reader's
      wait ends, then refuses.
    - ``REJECT``: never; the lease already ended, or it holds other blocks or the KV of other
      tokens. The reader must not read these blocks (it recomputes or fails its load).

    The side channel's reply carries only ``"ok": bool`` (the wire format knows no status); the
    values name its phase-trace marks (``sc.claim_ok``, ``sc.claim_wait``, ``sc.claim_reject``).
    """

    OK = "ok"
    WAIT = "wait"
    REJECT = "reject"


@dataclass
class ClaimAnswer:
    """The answer to a reader's claim (:meth:`~.leases.LeaseTable.claim_answer`, by request id and
    blocks) or pending claim (:meth:`~.leases.LeaseTable.claim_transfer`, by transfer id).

    Attributes:
        status: a :class:`ClaimStatus` (``OK``, ``WAIT`` or ``REJECT``).
        reason: why not :attr:`ClaimStatus.OK` ("" when ok).
        lease_left_s: seconds left on the lease after the claim (0 unless ok).
        first_token: the lease's first output token (ok only; None when it has none).
        request_id: the lease's request (a pending claim's, ok only; "" otherwise).
        block_ids: the blocks to read (ok only): a pending claim's lease blocks, or a restored
            turn lease's blocks when they are not those the reader named; None otherwise.
    """

    status: ClaimStatus
    reason: str
    lease_left_s: float = 0.0
    first_token: int | None = None
    request_id: str = ""
    block_ids: list[int] | None = None


def is_token(value: Any) -> bool:
    """A non-negative integer (a token id or block id in a claim or its answer)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
