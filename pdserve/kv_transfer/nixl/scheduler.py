"""Scheduler side of the NIXL connector: decides which blocks move (pure bookkeeping, no torch,
no I/O).

Prefill → decode (docs/architecture.md, "Request flow of one P/D turn"):

* **Prefiller (P)**, request with ``kv_transfer_params.do_remote_decode``: when it finishes
  normally, :meth:`request_finished` holds its blocks (``hold_blocks``) under a lease and returns
  ``{do_remote_prefill: true, do_remote_decode: false, remote_engine_id, remote_block_ids,
  remote_host, remote_port, remote_request_id, tp_size}``. The worker side frees the blocks
  (``finished_sending``) on the reader's "done"/"abort" notification or when the lease expires.
* **Decoder (D)**, request with ``do_remote_prefill``: :meth:`get_num_new_matched_tokens`
  offers ``prompt_len - 1 - num_local_computed`` tokens, loaded asynchronously, so D reads only
  what its prefix cache lacks and recomputes only the last prompt token (for its logits). While
  the request waits in D's queue, the worker sends heartbeats that keep P's lease alive (by
  the router's transfer id for a concurrent hand-off whose claim is not answered yet). A
  request finished on D before its read tells P to drop the lease ("abort"); one finished while
  its READ is in flight holds its blocks until the READ is over (it appears in
  ``finished_recving``).

Decode → prefill, multi-turn (docs/architecture.md, "Multi-turn: bidirectional transfer"; both sides with ``bidirectional_kv_xfer``): the
decisions live in :mod:`pdserve.kv_transfer.nixl.bidirectional` (D holds a finished turn's
blocks for ``decoder_kv_blocks_ttl``; P pulls the hash-verified prefix it lacks when worth it and
not about to expire, else recomputes and tells D to drop the blocks). A failed pull is
recomputed (:meth:`NixlConnectorScheduler.load_failure_policy`), never an error.

The scheduler side reads a request's parsed params
(:class:`~pdserve.types.kv_params.KVTransferParams`: role, remote KV reference, relayed
first token) and builds the params it returns with :mod:`pdserve.types.kv_params`.

The module is one class and stays whole (past 450 lines): it is the connector's side of the
scheduler's contract (:class:`~pdserve.kv_transfer.base.KVConnectorSchedulerSide`), whose every
call reads and moves the same per-request tables (plans, waits, loads in flight, holds); the
decisions themselves are pure functions elsewhere (:mod:`.bidirectional`, :mod:`.prefix_match`).
"""

from __future__ import annotations

import enum
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pdserve.types.request import RequestStatus
from pdserve.kv_transfer.base import (
    NOT_HELD, FinishedRequestKV, KVConnectorSchedulerSide, TurnMove,
)
from pdserve.types.kv_transfer_config import KVLoadFailurePolicy, KVTransferConfig
from pdserve.kv_transfer.nixl.bidirectional import (
    PrefillPace,
    PULL_SAFETY_MARGIN_S,
    decoder_hold_blocks,
    plan_pull,
    pull_prefix_tokens,
)
from pdserve.kv_transfer.nixl.metadata import (
    NixlConnectorMetadata, PullClaim, RecvSpec, RemoteNotice, SendSpec)
from pdserve.types.remote_ref import PackedTokens, RemoteKVRef, token_digest
from pdserve.types.kv_params import (KVRole, may_use_first_token, prefill_done_params,
                                     with_prompt_handoff)

if TYPE_CHECKING:
    from pdserve.types.outputs import KVConnectorOutput, SchedulerOutput
    from pdserve.types.request import Request

logger = logging.getLogger(__name__)

# Finishes after which blocks are held for a remote reader (not aborts or errors).
_NORMAL_FINISH = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH)


class LoadKind(enum.Enum):
    """Whose KV a request's remote reference names."""

    PREFILL = "prefill"  # D reads P's prompt KV
    PULL = "pull"  # P reads back the KV of the previous turn from D


@dataclass
class _LoadPlan:
    """What :meth:`get_num_new_matched_tokens` offered, until the blocks are allocated."""

    kind: LoadKind
    remote: RemoteKVRef | None
    num_local_tokens: int
    num_tokens: int
    error: str | None = None


class NixlConnectorScheduler(KVConnectorSchedulerSide):
    """NIXL scheduler side (see the module docstring).

    Args:
        config: the validated transfer configuration.
        block_size: tokens per KV cache block (the engine's ``block_size``).
        data_parallel_rank: selects the side-channel port advertised to readers.
        tp_size: the instance's TP size, returned to readers as ``tp_size`` (their handshake
            with rank 0 learns it too).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, data_parallel_rank: int = 0,
                 tp_size: int = 1):
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.config = config
        self.block_size = block_size
        self.tp_size = tp_size
        self.engine_id = config.engine_id
        self.side_channel_host = config.side_channel_host
        self.side_channel_port = config.side_channel_port_for(data_parallel_rank)
        self._plans: dict[str, _LoadPlan] = {}
        self._waiting: dict[str, RemoteKVRef] = {}  # remote known, blocks not allocated yet
        self._inflight: dict[str, LoadKind] = {}  # request_id -> kind, load handed to the worker
        self._aborted_inflight: set[str] = set()  # finished while loading
        self._consumed: set[str] = set()  # remote KV already used or declined
        self._from_prefiller: set[str] = set()  # decoder requests of a P/D flow
        self._pulls: set[str] = set()  # prefiller requests that pull the decoder's KV
        # arrived pulls -> their hash-verified prefix of D's turn, computed for the early claim
        self._pull_prefix: dict[str, int] = {}
        # remote clock minus local clock per remote endpoint key, from the worker's handshakes
        self._clock_offsets: dict[tuple[str, str, int], float] = {}
        self._held: set[str] = set()  # blocks held for a remote reader
        self._turns: dict[str, None] = {}  # decoder turn leases, oldest first
        self._pace = PrefillPace(config.kv_pull_wait_factor)  # P's prefills, for pull waits
        self._meta = NixlConnectorMetadata()

    # ------------------------------------------------------------------------------- params
    def _source(self, request: "Request") -> tuple[LoadKind | None, RemoteKVRef | None, str | None]:
        """``(kind, remote, error)`` of the remote KV a request's params point at.

        ``kind`` is a :class:`LoadKind` or None (nothing to load). ``error`` is set
        when the params name remote KV but are malformed.
        """
        params = request.kv_transfer_params
        if params is None or request.request_id in self._consumed:
            return None, None, None
        if params.role is KVRole.DECODE:
            return LoadKind.PREFILL, params.remote, params.remote_error
        if self.config.bidirectional_kv_xfer and params.pulls_decoder_kv:
            return LoadKind.PULL, params.remote, None
        return None, None, None

    def _start_waiting(self, request_id: str, ref: RemoteKVRef, heartbeat: bool) -> None:
        self._waiting[request_id] = ref
        if heartbeat:
            self._meta.heartbeat_start[request_id] = ref
        self._meta.handshakes.append(ref.endpoint)

    def _decline(self, request_id: str, ref: RemoteKVRef | None) -> None:
        """The remote KV will not be read: tell its owner to drop the blocks."""
        self._consumed.add(request_id)
        if ref is not None:
            self._meta.notices.append(RemoteNotice(ref, "abort", reader_request=request_id))
        if self._waiting.pop(request_id, None) is not None:
            self._meta.heartbeat_stop.add(request_id)

    # ------------------------------------------------------------------------------- arrivals
    def request_added(self, request: "Request") -> None:
        """A request entered the queue: start the handshake with the remote engine now, and
        (decoder side) the heartbeats that keep P's lease alive while the request waits."""
        kind, ref, _ = self._source(request)
        if ref is not None and request.request_id not in self._waiting:
            self._start_waiting(request.request_id, ref, heartbeat=kind is LoadKind.PREFILL)
            if kind is LoadKind.PULL and self.tp_size == 1:
                self._claim_pull_early(request, ref)

    def _claim_pull_early(self, request: "Request", ref: RemoteKVRef) -> None:
        """Claim D's held turn for the prompt's hash-verified prefix now (:mod:`.claims`): the
        pull reads at most that far (:func:`plan_pull`), so its claim is this one when it
        comes. The prefix, not the turn's end: a prompt whose tail differs from D's tokens
        (the answer tokenized differently in the next turn's chat) would be refused."""
        if ref.endpoint.engine_id == self.engine_id:
            return
        prompt = request.prompt_token_ids
        matched = pull_prefix_tokens(prompt, self.block_size, ref)
        self._pull_prefix[request.request_id] = matched
        end = min(matched, len(prompt) - 1)
        if end > 0:
            self._meta.pull_claims[request.request_id] = PullClaim(
                ref, end, token_digest(prompt[:end]))

    # ---------------------------------------------------------------------------- the contract
    def get_num_new_matched_tokens(
        self, request: "Request", num_computed_tokens: int
    ) -> tuple[int, bool]:
        """Tokens beyond the local prefix-cache hit that can be loaded from another instance.

        Decoder: ``prompt_len - 1 - num_computed_tokens`` (the last prompt token is recomputed
        for its logits), or ``prompt_len - num_computed_tokens`` when the prefiller's first
        token can be used (:func:`may_use_first_token`). Bad params are not silently ignored:
        the load is planned and reported as failed, so ``kv_load_failure_policy`` applies.

        Prefiller (bidirectional): the hash-verified prefix of D's previous-turn KV beyond the
        local hit, or 0 when below ``kv_recompute_threshold``, expiring, or malformed.
        """
        kind, ref, error = self._source(request)
        if kind is None:
            return 0, False
        if kind is LoadKind.PULL:
            return self._plan_pull(request, num_computed_tokens, ref, error)
        request_id = request.request_id
        self._from_prefiller.add(request_id)
        prompt_len = len(request.prompt_token_ids)
        # With the prefiller's first token the whole prompt is read; otherwise the last prompt
        # token is recomputed for its logits.
        needed_tokens = prompt_len if may_use_first_token(request) else prompt_len - 1
        num_tokens = needed_tokens - num_computed_tokens
        if num_tokens <= 0:
            # nothing to read (one-token prompt, or the local prefix cache has it all)
            self._decline(request_id, ref)
            return 0, False
        if ref is not None:
            needed = math.ceil(needed_tokens / self.block_size)
            if len(ref.block_ids) < needed and not ref.pending:
                error = (
                    f"kv_transfer_params.remote_block_ids has {len(ref.block_ids)} blocks but "
                    f"the prompt needs {needed}"
                )
            if request_id not in self._waiting:
                self._start_waiting(request_id, ref, heartbeat=True)
        self._plans[request_id] = _LoadPlan(LoadKind.PREFILL, ref, num_computed_tokens, num_tokens, error)
        return num_tokens, True

    def _plan_pull(self, request: "Request", num_local: int, ref: RemoteKVRef | None,
                   error: str | None) -> tuple[int, bool]:
        request_id = request.request_id
        offset = self._clock_offsets.get(ref.endpoint.key) if ref is not None else None
        decision = plan_pull(
            request.kv_transfer_params, request.prompt_token_ids, num_local, self.block_size,
            self.config.kv_recompute_threshold, self.engine_id, clock_offset_s=offset,
            matched=self._pull_prefix.pop(request_id, None),
        )
        if decision.num_tokens <= 0:
            logger.info("request %s: not pulling the decoder's KV (%s); recomputing", request_id,
                        decision.reason)
            self._decline(request_id, decision.ref)
            if decision.expired:
                self._meta.expired_pulls += 1
            return 0, False
        if request_id not in self._waiting:
            self._start_waiting(request_id, decision.ref, heartbeat=False)
        self._pulls.add(request_id)
        self._plans[request_id] = _LoadPlan(LoadKind.PULL, decision.ref, num_local, decision.num_tokens)
        return decision.num_tokens, True

    def update_state_after_alloc(
        self, request: "Request", block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Hand the load to the worker: local blocks ``first..last`` (token positions
        ``num_local .. num_local + num_external_tokens - 1``) <- the same remote blocks.

        Args:
            block_ids: the request's whole block table after allocation (also accepted: only
                the blocks that will receive the loaded tokens).
        """
        request_id = request.request_id
        plan = self._plans.pop(request_id, None)
        if plan is None:
            params = request.kv_transfer_params  # a P leg loading nothing: time its prefill
            if params is not None and params.role is KVRole.PREFILL:
                self._pace.started(request_id, time.monotonic())
            return
        ref = plan.remote
        if num_external_tokens <= 0:
            self._decline(request_id, ref)
            return
        bs = self.block_size
        first = plan.num_local_tokens // bs
        last = (plan.num_local_tokens + num_external_tokens - 1) // bs
        error = plan.error
        if len(block_ids) > last:
            local = list(block_ids[first : last + 1])
        elif len(block_ids) == last - first + 1:
            local = list(block_ids)
        else:
            local = []
            error = error or (
                f"{len(block_ids)} allocated blocks cannot hold tokens up to position "
                f"{plan.num_local_tokens + num_external_tokens - 1}"
            )
        # a pending reference's blocks are named by the owner's claim answer (the worker
        # reads them from block ``first`` on)
        remote_ids = list(ref.block_ids[first : last + 1]) if ref is not None else []
        if ref is not None and not ref.pending and len(remote_ids) != len(local) \
                and error is None:
            error = "remote_block_ids is too short for the prompt"
        end = plan.num_local_tokens + num_external_tokens  # the owner checks tokens 0..end-1
        starts = (plan.kind is LoadKind.PREFILL and end >= request.num_tokens
                  and may_use_first_token(request))
        self._meta.reqs_to_recv[request_id] = RecvSpec(
            request_id=request_id,
            remote=ref,
            local_block_ids=local,
            remote_read_block_ids=remote_ids,
            num_tokens=num_external_tokens,
            error=error,
            min_lease_left_s=PULL_SAFETY_MARGIN_S if plan.kind is LoadKind.PULL else 0.0,
            digest_tokens=end,
            token_digest=token_digest(request.token_ids(0, end)),
            first_token=request.kv_transfer_params.first_token if starts else None,
            starts_with_first_token=starts,
            remote_first_block=first,
            claim_wait_s=self._pace.claim_wait_s(num_external_tokens)
            if plan.kind is LoadKind.PULL else 0.0,
        )
        self._waiting.pop(request_id, None)
        self._inflight[request_id] = plan.kind
        self._consumed.add(request_id)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> NixlConnectorMetadata:
        meta, self._meta = self._meta, NixlConnectorMetadata()
        return meta

    def take_early_metadata(self) -> NixlConnectorMetadata | None:
        """The holds of finished requests and the early pull claims, taken out of the next
        step's metadata (:meth:`KVConnectorSchedulerSide.take_early_metadata`)."""
        meta = self._meta
        if not meta.reqs_to_send and not meta.pull_claims:
            return None
        early = NixlConnectorMetadata(reqs_to_send=meta.reqs_to_send, pull_claims=meta.pull_claims)
        meta.reqs_to_send, meta.pull_claims = {}, {}
        return early

    def update_connector_output(self, output: "KVConnectorOutput") -> None:
        for request_id in output.finished_recving:
            self._inflight.pop(request_id, None)
            self._aborted_inflight.discard(request_id)
        for request_id in output.finished_sending:
            self._held.discard(request_id)
            self._turns.pop(request_id, None)
        # measured by the worker at handshakes (for the expiry checks of bidirectional pulls)
        self._clock_offsets.update(output.remote_clock_offsets)

    def load_failure_policy(self, request: "Request") -> KVLoadFailurePolicy | None:
        """``RECOMPUTE`` for a failed pull of the decoder's KV (it must never fail the user's
        request); None (the configured policy) otherwise."""
        return KVLoadFailurePolicy.RECOMPUTE if request.request_id in self._pulls else None

    def request_finished(
        self, request: "Request", block_ids: list[int]
    ) -> FinishedRequestKV:
        """Decide whether the finished request's blocks stay allocated, and what to return.

        Returns:
            ``FinishedRequestKV(True, params)`` when the blocks are held for a remote reader: on a prefiller for
            a normally finished ``do_remote_decode`` request, and (bidirectional) on a decoder
            for a normally finished turn whose prompt came from a prefiller. :data:`NOT_HELD`
            otherwise. A request finished while its load is in flight is reported in
            ``finished_recving`` once no READ writes its blocks; the scheduler holds the blocks
            until then.
        """
        request_id = request.request_id
        self._plans.pop(request_id, None)
        from_prefiller = request_id in self._from_prefiller
        self._from_prefiller.discard(request_id)
        self._pulls.discard(request_id)
        self._pull_prefix.pop(request_id, None)
        # --- reader side: the request ends before or during its load
        if request_id in self._inflight:
            self._inflight.pop(request_id)
            self._aborted_inflight.add(request_id)
            self._meta.aborted_recvs.add(request_id)
            self._consumed.discard(request_id)
            return NOT_HELD
        kind, ref, _ = self._source(request)
        waiting_ref = self._waiting.pop(request_id, None)
        if waiting_ref is not None:
            self._meta.heartbeat_stop.add(request_id)
            ref = waiting_ref
        self._consumed.discard(request_id)
        if ref is not None and (kind is not None or waiting_ref is not None):
            self._meta.notices.append(RemoteNotice(ref, "abort", reader_request=request_id))
        normal = request.status in _NORMAL_FINISH
        computed = request.num_prompt_tokens - max(request.num_cached_tokens, 0)
        self._pace.finished(request_id, computed, time.monotonic(), normal)
        params = request.kv_transfer_params
        # --- owner side: hold the prompt's blocks for the decoder
        if normal and params is not None and params.role is KVRole.PREFILL:
            return self._hold_for_decoder(request, block_ids)
        # --- decoder side, multi-turn: hold the turn's blocks for the next prefill
        if normal and self.config.bidirectional_kv_xfer and (
                from_prefiller or (params is not None and not params.is_empty)):
            return self._hold_for_next_turn(request, block_ids)
        return NOT_HELD

    def release_held_blocks(self, request_id: str) -> None:
        """The front end aborted a finished prefill whose blocks are leased (its client left
        before getting the params): the worker ends the lease now (``release_sends``)."""
        if request_id in self._held:
            self._meta.release_sends.add(request_id)

    def release_early(self, request_id: str, block_ids: list[int]) -> None:
        """The proxy's early release (the decode leg will not read the blocks): the worker
        ends the lease when it holds exactly ``block_ids`` for ``request_id``
        (``early_releases``; :mod:`pdserve.kv_transfer.nixl.release`)."""
        self._meta.early_releases[request_id] = list(block_ids)

    def _hold_for_decoder(self, request: "Request", block_ids: list[int]) -> FinishedRequestKV:
        request_id = request.request_id
        prompt_len = len(request.prompt_token_ids)
        remote_ids = list(block_ids[: math.ceil(prompt_len / self.block_size)])
        if not remote_ids or len(remote_ids) * self.block_size < prompt_len:
            return NOT_HELD
        # the decoder may emit it without recomputing the last prompt token
        first = request.output_token_ids[0] if request.output_token_ids else None
        transfer_id = request.kv_transfer_params.transfer_id
        self._meta.reqs_to_send[request_id] = SendSpec(  # renewed by heartbeats (the default)
            request_id, remote_ids, self.config.kv_lease_duration, first_token=first,
            tokens=PackedTokens.of(request.prompt_token_ids), transfer_id=transfer_id)
        self._held.add(request_id)
        params = prefill_done_params(self.engine_id, remote_ids, self.side_channel_host,
                                     self.side_channel_port, request_id, first, self.tp_size)
        if transfer_id is not None:  # its decoder tokenized the prompt while P prefilled
            return FinishedRequestKV(True, params)
        return FinishedRequestKV(True, with_prompt_handoff(
            params, list(request.prompt_token_ids), request.kv_transfer_params.prompt_digest))

    def _hold_for_next_turn(self, request: "Request", block_ids: list[int]) -> FinishedRequestKV:
        held = decoder_hold_blocks(
            request, block_ids, self.block_size, self.config.decoder_kv_blocks_ttl,
            self.engine_id, self.side_channel_host, self.side_channel_port, tp_size=self.tp_size,
        )
        if held is None:
            return NOT_HELD
        spec, params = held
        self._meta.reqs_to_send[spec.request_id] = spec
        self._held.add(spec.request_id)
        self._turns[spec.request_id] = None
        return FinishedRequestKV(True, params)

    def turn_leases(self) -> list[str]:
        """The decoder's turn leases, oldest first (at TP > 1 the executor merges the ranks'
        answers to their moves, :mod:`pdserve.executor.kv_merge`)."""
        return list(self._turns)

    def move_turn(self, request_id: str, move: TurnMove, block_ids: list[int] = ()) -> None:
        """Hand a turn lease's move to the worker side of every rank (``demote_turns``,
        ``keep_turns``, ``restored_turns``, ``serve_turns``, ``lost_turns`` of the next
        metadata; ``SERVE`` only at TP > 1: one rank serves a restore when it takes it)."""
        if move is TurnMove.DEMOTE:
            self._meta.demote_turns.add(request_id)
        elif move is TurnMove.KEEP:
            self._meta.keep_turns.add(request_id)
        elif move is TurnMove.RESTORED:
            self._meta.restored_turns[request_id] = list(block_ids)
        elif move is TurnMove.SERVE:
            if self.tp_size > 1:
                self._meta.serve_turns.add(request_id)
        else:
            self._meta.lost_turns.add(request_id)

    def has_pending_metadata(self) -> bool:
        """True when metadata for the worker side is waiting for the next step (the engine
        loop then steps at once instead of waiting for input)."""
        return not self._meta.is_empty()

    def has_pending_work(self) -> bool:
        """True while loads, leases, waiting (heartbeated) requests or undelivered metadata
        need engine steps."""
        return bool(
            self._waiting or self._inflight or self._held or self._aborted_inflight
            or not self._meta.is_empty()
        )
