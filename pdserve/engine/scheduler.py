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
(:func:`pdserve.engine.multi_step.schedule_multi_step` says exactly when).

Computed tokens are committed (``num_computed_tokens`` advanced, full blocks registered in the
prefix cache) in :meth:`Scheduler.update_from_output`, after their KV exists.

KV that crosses instances (loads through the KV connector, their failures, blocks held for a
transfer) is tracked by :class:`pdserve.engine.remote_kv.RemoteKV`, whose module docstring says
how the scheduler drives the connector.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Iterable

from pdserve.engine.admission import admit_waiting
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.multi_step import commit_multi_step, schedule_multi_step
from pdserve.types.outputs import EngineCoreOutput, ModelRunnerOutput, ScheduledRequest, SchedulerOutput
from pdserve.engine.remote_kv import RemoteKV, parse_load_failure_policy
from pdserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.types.engine_config import EngineConfig
    from pdserve.kv_transfer.base import KVConnectorSchedulerSide

logger = logging.getLogger(__name__)


class Scheduler:
    """Decides, each step, which tokens of which requests the model runner computes.

    Args:
        config: engine configuration; reads ``block_size``, ``enable_prefix_caching``,
            ``max_num_batched_tokens``, ``max_num_seqs``, ``num_scheduler_steps``,
            ``max_model_len`` (tokens; capped at the KV cache capacity ``num_blocks *
            block_size`` so one request always fits; None: that capacity) and
            ``kv_transfer_config.kv_load_failure_policy`` (``FAIL`` when absent).
        num_blocks: KV cache blocks available.
        connector: the KV connector's scheduler side, or None.
        eos_token_ids: every token id that means end of sequence (in addition to each request's
            ``eos_token_id``).

    Raises:
        ValueError: non-positive limits or an unknown ``kv_load_failure_policy``.
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
        self.num_scheduler_steps = config.num_scheduler_steps
        if self.num_scheduler_steps < 1:
            raise ValueError("num_scheduler_steps must be at least 1")
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.connector = connector
        self.remote_kv = RemoteKV(self, connector, parse_load_failure_policy(config.kv_transfer_config))
        self.eos_token_ids = frozenset(eos_token_ids)

        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_remote: dict[str, Request] = {}
        self.finished_request_ids: set[str] = set()
        # A request whose KV load finished went back to ``waiting`` after the last schedule():
        # it can run now, so the core steps again without waiting for a poll tick.
        self.loaded_since_schedule = False

        self.prompt_tokens_total = 0
        self.prompt_tokens_computed_total = 0
        self.prompt_tokens_cached_total = 0
        self.generation_tokens_total = 0
        self.num_preemptions_total = 0
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
        self.waiting.append(request)
        self.prompt_tokens_total += n
        if self.connector is not None:
            self.connector.request_added(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        """Abort requests in any state; unknown ids are ignored. Their blocks are freed (or kept
        while the connector still needs them) and the connector is told. A finished request
        whose blocks are held for a remote reader (a prefiller's lease) has that hold ended:
        its front end aborts it only when the client left before getting the params."""
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is None:  # finished; blocks it holds for a reader nobody will send are freed
                self.remote_kv.release_held(request_id)
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                del self.waiting_for_remote[request_id]
            else:
                self.waiting.remove(req)
            self.finish(req, RequestStatus.FINISHED_ABORTED)

    # ================================================================ scheduling
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring for the policy), or a multi-step
        decode round (:func:`~pdserve.engine.multi_step.schedule_multi_step`) when
        ``num_scheduler_steps > 1`` allows."""
        self.loaded_since_schedule = False
        if self.num_scheduler_steps > 1:
            multi = schedule_multi_step(self)
            if multi is not None:
                return multi
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        self.remote_kv.sync_loads.clear()
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
            self.add_scheduled(out, req, num_new)
            scheduled_ids.add(req.request_id)
            budget -= num_new

        # 2. waiting requests (only when nothing had to be preempted this step).
        if not preempted:
            budget = admit_waiting(self, out, budget)

        out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        return self.close_step(out)

    def close_step(self, out: SchedulerOutput) -> SchedulerOutput:
        """Hand the requests finished since the last step to ``out`` and let the connector
        build its metadata for the step; returns ``out``."""
        out.finished_request_ids = self.finished_request_ids
        self.finished_request_ids = set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        return out

    def add_scheduled(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        """Append ``req``'s next ``num_new`` tokens (from ``num_computed_tokens`` on) to ``out``."""
        start = req.num_computed_tokens
        end = start + num_new
        out.scheduled.append(
            ScheduledRequest(
                request_id=req.request_id,
                token_ids=req.token_ids(start, end),
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
        outputs: list[EngineCoreOutput] = []
        kv_out = out.kv_connector_output
        invalid = set(kv_out.invalid_block_ids) if kv_out is not None else set()
        kvm = self.kv_cache_manager
        remote_kv = self.remote_kv
        sync_loads = remote_kv.sync_loads  # usually empty: no KV loaded in this step
        multi_step = sched.num_steps > 1
        sampled, logprobs = out.sampled_token_ids, out.logprobs

        for sr in sched.scheduled:
            req = self.requests.get(sr.request_id)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted after scheduling
            if invalid:
                failed = remote_kv.sync_load_failed(req, invalid, kv_out.load_errors.get(sr.request_id))
                if failed is not None:
                    outputs.extend(failed)
                    continue
            if multi_step:
                outputs.append(commit_multi_step(self, req, out.sampled_token_id_lists.get(sr.request_id)))
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
                self.running.remove(req)
                outputs.append(
                    self.finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
                )
                continue
            outputs.append(self.append_token(req, token, logprobs.get(sr.request_id)))
        if sync_loads:  # not clear(): an overlapped next step may have loads too
            for sr in sched.scheduled:
                sync_loads.pop(sr.request_id, None)

        if kv_out is not None:
            outputs.extend(remote_kv.process_kv_output(kv_out, invalid))
        return outputs

    def append_token(self, req: Request, token: int, logprobs: Any) -> EngineCoreOutput:
        """Accept one sampled token of ``req`` (finishing it when a stop condition holds) and
        return its output."""
        status, stop_reason = self.accept_token(req, token)
        if status is None:
            return self.output(req, [token], logprobs)
        return self.finish_with_tokens(req, status, stop_reason, [token],
                                       [logprobs] if logprobs is not None else [])

    def accept_token(self, req: Request, token: int) -> tuple[RequestStatus | None, int | None]:
        """Append a sampled token; returns ``(finish status or None, stop token or None)``."""
        req.output_token_ids.append(token)
        if req.first_token_time is None:
            req.first_token_time = time.monotonic()
        self.generation_tokens_total += 1
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and (token == req.eos_token_id or token in self.eos_token_ids):
                return RequestStatus.FINISHED_STOPPED, None
            if token in sp.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token
        if n_out >= sp.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None

    def finish_with_tokens(self, req: Request, status: RequestStatus, stop_reason: int | None,
                           tokens: list[int], logprobs: list[Any]) -> EngineCoreOutput:
        """Finish a request whose last ``tokens`` were just accepted (it leaves ``running``
        when it was there: a decoder's request may finish on the prefiller's first token
        before it ever ran)."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
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
        """Mark a request finished (already removed from the running/waiting structures),
        tell the connector, free or hold its blocks. Returns its final output (no tokens)."""
        req.status = status
        req.error = error
        self.requests.pop(req.request_id, None)
        self.finished_request_ids.add(req.request_id)
        self.num_requests_finished_total += 1
        params = self.remote_kv.request_finished(req)
        o = self.output(req, [], None)
        o.finish_reason = status.finish_reason
        o.kv_transfer_params = params
        o.error = error
        return o

    # ================================================================ status
    def has_unfinished_requests(self) -> bool:
        """True while any request waits, runs or waits for remote KV."""
        return bool(self.waiting or self.running or self.waiting_for_remote)

    def has_pending_kv_work(self) -> bool:
        """True while the connector has transfers, notifications or leases to poll."""
        if self.connector is None:
            return False
        if self.waiting_for_remote or self.remote_kv.held:
            return True
        return bool(self.connector.has_pending_work())

    def get_num_unfinished_requests(self) -> int:
        """Requests waiting, running or waiting for remote KV."""
        return len(self.waiting) + len(self.running) + len(self.waiting_for_remote)

    def stats(self) -> dict[str, Any]:
        """Snapshot for metrics: queue sizes, KV cache usage (0..1) and cumulative counters."""
        kvm = self.kv_cache_manager
        return {
            "num_running": len(self.running),
            "num_waiting": len(self.waiting),
            "num_waiting_for_remote_kvs": len(self.waiting_for_remote),
            "num_held_for_transfer": len(self.remote_kv.held),
            "kv_cache_usage": kvm.usage,
            "num_blocks": kvm.num_blocks,
            "num_free_blocks": kvm.num_free_blocks,
            "prompt_tokens_total": self.prompt_tokens_total,
            "prompt_tokens_computed_total": self.prompt_tokens_computed_total,
            "prompt_tokens_cached_total": self.prompt_tokens_cached_total,
            "prompt_tokens_transferred_total": self.remote_kv.prompt_tokens_transferred_total,
            "generation_tokens_total": self.generation_tokens_total,
            "num_preemptions_total": self.num_preemptions_total,
            "num_kv_load_failures_total": self.remote_kv.num_kv_load_failures_total,
            "num_requests_finished_total": self.num_requests_finished_total,
            "prefix_cache_queries_total": kvm.prefix_cache_queries,
            "prefix_cache_hits_total": kvm.prefix_cache_hits,
        }

    def shutdown(self) -> None:
        """Shut the connector's scheduler side down."""
        if self.connector is not None:
            self.connector.shutdown()
