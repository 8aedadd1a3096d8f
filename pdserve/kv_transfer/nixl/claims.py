"""Reader side: the lease claims of the loads, among them a bidirectional pull's claim sent when
its request arrives, so that its round trip to the decoder overlaps P's scheduling of it.

A load's own claim (:meth:`Claims.claim`) checks and extends the owner's lease right before the
READ: by request id and exact block ids, or for a pending reference by the router's transfer id
(docs/proxy.md), with the digest of the reader's tokens. An **early claim** is sent at
``request_added`` for a pull (TP 1 only; the engine core binds it at once,
:meth:`~pdserve.kv_transfer.base.KVConnectorSchedulerSide.take_early_metadata`): the decoder's
whole held turn, with the digest of the prompt's tokens up to the turn's end (the pull reads at
most that far). The worker sends it only to a decoder read by a direct copy (same GPU by CUDA IPC,
or a shared host mirror): a NIXL READ over UCX's TCP and shared-memory transports advances only
when the owner's engine loop polls, and the owner's one poll that comes at once is the one its
granted claim wakes; an early grant spends it before the READ is posted, and the READ waits
for the next poll (docs/benchmarks.md, "Lease at the finishing step, early pull claims"). It is
the ordinary claim, so the owner checks exactly what it checks for the load's own. When the load
comes, its claim is the early one if that names the same remote request and blocks and covers the
load's tokens; otherwise, or when the early claim is refused or fails, the load sends its own
(:meth:`Claims.again`). Every claim names the reader id of its local request (:mod:`.readers`),
the early one too: the owner binds its lease to the first reader granted, so the load that
takes an early claim, or claims again after it, is that same reader. An early claim no load
took (the pull was declined, the request ended) is dropped with the request's heartbeat stop,
or after :data:`STALE_S`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.utils import phase_trace
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.nixl.metadata import PullClaim, RecvSpec
from pdserve.kv_transfer.nixl.reads import Load
from pdserve.kv_transfer.nixl.side_channel_client import SideChannelClient
from pdserve.types.remote_ref import RemoteKVRef

#: Seconds after which an early claim that no load took is forgotten.
STALE_S = 30.0


@dataclass
class _Early:
    claim: PullClaim
    ticket: int
    t_sent: float  # time.monotonic()


class Claims:
    """The lease claims of one worker's loads (engine thread only).

    Args:
        config: the transfer configuration (claim timeouts).
        client: the engine thread's side-channel client.
        reader: the reader id of a local request id, which every claim for it names
            (:mod:`.readers`); None: claims name no reader.
    """

    def __init__(self, config: KVTransferConfig, client: SideChannelClient,
                 reader: Callable[[str], str] | None = None):
        self.config = config
        self._client = client
        self._reader = reader
        self._early: dict[str, _Early] = {}

    def reader(self, request_id: str) -> str | None:
        """The reader id the claims and notices of local request ``request_id`` name (None
        when this instance names none)."""
        return None if self._reader is None else self._reader(request_id)

    def __len__(self) -> int:
        """Early claims not taken yet."""
        return len(self._early)

    def claim(self, request_id: str, load: Load) -> None:
        """Give ``load`` its claim: the request's early one when it covers the load, else a
        new one (``load.claim``, ``load.early``)."""
        sent = self._early.pop(request_id, None)
        if sent is not None and _covers(sent.claim, load.spec):
            load.claim, load.early = sent.ticket, True
            return
        if sent is not None:
            self._client.cancel(sent.ticket)
        load.claim, load.early = self._own(load), False

    def again(self, load: Load) -> bool:
        """True when ``load``'s failed or refused claim was an early one: its own is sent."""
        if not load.early:
            return False
        load.claim, load.early = self._own(load), False
        return True

    def _own(self, load: Load) -> Any:
        """Post the lease claim of a load (a pending claim for a pending reference), naming
        its reader id."""
        spec = load.spec
        ref = spec.remote
        if ref.pending:
            wait_s = self.config.kv_prefill_wait_timeout
            return self._client.send(
                ref.endpoint.host, ref.endpoint.port,
                _named({"type": "claim", "transfer_id": ref.transfer_id, "wait_s": wait_s,
                        "num_tokens": spec.digest_tokens, "token_digest": spec.token_digest},
                       load.reader),
                wait_s + self.config.kv_handshake_timeout * 2)
        return self._send(ref, spec.digest_tokens, spec.token_digest, load.reader,
                          spec.first_token)

    def _send(self, ref: RemoteKVRef, num_tokens: int, digest: str, reader: str | None,
              first_token: int | None = None) -> Any:
        """Post a claim of ``ref``'s request and blocks for the reader's first ``num_tokens``
        tokens (``digest``: their :func:`~pdserve.types.remote_ref.token_digest`) by the reader
        id ``reader``, with the first token its params relayed (if any: the owner refuses the
        claim before binding its lease when it is not the lease's); returns the client's
        ticket."""
        message = {"type": "claim", "request_id": ref.request_id, "block_ids": ref.block_ids,
                   "num_tokens": num_tokens, "token_digest": digest}
        if first_token is not None:
            message["first_token_id"] = first_token
        return self._client.send(ref.endpoint.host, ref.endpoint.port, _named(message, reader),
                                 self.config.kv_handshake_timeout * 2)

    def send_early(self, request_id: str, claim: PullClaim) -> None:
        """Send the claim of an arriving request's pull (never blocks), by the reader id its
        load will name."""
        self.drop(request_id)
        phase_trace.mark("kv.claim_early")
        ticket = self._send(claim.remote, claim.num_tokens, claim.token_digest,
                            self.reader(request_id))
        self._early[request_id] = _Early(claim, ticket, time.monotonic())

    def drop(self, request_id: str) -> None:
        """Forget a request's early claim (its pull was declined or the request ended)."""
        sent = self._early.pop(request_id, None)
        if sent is not None:
            self._client.cancel(sent.ticket)

    def drop_stale(self, now: float) -> None:
        """Forget the early claims older than :data:`STALE_S` (``now``: ``time.monotonic()``)."""
        for request_id in [r for r, s in self._early.items() if now - s.t_sent > STALE_S]:
            self.drop(request_id)


def _named(message: dict[str, Any], reader: str | None) -> dict[str, Any]:
    """A claim ``message`` with its reader id (none when ``reader`` is None)."""
    return message if reader is None else dict(message, reader=reader)


def _covers(claim: PullClaim, spec: RecvSpec) -> bool:
    """Whether an early claim is valid for a load: the same remote request and blocks, and at
    least the tokens it loads (of the same prompt)."""
    ref, mine = claim.remote, spec.remote
    return (mine is not None and not mine.pending and mine.endpoint.key == ref.endpoint.key
            and mine.request_id == ref.request_id and list(mine.block_ids) == list(ref.block_ids)
            and 0 < spec.digest_tokens <= claim.num_tokens)
