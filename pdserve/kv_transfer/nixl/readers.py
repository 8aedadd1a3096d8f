"""Reader identity: which reading request a lease claim or a reader's notice comes from, so that
an owner's lease serves one reader only.

Held blocks are named by ``kv_transfer_params`` (request id, block ids, token digest), which a
client may hand to two readers at once (replayed to a second decoder while the first reads).
An owner that granted both claims would free the blocks at the first reader's "done", and the
second reader's READ could read blocks already reused by another request. So every claim
names its **reader id**, and the owner binds a lease to the reader of its first granted claim
(:meth:`~.leases.LeaseTable.claim`):

- a later claim from another reader is refused (:data:`LEASED_TO_ANOTHER`); the reader treats it
  as any refused claim (``LEASE_REFUSED``: it recomputes or fails per
  ``kv_load_failure_policy``);
- a claim from the same reader (another of its TP ranks, a retry, the load's own claim after an
  early one) is granted as before;
- a "done" or "abort" naming another reader leaves a bound lease alone (the other reader's
  request ending must not free the blocks the bound one is reading); a heartbeat names none
  (it only extends a lease, it never frees blocks);
- a claim or notice without the field (an older pdserve) is treated as before: granted, or
  applied, whoever the lease is bound to (vLLM's NixlConnector sends no claims at all).

The id is :func:`reader_id`: the reader instance's ``instance_id`` (its TP rank 0's, which every
rank learns at registration and which the reader's own handshake info announces; new at every
process start, so two instances never share it, whatever their configured ``engine_id``) and the
reader's request id (the same on every TP rank of the reader, one scheduler plans them all). Two
requests, or two instances, reading the same params are two readers; the TP ranks of one reading
request are one.

At owner TP > 1 only rank 0 answers claims, so only rank 0's lease is bound; another rank's
lease may still end at another reader's notice, but the blocks are freed once every rank
reported the request (``executor/kv_merge.py``), so rank 0's bound lease holds them.
"""

from __future__ import annotations

from typing import Any

#: The reason a claim from a reader other than the lease's is refused.
LEASED_TO_ANOTHER = "the blocks are leased to another reader"


def reader_id(instance_id: str, request_id: str) -> str:
    """The reader id of request ``request_id`` on the reader instance ``instance_id`` (its TP
    rank 0's): the same for every TP rank of that reading request."""
    return f"{instance_id}/{request_id}"


def is_reader(value: Any) -> bool:
    """Whether ``value`` is a reader id as it may come on the wire (a non-empty string)."""
    return isinstance(value, str) and bool(value)


def admits(bound: str | None, reader: str | None) -> bool:
    """Whether a claim or notice of ``reader`` may act on a lease bound to ``bound``: it names
    no reader (an older pdserve: as before), the lease is bound to no reader yet, or to this
    one."""
    return reader is None or bound is None or bound == reader
