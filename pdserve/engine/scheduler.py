"""Continuous-batching scheduler with chunked prefill, preemption by recompute, and KV connector
hooks. Pure bookkeeping: no torch.

One step (see :mod:`pdserve.types.outputs`)::

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

With ``num_scheduler_steps > 1``, a step in which every running request is a plain decode and
nothing can be admitted is instead a round of several decode steps
(:meth:`pdserve.engine.multi_step.MultiStepRounds.schedule` says exactly when).

The scheduler composes helpers that own their state and get their collaborators (queues, the
:class:`~pdserve.engine.block_manager.KVCacheManager`, :class:`RemoteKV`, limits) in their
constructors: :class:`~pdserve.engine.running_batch.RunningBatch` (step 1),
:class:`~pdserve.engine.admission.Admitter` (step 2), ``MultiStepRounds``,
``AsyncSchedulingPolicy`` (step n+1 while step n runs), :class:`~pdserve.engine.remote_kv.RemoteKV`
(KV that crosses instances; its docstring says how the connector is driven) and, with KV cache
tiers (``--kv-offloading-size``), :class:`~pdserve.engine.kv_tiers.TierManager`,
:class:`~pdserve.engine.tier_loads.TierLoads` and
:class:`~pdserve.engine.turn_demotion.TurnDemoter`; their outcomes that move or finish a request
are applied here. Computed tokens are committed (``num_computed_tokens`` advanced, full blocks
registered in the prefix cache) in :meth:`Scheduler.commit_step`, after their KV exists; the
connector's and the tiers' reports in :meth:`Scheduler.apply_reports`.

The module is one class and stays whole (past 450 lines): it is where the helpers' outcomes
are applied to the queues, the blocks and the requests, so every method moves the same
requests between the same queues; a second class given part of that would reach into its
owner.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Iterable

from pdserve.engine.admission import Admitter
from pdserve.engine.async_scheduling import AsyncSchedulingPolicy
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.kv_tiers import TierManager
from pdserve.engine.multi_step import MultiStepRounds
from pdserve.engine.remote_kv import LoadOutcome, LoadResult, RemoteKV, parse_load_failure_policy
from pdserve.engine.request_queues import RequestQueues
from pdserve.engine.running_batch import RunningBatch
from pdserve.engine.tier_loads import TierLoads
from pdserve.engine.turn_demotion import TurnDemoter
from pdserve.engine.token_acceptor import TokenAcceptor
from pdserve.types.kv_tiers import KVTierReport
from pdserve.types.outputs import (EngineCoreOutput, KVConnectorOutput, ModelRunnerOutput,
                                   SchedulerOutput)
from pdserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.types.engine_config import EngineConfig
    from pdserve.kv_transfer.base import KVConnectorSchedulerSide

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which tokens of which requests the model runner computes.

    Args:
        config: engine configuration; reads ``block_size``, ``enable_prefix_caching``,
            ``prefix_cache_eviction``, ``max_num_batched_tokens``, ``max_num_seqs``,
            ``num_scheduler_steps``, ``max_model_len`` (tokens; capped at the KV cache capacity
            ``num_blocks * block_size`` so one request always fits; None: that capacity) and
            ``kv_transfer_config.kv_load_failure_policy`` (``FAIL`` when absent).
        num_blocks: KV cache blocks available.
        connector: the KV connector's scheduler side, or None.
        eos_token_ids: every token id that means end of sequence (in addition to each request's
            ``eos_token_id``).
        tiers: the KV cache tiers' bookkeeping, or None (evicted KV is lost).

    Attributes:
        queues: the waiting and running requests (:class:`RequestQueues`).
        kv_cache_manager: the block manager.
        remote_kv: KV that crosses instances, and the requests parked while it loads.
        finished_request_ids: requests finished since the last step was scheduled.
        loaded_since_schedule: a request whose KV load finished went back to ``waiting`` after
            the last :meth:`schedule`: it can run now, so the core steps again without waiting
            for a poll tick.

    Raises:
        ValueError: non-positive limits or an unknown ``kv_load_failure_policy``.
    """

    def __init__(
        self,
        config: "EngineConfig",
        num_blocks: int,
        connector: "KVConnectorSchedulerSide | None" = None,
        eos_token_ids: Iterable[int] = (),
        tiers: TierManager | None = None,
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
        self.num_scheduler_steps = config.num_scheduler_steps
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be at least 1")
        self.tiers = tiers
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching,
            on_evict=tiers.on_evict if tiers is not None else None,
            eviction=config.prefix_cache_eviction,
        )
        self.tier_loads = (TierLoads(self.kv_cache_manager, tiers) if tiers is not None
                           else None)
        self.connector = connector
        self.remote_kv = RemoteKV(self.kv_cache_manager, connector,
                                  parse_load_failure_policy(config.kv_transfer_config))
        self.acceptor = TokenAcceptor(eos_token_ids, self.max_model_len)

        self.requests: dict[str, Request] = {}
        self.queues = RequestQueues()
        self.running_batch = RunningBatch(self.queues, self.kv_cache_manager)
        self.admitter = Admitter(self.queues, self.kv_cache_manager, self.remote_kv,
                                 self.max_num_seqs, self.tier_loads)
        self.multi_step = MultiStepRounds(
            self.queues, self.kv_cache_manager, self.remote_kv, self.acceptor, self.num_scheduler_steps,
            self.max_num_batched_tokens, self.max_num_seqs, self.max_model_len)
        self.async_policy = AsyncSchedulingPolicy(
            self.queues, self.kv_cache_manager, self.remote_kv, self.admitter, self.multi_step,
            self.max_num_batched_tokens, self.max_model_len)
        self.finished_request_ids: set[str] = set()
        self.loaded_since_schedule = False
        self.demoter = (TurnDemoter(self.queues, self.kv_cache_manager, self.remote_kv, connector,
                                    self.tier_loads) if connector is not None else None)

        self.prompt_tokens_total = 0
        self.prompt_tokens_computed_total = 0
        self.num_requests_finished_total = 0

    # ================================================================ requests in
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: duplicate id, empty prompt, prompt longer than ``max_model_len``, or a
                prompt that cannot fit in the whole KV cache.
        """
        request_id = request.request_id
        if request_id in self.requests or request_id in self.remote_kv.held:
            raise ValueError(f"request id {request_id!r} is already in use")
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
        self.requests[request_id] = request
        self.queues.waiting.append(request)
        self.prompt_tokens_total += n
        if self.connector is not None:
            self.connector.request_added(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests in any state; unknown ids are ignored. Their blocks are freed (or held
        while the connector still needs them) and the connector is told. A finished request
        whose blocks are held for a remote reader (a prefiller's lease) has that hold ended:
        its front end aborts it only when the client left before getting the params."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:  # finished; blocks it holds for a reader nobody will send are freed
                self.remote_kv.release_held(request_id)
                continue
            if req.status == RequestStatus.RUNNING:
                self.queues.running.remove(req)
            elif req.status not in (RequestStatus.WAITING_FOR_REMOTE_KVS,
                                    RequestStatus.WAITING_FOR_TIER_KVS):  # finish unparks it
                self.queues.waiting.remove(req)
            self.finish(req, RequestStatus.FINISHED_ABORTED)

    # ================================================================ scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring for the policy), or a multi-step
        decode round (:meth:`~pdserve.engine.multi_step.MultiStepRounds.schedule`) when
        ``num_scheduler_steps > 1`` allows."""
        self.loaded_since_schedule = False
        multi = self.multi_step.schedule()
        if multi is not None:
            return self.close_step(multi)
        sched_out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.remote_kv.sync_loads.clear()

        # 1. running requests: decodes first, then continuing chunked prefills.
        budget, preempted = self.running_batch.schedule(sched_out, budget)

        # 2. waiting requests (only when nothing had to be preempted this step).
        if not preempted:
            budget = self.admitter.admit_waiting(sched_out, budget)

        sched_out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        return self.close_step(sched_out)

    def schedule_async(self, running_step: SchedulerOutput) -> SchedulerOutput | None:
        """Async scheduling: step n+1 while ``running_step`` (step n) runs, or None when it
        must be scheduled synchronously after step n's commit
        (:meth:`~pdserve.engine.async_scheduling.AsyncSchedulingPolicy.schedule_next`)."""
        sched_out = self.async_policy.schedule_next(running_step)
        return self.close_step(sched_out) if sched_out is not None else None

    def close_step(self, sched_out: SchedulerOutput) -> SchedulerOutput:
        """Hand the requests finished since the last step to ``sched_out`` and let the connector
        build its metadata for the step; returns ``sched_out``."""
        sched_out.finished_request_ids = self.finished_request_ids
        self.finished_request_ids = set()
        if self.demoter is not None:
            self.demoter.relieve(sched_out.scheduled)
        if self.tiers is not None:
            sched_out.kv_tier_jobs = self.tiers.take_jobs()
        if self.connector is not None:
            sched_out.kv_connector_metadata = self.connector.build_connector_meta(sched_out)
        return sched_out

    # ================================================================ results
    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Commit a step: advance computed tokens, append sampled tokens, apply stop
        conditions (:meth:`commit_step`), and consume the connector's and the tiers' reports
        (:meth:`apply_reports`).

        Returns:
            One :class:`EngineCoreOutput` per request that produced a token or finished (plus
            requests failed by a KV load), in batch order, then those of the reports.
        """
        outputs = self.commit_step(sched_out, runner_out)
        outputs.extend(self.apply_reports(runner_out.kv_connector_output,
                                          runner_out.kv_tier_report))
        return outputs

    def commit_step(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Commit a step's tokens without its reports: advance computed tokens, append sampled
        tokens, apply stop conditions. Of the connector's report only the invalid blocks and
        load errors of the step's synchronous loads are read (their failure policy applies
        to this step's requests).

        Returns:
            One :class:`EngineCoreOutput` per request that produced a token or finished, in
            batch order.
        """
        outputs: list[EngineCoreOutput] = []
        kv_out = runner_out.kv_connector_output
        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        kvm = self.kv_cache_manager
        remote_kv = self.remote_kv
        sync_loads = remote_kv.sync_loads  # usually empty: no KV loaded in this step
        multi_step = sched_out.num_steps > 1
        sampled, logprobs = runner_out.sampled_token_ids, runner_out.logprobs

        for sr in sched_out.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted after scheduling
            if invalid:
                failed = remote_kv.sync_load_failed(req, invalid, kv_out.load_errors.get(sr.request_id))
                if failed is not None:
                    self._apply_load_result(failed, outputs)
                    continue
            if multi_step:
                outputs.append(self._commit_round(req, runner_out.sampled_token_id_lists.get(sr.request_id)))
                continue
            start = req.num_computed_tokens
            end = start + len(sr.token_ids)
            req.num_computed_tokens = end
            if start < req.num_prompt_tokens:
                self.prompt_tokens_computed_total += min(end, req.num_prompt_tokens) - start
            if sync_loads:
                remote_kv.commit_sync_load(req)
            kvm.cache_blocks(req, end)
            if not sr.sample:
                continue
            token = sampled.get(sr.request_id)
            if token is None:
                self.queues.running.remove(req)
                outputs.append(
                    self.finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
                )
                continue
            outputs.append(self.append_token(req, token, logprobs.get(sr.request_id)))
        if sync_loads:  # not clear(): an async-scheduled next step may have loads too
            for sr in sched_out.scheduled:
                sync_loads.pop(sr.request_id, None)
        return outputs

    def apply_reports(self, kv_out: KVConnectorOutput | None,
                      tier_report: KVTierReport | None) -> list[EngineCoreOutput]:
        """Consume the reports the runner took on the host (the KV connector's
        ``get_finished`` and the KV cache tiers' copies): ended tier loads go back to the
        waiting front, prefillers' first tokens are appended, ended KV loads and sends are
        acted on. They do not depend on a step's tokens: with async scheduling the engine core
        applies a step's reports at its launch, before its tokens are known.

        Returns:
            The outputs of requests that got a first token or finished by a KV load.
        """
        outputs: list[EngineCoreOutput] = []
        remote_kv = self.remote_kv
        if tier_report is not None and self.tier_loads is not None:
            for req in self.tier_loads.report(tier_report):
                self.queues.requeue_front(req)
                self.loaded_since_schedule = True
        if self.demoter is not None:
            self.demoter.update(kv_out)
        if kv_out is not None:
            remote_kv.update_connector_output(kv_out)
            for req, token in remote_kv.first_tokens_ready(kv_out, self.acceptor.finishes):
                outputs.append(self.append_token(req, token, None))
            for request_id in kv_out.finished_recving:
                result = remote_kv.load_finished(request_id, kv_out)
                if result is not None:
                    self._apply_load_result(result, outputs)
            for request_id in kv_out.finished_sending:
                remote_kv.transfer_sent(request_id)
        return outputs

    def _apply_load_result(self, result: LoadResult, outputs: list[EngineCoreOutput]) -> None:
        """Act on the end of a request's KV load: finish it with its error (``FAIL``), or put it
        back at the waiting front (``RECOMPUTE``; ``LOADED``, after a kept first token of P's)."""
        req = result.request
        if result.outcome is LoadOutcome.LOADED:
            if result.first_token is not None:
                outputs.append(self.append_token(req, result.first_token, None))
                if outputs[-1].finish_reason is not None:
                    return
            self.queues.requeue_front(req)
            self.loaded_since_schedule = True
            return
        if req.status == RequestStatus.RUNNING:  # a synchronous load of this step
            self.queues.running.remove(req)
        if result.outcome is LoadOutcome.RECOMPUTE:
            self.queues.requeue_front(req)
            return
        o = self.finish(req, RequestStatus.FINISHED_ERROR, result.error)
        o.kv_load_failure = result.kv_load_failure
        outputs.append(o)

    def _commit_round(self, req: Request, tokens: list[int] | None) -> EngineCoreOutput:
        """Commit a multi-step round of one request
        (:meth:`~pdserve.engine.multi_step.MultiStepRounds.commit`); None or no ``tokens``:
        the runner sampled nothing, and the request fails."""
        if not tokens:
            self.queues.running.remove(req)
            return self.finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
        accepted, status, stop_reason = self.multi_step.commit(req, tokens)
        if status is None:
            return self.output(req, accepted, None)
        return self.finish_with_tokens(req, status, stop_reason, accepted, [])

    def append_token(self, req: Request, token: int, logprobs: Any) -> EngineCoreOutput:
        """Accept one sampled token of ``req`` (finishing it when a stop condition holds) and
        return its output."""
        status, stop_reason = self.acceptor.accept(req, token)
        if status is None:
            return self.output(req, [token], logprobs)
        return self.finish_with_tokens(req, status, stop_reason, [token],
                                       [logprobs] if logprobs is not None else [])

    def finish_with_tokens(self, req: Request, status: RequestStatus, stop_reason: int | None,
                           tokens: list[int], logprobs: list[Any]) -> EngineCoreOutput:
        """Finish a request whose last ``tokens`` were just accepted (it leaves ``running``
        when it was there: a decoder's request may finish on the prefiller's first token
        before it ever ran)."""
        if req.status == RequestStatus.RUNNING:
            self.queues.running.remove(req)
        o = self.finish(req, status)
        o.new_token_ids = tokens
        o.new_logprobs = logprobs
        o.stop_reason = stop_reason
        return o

    def output(self, req: Request, tokens: list[int], logprobs: Any) -> EngineCoreOutput:
        """An output of ``req`` carrying ``tokens`` (and one step's ``logprobs``, if any)."""
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=tokens,
            new_logprobs=[logprobs] if logprobs is not None else [],
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_transferred_tokens=req.num_transferred_tokens,
        )

    def finish(
        self, req: Request, status: RequestStatus, error: str | None = None
    ) -> EngineCoreOutput:
        """Mark a request finished (already removed from ``waiting`` / ``running``; a parked
        one leaves ``waiting_for_remote`` here), tell the connector, free or hold its blocks.
        Returns its final output (no tokens)."""
        req.status = status
        req.error = error
        self.requests.pop(req.request_id, None)
        self.finished_request_ids.add(req.request_id)
        self.num_requests_finished_total += 1
        loading = self.tier_loads is not None and self.tier_loads.request_finished(req)
        params = self.remote_kv.request_finished(req, free_blocks=not loading)
        o = self.output(req, [], None)
        o.finish_reason = status.finish_reason
        o.kv_transfer_params = params
        o.error = error
        return o

    # ================================================================ status
    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs or waits for remote KV."""
        return bool(self.queues.waiting or self.queues.running or self.remote_kv.waiting_for_remote
                    or (self.tier_loads is not None and self.tier_loads.waiting))

    def has_pending_kv_work(self) -> bool:
        """True while the connector has transfers, notifications or leases to poll, or tier
        loads are in flight."""
        return self.remote_kv.has_pending_work() or self.has_pending_tier_work()

    def has_pending_tier_work(self) -> bool:
        """True while tier loads are in flight or a claimed turn waits for blocks (polled)."""
        return ((self.demoter is not None and self.demoter.has_pending_work())
                or (self.tier_loads is not None and self.tier_loads.has_pending_work()))

    def stats(self) -> dict[str, Any]:
        """Snapshot for metrics: queue sizes, KV cache usage (0..1) and cumulative counters."""
        kvm = self.kv_cache_manager
        remote_kv = self.remote_kv
        return {
            "num_running": len(self.queues.running),
            "num_waiting": len(self.queues.waiting),
            "num_waiting_for_remote_kvs": len(remote_kv.waiting_for_remote)
            + (len(self.tier_loads.waiting) if self.tier_loads is not None else 0),
            "num_held_for_transfer": len(remote_kv.held),
            "kv_cache_usage": kvm.usage,
            "num_blocks": kvm.num_blocks,
            "num_free_blocks": kvm.num_free_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "prompt_tokens_computed_total": self.prompt_tokens_computed_total,
            "prompt_tokens_cached_total": self.admitter.prompt_tokens_cached_total,
            "prompt_tokens_transferred_total": remote_kv.prompt_tokens_transferred_total,
            "generation_tokens_total": self.acceptor.generation_tokens_total,
            "num_preemptions_total": self.running_batch.num_preemptions_total,
            "num_kv_load_failures_total": remote_kv.num_kv_load_failures_total,
            "num_kv_partial_loads_total": remote_kv.num_kv_partial_loads_total,
            "num_requests_finished_total": self.num_requests_finished_total,
            "prefix_cache_queries_total": kvm.prefix_cache_queries,
            "prefix_cache_hits_total": kvm.prefix_cache_hits,
            "kv_tiers": None if self.tier_loads is None else self.tier_loads.stats(),
            "kv_turns": None if self.demoter is None else self.demoter.stats(),
        }

    def reset_kv_caches(self) -> bool:
        """Forget every cached block: the prefix cache's and the tiers' (benchmarks between
        runs). Only possible while no request holds blocks and no tier load runs.

        Returns:
            True when everything was reset.
        """
        if not self.kv_cache_manager.reset_prefix_cache():
            return False
        return self.tiers is None or self.tiers.clear()

    def shutdown(self) -> None:
        """Shut the connector's scheduler side down."""
        if self.connector is not None:
            self.connector.shutdown()
