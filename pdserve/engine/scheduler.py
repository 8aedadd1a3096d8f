"""Continuous-batching scheduler with chunked prefill, preemption by recompute, and KV connector
hooks. Pure bookkeeping: no torch.

One step (see :mod:`pdserve.engine.outputs`)::

    sched_out = scheduler.schedule()
    runner_out = runner.execute(sched_out)
    outputs = scheduler.update_from_output(sched_out, runner_out)

Policy (after vLLM's v1 scheduler, which treats prefill and decode uniformly as "tokens to
compute" under one token budget):

1. Running requests first, decodes before unfinished chunked prefills, each taking
   ``num_tokens - num_computed_tokens`` tokens capped by the remaining budget
   (``max_num_batched_tokens``). When blocks run out, the most recently arrived running request
   that is not yet scheduled this step is preempted: its blocks are freed, its computed tokens
   forgotten, and it goes back to the FRONT of the waiting queue to be recomputed later (prompt
   and generated tokens, with whatever the prefix cache still holds).
2. Then, if nothing was preempted, waiting requests in FCFS order while fewer than
   ``max_num_seqs`` run and budget remains: local prefix-cache hit, then the KV connector's
   external hit; a request whose KV loads asynchronously gets blocks for local + external
   tokens and parks in ``WAITING_FOR_REMOTE_KVS`` (not counted in ``max_num_seqs``).

Computed tokens are committed (``num_computed_tokens`` advanced, full blocks registered in the
prefix cache) in :meth:`Scheduler.update_from_output`, after their KV exists.

KV connector (``pdserve.kv_transfer.base``), as this scheduler drives it:

* ``request_added`` when a request is queued; ``get_num_new_matched_tokens`` once per request,
  after its local prefix-cache hit (again only if the allocation that follows fails);
  ``update_state_after_alloc`` with the whole block table once blocks are allocated.
* A load reported in ``finished_recving`` marks ``min(local + external, num_tokens - 1)`` tokens
  computed, so at least the last prompt token is recomputed for its logits; except when the
  prefiller's first token can be used (``kv_transfer.base.presampled_first_token``): then the
  connector loads the whole prompt and that token is emitted at once, without a forward pass.
* ``invalid_block_ids`` of a pending load apply ``kv_load_failure_policy`` when the load is
  reported finished: ``fail`` ends the request with ``finish_reason="error"``, ``recompute``
  rolls ``num_computed_tokens`` back to the first invalid block.
* ``request_finished`` is called exactly once per request (finish, abort, error). With
  ``delay_free`` the blocks stay until the id appears in ``finished_sending``. A request
  finished while its load is in flight (``WAITING_FOR_REMOTE_KVS``) keeps its blocks until the
  id appears in ``finished_recving``, so no transfer writes into blocks reused by others.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.outputs import (
    EngineCoreOutput,
    KVConnectorOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from pdserve.engine.request import Request, RequestStatus
from pdserve.kv_transfer.base import KVLoadError, presampled_first_token

if TYPE_CHECKING:
    from pdserve.config import EngineConfig
    from pdserve.kv_transfer.base import KVConnectorSchedulerSide

logger = logging.getLogger(__name__)

KV_LOAD_FAILURE_POLICIES = ("fail", "recompute")


class _Held:
    """A finished request whose blocks must outlive it (KV being read by another instance, or a
    load into its blocks still in flight)."""

    __slots__ = ("request", "until_sent", "until_recved")

    def __init__(self, request: Request, until_sent: bool, until_recved: bool):
        self.request = request
        self.until_sent = until_sent
        self.until_recved = until_recved


class Scheduler:
    """Decides, each step, which tokens of which requests the model runner computes.

    Args:
        config: engine configuration; reads ``block_size``, ``enable_prefix_caching``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``max_model_len`` (tokens; capped at
            the KV cache capacity ``num_blocks * block_size`` so one request always fits; None:
            that capacity) and ``kv_transfer_config.kv_load_failure_policy`` (``fail`` when
            absent).

    Raises:
        ValueError: non-positive limits or an unknown ``kv_load_failure_policy``.
        num_blocks: KV cache blocks available.
        connector: the KV connector's scheduler side, or None.
        eos_token_ids: every token id that means end of sequence (in addition to each request's
            ``eos_token_id``).
    """

    def __init__(
        self,
        config: "EngineConfig",
        num_blocks: int,
        connector: "KVConnectorSchedulerSide | None" = None,
        eos_token_ids: Iterable[int] = (),
    ):
        self.config = config
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        # A request can never need more tokens of KV than the whole cache holds.
        capacity = num_blocks * config.block_size
        self.max_model_len = min(config.max_model_len or capacity, capacity)
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be at least 1")
        self.num_scheduler_steps = getattr(config, "num_scheduler_steps", 1)
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be at least 1")
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.connector = connector
        policy = getattr(config.kv_transfer_config, "kv_load_failure_policy", "fail") or "fail"
        if policy not in KV_LOAD_FAILURE_POLICIES:
            raise ValueError(
                f"kv_load_failure_policy must be one of {KV_LOAD_FAILURE_POLICIES}, got {policy!r}"
            )
        self.kv_load_failure_policy = policy
        self.eos_token_ids = frozenset(eos_token_ids)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        # rid -> (num_local_tokens, num_external_tokens) while the external KV loads.
        self._pending_load: dict[str, tuple[int, int]] = {}
        # rid -> first invalid block index reported for a pending load.
        self._failed_load: dict[str, int] = {}
        # requests whose connector lookup already happened (never ask twice).
        self._connector_consulted: set[str] = set()
        # rid -> (num_local, num_external) for synchronous loads happening in the current step.
        self._sync_loads: dict[str, tuple[int, int]] = {}
        self._held: dict[str, _Held] = {}
        self.finished_req_ids: set[str] = set()
        self._pending_outputs: list[EngineCoreOutput] = []

        self.prompt_tokens_total = 0
        self.prompt_tokens_computed_total = 0
        self.prompt_tokens_cached_total = 0
        self.prompt_tokens_transferred_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
        self.num_kv_load_failures_total = 0
        self.num_requests_finished_total = 0

    # ================================================================ requests in
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: duplicate id, empty prompt, prompt longer than ``max_model_len``, or a
                prompt that cannot fit in the whole KV cache.
        """
        rid = request.request_id
        if rid in self.requests or rid in self._held:
            raise ValueError(f"request id {rid!r} is already in use")
        n = request.num_prompt_tokens
        if n == 0:
            raise ValueError("the prompt must contain at least one token")
        if n > self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
            )
        capacity = self.kv_cache_manager.num_blocks * self.block_size
        if n > capacity:
            raise ValueError(f"prompt has {n} tokens but the KV cache holds only {capacity}")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)
        self.prompt_tokens_total += n
        if self.connector is not None:
            self.connector.request_added(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests in any state; unknown or already finished ids are ignored. Their blocks
        are freed (or kept while the connector still needs them) and the connector is told."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[rid]
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    # ================================================================ scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring for the policy), or a multi-step
        decode round (:meth:`_schedule_multi_step`) when ``num_scheduler_steps > 1`` allows."""
        if self.num_scheduler_steps > 1:
            multi = self._schedule_multi_step()
            if multi is not None:
                return multi
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self._sync_loads = {}
        scheduled_ids: set[str] = set()
        preempted = False

        # 1. running requests: decodes first, then continuing chunked prefills.
        decodes = [r for r in self.running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefills = [r for r in self.running if r.num_computed_tokens < r.num_prompt_tokens]
        for req in decodes + prefills:
            if budget <= 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while True:
                if self.kv_cache_manager.allocate_slots(req, num_new) is not None:
                    break
                victim = self._pick_victim(scheduled_ids)
                preempted = True
                if victim is None or victim is req:
                    self._preempt(req)
                    break
                self._preempt(victim)
            if req.status != RequestStatus.RUNNING:
                continue
            self._add_scheduled(out, req, num_new)
            scheduled_ids.add(req.request_id)
            budget -= num_new

        # 2. waiting requests (only when nothing had to be preempted this step).
        # Once a request is blocked on free blocks, later requests that need no prefix lookup
        # because they already hold their blocks (KV loaded from elsewhere) may still go ahead:
        # otherwise they could hold the very blocks the blocked request waits for.
        skipped: list[Request] = []
        blocked = False
        while self.waiting and not preempted and budget > 0:
            if len(self.running) >= self.max_num_seqs:
                break
            if blocked and not any(r.block_ids for r in self.waiting):
                break
            req = self.waiting.popleft()
            if blocked and not req.block_ids:
                skipped.append(req)
                continue
            status = self._try_schedule_waiting(req, out, budget)
            if status == "scheduled":
                budget -= len(out.scheduled[-1].token_ids)
            elif status in ("skip", "blocked"):
                blocked = blocked or status == "blocked"
                skipped.append(req)
        self.waiting.extendleft(reversed(skipped))

        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        return self._close_step(out)

    def _schedule_multi_step(self) -> SchedulerOutput | None:
        """A round of up to ``num_scheduler_steps`` decode steps for every running request, or
        None when this step must be scheduled normally.

        Only when every running request is a plain decode (one token to compute, nothing
        waiting that could be admitted, no KV transfer or lease pending, and no request whose
        next tokens depend on host-side state: penalties, logprobs, ``min_tokens`` not yet
        reached). The round is shortened so that no position passes ``max_model_len``; each
        request gets blocks for all its tokens up front (none are preempted for this: if the
        blocks are short, the step is scheduled normally). A request that stops inside the
        round keeps only the tokens up to its stop (see :meth:`update_from_output`); the rest
        of its round was wasted GPU work.
        """
        running = self.running
        if not running or len(running) > self.max_num_batched_tokens:
            return None
        if self.waiting and len(running) < self.max_num_seqs:
            return None
        if self.waiting_for_remote or self.has_pending_kv_work():
            return None
        steps = self.num_scheduler_steps
        for req in running:
            if req.num_computed_tokens != req.num_tokens - 1 or req.num_computed_tokens < req.num_prompt_tokens:
                return None
            sp = req.sampling_params
            if (sp.logprobs is not None or sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
                    or sp.frequency_penalty != 0.0 or req.num_output_tokens < sp.min_tokens):
                return None
            steps = min(steps, self.max_model_len - req.num_computed_tokens)
        if steps <= 1:
            return None
        kvm = self.kv_cache_manager
        for req in running:
            if kvm.allocate_slots(req, steps) is None:
                return None  # blocks given to earlier requests stay theirs, for later steps
        out = SchedulerOutput(num_steps=steps)
        for req in running:
            self._add_scheduled(out, req, 1)
        out.total_num_scheduled_tokens = len(running) * steps
        return self._close_step(out)

    def _close_step(self, out: SchedulerOutput) -> SchedulerOutput:
        """Hand the requests finished since the last step to ``out`` and let the connector
        build its metadata for the step."""
        out.finished_req_ids = self.finished_req_ids
        self.finished_req_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def _try_schedule_waiting(self, req: Request, out: SchedulerOutput, budget: int) -> str:
        """Schedule one waiting request.

        Returns:
            ``"scheduled"`` (now running, in ``out``), ``"remote"`` (parked in
            WAITING_FOR_REMOTE_KVS), ``"skip"`` (nothing to do now) or ``"blocked"`` (not enough
            free blocks: stop scheduling waiting requests this step).
        """
        kvm = self.kv_cache_manager
        rid = req.request_id
        computed_blocks: list[int] = []
        num_local = 0
        num_external = 0
        load_async = False
        fresh = not req.block_ids and req.num_computed_tokens == 0
        if fresh:
            computed_blocks, num_local = kvm.get_computed_blocks(req)
            if self.connector is not None and rid not in self._connector_consulted:
                num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                num_external = max(0, min(num_external, req.num_tokens - num_local))
                if num_external == 0:
                    load_async = False

        if load_async:
            new_blocks = kvm.allocate_slots(req, num_external, computed_blocks)
            if new_blocks is None:
                return "blocked"
            self._connector_consulted.add(rid)
            req.num_computed_tokens = num_local
            self._record_cached(req, num_local)
            self.connector.update_state_after_alloc(req, list(req.block_ids), num_external)
            req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self.waiting_for_remote[rid] = req
            self._pending_load[rid] = (num_local, num_external)
            return "remote"

        # Tokens whose KV will exist before this step's forward pass (cache hit + sync load);
        # at least one token is always computed, for the logits.
        start = min(num_local + num_external, req.num_tokens - 1) if fresh else req.num_computed_tokens
        num_new = min(req.num_tokens - start, budget)
        if num_new <= 0:
            return "skip"
        room = (start - num_local + num_new) if fresh else num_new
        if kvm.allocate_slots(req, room, computed_blocks) is None:
            return "blocked"
        if fresh:
            if self.connector is not None and rid not in self._connector_consulted:
                self._connector_consulted.add(rid)
                self.connector.update_state_after_alloc(req, list(req.block_ids), num_external)
            self._record_cached(req, num_local)
            if start > num_local:
                self._sync_loads[rid] = (num_local, start - num_local)
            req.num_computed_tokens = start
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._add_scheduled(out, req, num_new)
        return "scheduled"

    def _record_cached(self, req: Request, num_local: int) -> None:
        if req.num_cached_tokens < 0:  # first scheduling only
            req.num_cached_tokens = num_local
            self.prompt_tokens_cached_total += min(num_local, req.num_prompt_tokens)

    def _add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        start = req.num_computed_tokens
        end = start + num_new
        if start >= req.num_prompt_tokens:
            token_ids = req.output_token_ids[start - req.num_prompt_tokens : end - req.num_prompt_tokens]
        else:
            token_ids = req.all_token_ids[start:end]
        out.scheduled.append(
            ScheduledRequest(
                req_id=req.request_id,
                token_ids=token_ids,
                num_computed_tokens=start,
                block_ids=req.block_ids,
                sample=end == req.num_tokens,
                sampling_params=req.sampling_params,
                prompt_token_ids=req.prompt_token_ids,
                output_token_ids=req.output_token_ids,
                eos_token_id=req.eos_token_id,
            )
        )

    def _pick_victim(self, scheduled_ids: set[str]) -> Request | None:
        """The running request not yet scheduled this step that arrived last."""
        candidates = [r for r in self.running if r.request_id not in scheduled_ids]
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.arrival_time)

    def _preempt(self, req: Request) -> None:
        """Free the request's blocks and queue it for recomputation at the waiting front."""
        self.running.remove(req)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        logger.debug("preempted request %s (%d tokens)", req.request_id, req.num_tokens)

    # ================================================================ results
    def update_from_output(
        self, sched: SchedulerOutput, out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Commit a step: advance computed tokens, append sampled tokens, apply stop
        conditions, and consume the connector's report.

        Returns:
            One :class:`EngineCoreOutput` per request that produced a token or finished (plus
            requests failed by a KV load), in batch order.
        """
        outputs = self._pending_outputs
        self._pending_outputs = []
        kv_out = out.kv_connector_output
        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        kvm = self.kv_cache_manager

        for sr in sched.scheduled:
            req = self.requests.get(sr.req_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted after scheduling
            if invalid and sr.req_id in self._sync_loads:
                bad = self._first_invalid_block(req, self._sync_loads[sr.req_id], invalid)
                if bad is not None:
                    # The forward pass read missing KV: its token is worthless.
                    outputs.extend(self._apply_load_failure(req, bad, self._sync_loads[sr.req_id][0],
                                                            kv_out.load_errors.get(sr.req_id)))
                    continue
            if sched.num_steps > 1:
                outputs.append(self._commit_multi_step(req, out.sampled_token_id_lists.get(sr.req_id)))
                continue
            num_new = len(sr.token_ids)
            start = req.num_computed_tokens
            req.num_computed_tokens = start + num_new
            if start < req.num_prompt_tokens:
                self.prompt_tokens_computed_total += min(req.num_computed_tokens, req.num_prompt_tokens) - start
            if sr.req_id in self._sync_loads:
                num_local, num_ext = self._sync_loads[sr.req_id]
                req.num_transferred_tokens = num_ext
                self.prompt_tokens_transferred_total += min(num_ext, req.num_prompt_tokens - num_local)
            kvm.cache_blocks(req, req.num_computed_tokens)
            if not sr.sample:
                continue
            token = out.sampled_token_ids.get(sr.req_id)
            if token is None:
                self.running.remove(req)
                outputs.append(
                    self._finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
                )
                continue
            outputs.append(self._append_token(req, token, out.logprobs.get(sr.req_id)))
        self._sync_loads = {}

        if kv_out is not None:
            if self.connector is not None:
                self.connector.update_connector_output(kv_out)
            outputs.extend(self._process_kv_output(kv_out, invalid))
        return outputs

    def _commit_multi_step(self, req: Request, tokens: list[int] | None) -> EngineCoreOutput:
        """Commit a multi-step round of one request: its tokens in order up to the first that
        stops it; every kept token but a final stopping one had its KV computed."""
        if not tokens:
            self.running.remove(req)
            return self._finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
        kept: list[int] = []
        for token in tokens:
            req.num_computed_tokens += 1
            kept.append(token)
            status, stop_reason = self._accept_token(req, token)
            if status is not None:
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
                return self._finish_with_tokens(req, status, stop_reason, kept, [])
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        return self._output(req, kept, None)

    def _append_token(self, req: Request, token: int, logprobs: Any) -> EngineCoreOutput:
        status, stop_reason = self._accept_token(req, token)
        if status is None:
            return self._output(req, [token], logprobs)
        return self._finish_with_tokens(req, status, stop_reason, [token],
                                        [logprobs] if logprobs is not None else [])

    def _accept_token(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Append a sampled token; returns ``(finish status or None, stop token or None)``."""
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.generation_tokens_total += 1
        sp = req.sampling_params
        n_out = req.num_output_tokens
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and (token == req.eos_token_id or token in self.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if n_out >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def _finish_with_tokens(self, req: Request, status: RequestStatus, stop_reason: int | None,
                            tokens: list[int], logprobs: list[Any]) -> EngineCoreOutput:
        """Finish a request whose last ``tokens`` were just accepted (it leaves ``running``
        when it was there: a decoder's request may finish on the prefiller's first token
        before it ever ran)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        o = self._finish(req, status)
        o.new_token_ids = tokens
        o.new_logprobs = logprobs
        o.stop_reason = stop_reason
        return o

    def _output(self, req: Request, tokens: list[int], logprobs: Any) -> EngineCoreOutput:
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_transferred_tokens=req.num_transferred_tokens,
        )

    def _finish(
        self, req: Request, status: RequestStatus, error: str | None = None
    ) -> EngineCoreOutput:
        """Mark a request finished (already removed from the running/waiting structures),
        tell the connector, free or hold its blocks. Returns its final output (no tokens)."""
        rid = req.request_id
        was_loading = rid in self._pending_load
        req.status = status
        req.error = error
        self.requests.pop(rid, None)
        self._pending_load.pop(rid, None)
        self._failed_load.pop(rid, None)
        self._connector_consulted.discard(rid)
        self.finished_req_ids.add(rid)
        self.num_requests_finished_total += 1
        delay_free, params = False, None
        if self.connector is not None:
            delay_free, params = self.connector.request_finished(req, list(req.block_ids))
        if (delay_free or was_loading) and req.block_ids:
            self._held[rid] = _Held(req, until_sent=bool(delay_free), until_recved=was_loading)
        else:
            self.kv_cache_manager.free(req)
        o = self._output(req, [], None)
        o.finish_reason = status.finish_reason
        o.kv_transfer_params = params
        o.error = error
        return o

    # ---------------------------------------------------------------- connector
    def _first_invalid_block(
        self, req: Request, load: tuple[int, int], invalid: set[int]
    ) -> int | None:
        """Index in the block table of the first invalid block among the loaded ones."""
        num_local, num_ext = load
        first = num_local // self.block_size
        last = -(-(num_local + num_ext) // self.block_size)
        for i in range(first, min(last, len(req.block_ids))):
            if req.block_ids[i] in invalid:
                return i
        return None

    def _apply_load_failure(
        self, req: Request, bad_block: int, num_local: int, error: KVLoadError | None = None
    ) -> list[EngineCoreOutput]:
        """Apply ``kv_load_failure_policy`` to a request whose KV load left block index
        ``bad_block`` (and possibly later ones) invalid; ``error`` (the worker's reason) goes
        into the request's error message."""
        self.num_kv_load_failures_total += 1
        rid = req.request_id
        self.kv_cache_manager.uncache_blocks(req, bad_block)
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        hook = getattr(self.connector, "load_failure_policy", None)  # per-request override
        policy = hook(req) if hook is not None else None
        if (policy or self.kv_load_failure_policy) == "fail":
            logger.warning("request %s: KV load failed at block index %d; failing it", rid, bad_block)
            why = f": {error}" if error is not None else ""
            return [
                self._finish(
                    req,
                    RequestStatus.FINISHED_ERROR,
                    f"KV cache load from the remote instance failed{why} (block "
                    f"{req.block_ids[bad_block]} of request {rid}); kv_load_failure_policy is 'fail'",
                )
            ]
        good = max(num_local, bad_block * self.block_size)
        good = min(good, req.num_tokens - 1)
        logger.warning(
            "request %s: KV load failed at block index %d; recomputing from token %d", rid, bad_block, good
        )
        req.num_computed_tokens = good
        req.num_transferred_tokens = good - num_local
        self.prompt_tokens_transferred_total += min(good, req.num_prompt_tokens) - min(num_local, req.num_prompt_tokens)
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        return []

    def _process_kv_output(self, kv_out: KVConnectorOutput, invalid: set[int]) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        if invalid:
            for rid, load in self._pending_load.items():
                bad = self._first_invalid_block(self.waiting_for_remote[rid], load, invalid)
                if bad is not None:
                    prev = self._failed_load.get(rid)
                    self._failed_load[rid] = bad if prev is None else min(prev, bad)
        for rid in kv_out.finished_recving:
            held = self._held.get(rid)
            if held is not None:
                held.until_recved = False
                self._maybe_release(rid)
                continue
            req = self.waiting_for_remote.pop(rid, None)
            if req is None:
                continue
            num_local, num_ext = self._pending_load.pop(rid)
            bad = self._failed_load.pop(rid, None)
            if bad is not None:
                outputs.extend(self._apply_load_failure(req, bad, num_local, kv_out.load_errors.get(rid)))
                continue
            # The whole prompt arrives only with the prefiller's first token, which is then
            # emitted at once; otherwise the last prompt token is recomputed for its logits.
            first = presampled_first_token(req) if num_local + num_ext >= req.num_tokens else None
            loaded = min(num_local + num_ext, req.num_tokens - (first is None))
            req.num_computed_tokens = loaded
            req.num_transferred_tokens = loaded - num_local
            self.prompt_tokens_transferred_total += min(loaded, req.num_prompt_tokens) - min(num_local, req.num_prompt_tokens)
            self.kv_cache_manager.cache_blocks(req, loaded)
            if first is not None:
                outputs.append(self._append_token(req, first, None))
                if outputs[-1].finish_reason is not None:
                    continue
            req.status = RequestStatus.WAITING
            self.waiting.appendleft(req)
        for rid in kv_out.finished_sending:
            held = self._held.get(rid)
            if held is not None:
                held.until_sent = False
                self._maybe_release(rid)
        return outputs

    def _maybe_release(self, rid: str) -> None:
        held = self._held[rid]
        if not held.until_sent and not held.until_recved:
            del self._held[rid]
            self.kv_cache_manager.free(held.request)

    # ================================================================ status
    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs or waits for remote KV."""
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def has_pending_kv_work(self) -> bool:
        """True while the connector has transfers, notifications or leases to poll."""
        if self.connector is None:
            return False
        if self.waiting_for_remote or self._held:
            return True
        return bool(self.connector.has_pending_work())

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def stats(self) -> dict[str, Any]:
        """Snapshot for metrics: queue sizes, KV cache usage (0..1) and cumulative counters."""
        kvm = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_waiting_for_remote_kvs": len(self.waiting_for_remote),
            "num_held_for_transfer": len(self._held),
            "kv_cache_usage": kvm.usage,
            "num_blocks": kvm.num_blocks,
            "num_free_blocks": kvm.num_free_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "prompt_tokens_computed_total": self.prompt_tokens_computed_total,
            "prompt_tokens_cached_total": self.prompt_tokens_cached_total,
            "prompt_tokens_transferred_total": self.prompt_tokens_transferred_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions_total": self.num_preemptions_total,
            "num_kv_load_failures_total": self.num_kv_load_failures_total,
            "num_requests_finished_total": self.num_requests_finished_total,
            "prefix_cache_queries_total": kvm.prefix_cache_queries,
            "prefix_cache_hits_total": kvm.prefix_cache_hits,
        }

    def shutdown(self) -> None:
        if self.connector is not None:
            self.connector.shutdown()
