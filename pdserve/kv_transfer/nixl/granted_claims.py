"""Reader side: what a granted lease claim's answer means for its load (:mod:`.loads` acts on it).

A granted claim (``{"ok": true, ...}``, :mod:`.side_channel`) may name the blocks to read:

- a *pending* reference (the concurrent hand-off, docs/proxy.md) learns the owner's request id
  and block ids; the owner holds the whole prompt, so an answer with fewer blocks than the load
  needs fails the load;
- a decoder's *restored* turn lease (:mod:`.turn_leases`) names ``block_ids``, the blocks that
  hold its KV now: only the turn's leading blocks when the rest was lost on the owner. When they
  cover at least the load's first block, the load becomes a **partial load**: it reads them into
  its leading local blocks, leaves the others unread (:attr:`~.reads.Load.unread`), and reports
  how many it read in ``KVConnectorOutput.partial_loads``; the scheduler computes the rest
  (:meth:`~pdserve.engine.remote_kv.RemoteKV.partial_load`). Not a failure. When they cover none
  of the load's blocks the load fails as a refused lease (a pull is recomputed).

The claim carried the digest of the reader's tokens up to the load's end and the owner granted
it only for equal tokens, and a restored block holds the KV of the turn's tokens at its place
(found by their chained hash, :mod:`pdserve.engine.turn_demotion`): the leading blocks read hold
the KV of verified tokens.

The answer's lease time and the owner's first token are checked too (:func:`grant_refusal`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pdserve.kv_transfer.nixl.claim_answer import is_token
from pdserve.kv_transfer.nixl.metadata import RecvSpec
from pdserve.kv_transfer.nixl.reads import Load
from pdserve.types.outputs import KVLoadFailure


class Refusal(NamedTuple):
    """Why a load cannot go on with a claim's answer: it fails with ``kind`` and ``reason``;
    ``notify_remote``: the owner is told to drop its lease ("abort")."""

    kind: KVLoadFailure
    reason: str
    notify_remote: bool


def blocks_refusal(spec: RecvSpec, num_remote_blocks: int) -> Refusal | None:
    """None when the remote blocks ``spec`` reads exist on the remote (it has
    ``num_remote_blocks``) and pair one to one with its local blocks; else why not."""
    bad = [b for b in spec.remote_read_block_ids if b >= num_remote_blocks]
    if not bad and len(spec.local_block_ids) == len(spec.remote_read_block_ids):
        return None
    return Refusal(
        KVLoadFailure.INVALID_REFERENCE,
        f"remote block ids {bad[:8]} out of range (engine {spec.remote.endpoint.engine_id} has "
        f"{num_remote_blocks} blocks)" if bad else "local/remote block counts differ", True)


def resolve(load: Load, reply: dict[str, Any]) -> Refusal | None:
    """Point ``load``'s reference at the blocks its granted claim names (``reply``'s
    ``request_id`` and ``block_ids``): a pending reference's, or a restored turn's, which may
    be fewer than planned: then the load reads the leading ones it can (a partial load, see the
    module docstring). Returns None, or why the answer cannot be read from."""
    spec = load.spec
    restored = not spec.remote.pending
    owner_request, block_ids = reply.get("request_id"), reply.get("block_ids")
    if not isinstance(owner_request, str) or not owner_request or \
            not isinstance(block_ids, list) or not all(is_token(b) for b in block_ids):
        return Refusal(KVLoadFailure.INVALID_REFERENCE,
                       "the owner's claim answer names no request and blocks", True)
    spec.remote = spec.remote.resolved(owner_request, block_ids)
    first, planned = spec.remote_first_block, len(spec.local_block_ids)
    spec.remote_read_block_ids = list(block_ids[first:first + planned])
    held = len(spec.remote_read_block_ids)
    if held == planned:
        return None
    if not restored:
        return Refusal(KVLoadFailure.INVALID_REFERENCE,
                       f"the owner holds {len(block_ids)} blocks now; the prompt needs "
                       f"{first + planned}", True)
    if held == 0:  # the owner gave the turn up (under pressure) past what this instance has
        return Refusal(KVLoadFailure.LEASE_REFUSED,
                       f"the owner holds {len(block_ids)} of the turn's blocks now, none past "
                       f"the {first} this instance has; the prompt needs {first + planned}",
                       True)
    spec.local_block_ids, load.unread = spec.local_block_ids[:held], spec.local_block_ids[held:]
    return None


def grant_refusal(load: Load, reply: dict[str, Any]) -> Refusal | None:
    """None when a granted claim's answer leaves the load enough lease time
    (``spec.min_lease_left_s``) and, for a load that starts with the owner's first token, names
    that token (then kept in ``load.first_token``); else why not."""
    spec = load.spec
    left = float(reply.get("lease_expiry_in") or 0.0)
    if spec.min_lease_left_s > 0 and left < spec.min_lease_left_s:
        return Refusal(KVLoadFailure.LEASE_REFUSED,
                       f"the remote frees the blocks in {left:.1f} s, less than the "
                       f"{spec.min_lease_left_s:g} s a read may need", True)
    if not spec.takes_first_token:
        return None
    # the request starts with the owner's token, never with the relayed one
    owner_first = reply.get("first_token_id")
    if spec.first_token is not None and owner_first != spec.first_token:
        # the relayed params are not P's own: leave the lease to the honest reader (no abort
        # notice; it ends by that read or its expiry)
        return Refusal(KVLoadFailure.INVALID_REFERENCE,
                       f"the first token relayed by the client ({spec.first_token}) is not the "
                       f"prefiller's ({owner_first})", False)
    if not is_token(owner_first):
        return Refusal(KVLoadFailure.INVALID_REFERENCE,
                       "the prefiller's claim answer names no first token", True)
    load.first_token = owner_first
    return None
