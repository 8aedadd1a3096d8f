"""Multi-step scheduling (``num_scheduler_steps > 1``): rounds of several decode steps run back
to back for every running request, when they may be scheduled, and their commit. Pure
bookkeeping: no torch.

A round saves the scheduling and host round trips between decode steps when nothing on the
host can change the batch in between; the :class:`~pdserve.engine.scheduler.Scheduler` asks
:meth:`MultiStepRounds.schedule` first on every step and falls back to a single step when it
returns None.
"""

from __future__ import annotations

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.remote_kv import RemoteKV
from pdserve.engine.request_queues import RequestQueues, scheduled_request
from pdserve.engine.token_acceptor import TokenAcceptor
from pdserve.types.outputs import SchedulerOutput
from pdserve.types.request import Request, RequestStatus


class MultiStepRounds:
    """Schedules multi-step decode rounds.

    Args:
        queues: the scheduler's waiting and running requests.
        kv_cache_manager: the engine's block manager.
        remote_kv: the scheduler's remote-KV state (no round while KV work is pending).
        acceptor: accepts a round's tokens and applies the stop conditions.
        num_scheduler_steps: most decode steps in a round (rounds are off at 1).
        max_num_batched_tokens / max_num_seqs / max_model_len: the scheduler's limits.
    """

    def __init__(self, queues: RequestQueues, kv_cache_manager: KVCacheManager, remote_kv: RemoteKV,
                 acceptor: TokenAcceptor, num_scheduler_steps: int, max_num_batched_tokens: int,
                 max_num_seqs: int, max_model_len: int):
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.remote_kv = remote_kv
        self.acceptor = acceptor
        self.num_scheduler_steps = num_scheduler_steps
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len

    def schedule(self) -> SchedulerOutput | None:
        """A round of up to ``num_scheduler_steps`` decode steps for every running request, or
        None when this step must be scheduled normally.

        Only when every running request is a plain decode (one token to compute, nothing
        waiting that could be admitted, no KV transfer or lease pending, and no request whose
        next tokens depend on host-side state: penalties, logprobs, ``min_tokens`` not yet
        reached). The round is shortened so that no position passes ``max_model_len``; each
        request gets blocks for all its tokens up front (none are preempted for this: if the
        blocks are short, the step is scheduled normally). A request that stops inside the
        round keeps only the tokens up to its stop (see :meth:`commit`); the rest of its round
        was wasted GPU work.

        Returns:
            The round (``num_steps`` > 1, one scheduled token per request), not yet closed
            (no finished ids, no connector metadata), or None.
        """
        if self.num_scheduler_steps <= 1:
            return None
        running = self.queues.running
        if not running or len(running) > self.max_num_batched_tokens:
            return None
        if self._round_ruled_out():
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
        sched_out = SchedulerOutput(num_steps=steps)
        for req in running:
            sched_out.scheduled.append(scheduled_request(req, req.num_computed_tokens, 1))
        sched_out.total_num_scheduled_tokens = len(running) * steps
        return sched_out

    def commit(self, req: Request, tokens: list[int]) -> tuple[list[int], RequestStatus | None, int | None]:
        """Commit a round of one request: its tokens in order up to the first that stops it;
        every accepted token but a final stopping one had its KV computed (and its full blocks go
        into the prefix cache).

        Args:
            tokens: the round's sampled tokens of ``req``, in step order (at least one).

        Returns:
            ``(accepted tokens, finish status or None, stop token or None)``; the scheduler
            finishes the request when the status is not None.
        """
        accepted: list[int] = []
        for token in tokens:
            req.num_computed_tokens += 1
            accepted.append(token)
            status, stop_reason = self.acceptor.accept(req, token)
            if status is not None:
                self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
                return accepted, status, stop_reason
        self.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
        return accepted, None, None

    def may_follow(self, running_step: SchedulerOutput) -> bool:
        """True when a round may follow ``running_step`` (launched, not yet committed): rounds
        are on, every running request decodes in it, no waiting request could be admitted, and
        nothing rules a round out (the conditions of :meth:`schedule`). Async scheduling then
        lets the synchronous scheduler decide the next step."""
        if self.num_scheduler_steps <= 1 or self._round_ruled_out():
            return False
        if len(running_step.scheduled) != len(self.queues.running):
            return False
        for sr in running_step.scheduled:
            sp = sr.sampling_params
            if (not sr.sample or len(sr.token_ids) != 1 or sp.logprobs is not None
                    or sp.uses_penalties or sr.output_position() + 1 < sp.min_tokens):
                return False
        return True

    def _round_ruled_out(self) -> bool:
        """A waiting request could be admitted, or KV work (a load, a transfer, a lease) is
        pending."""
        queues = self.queues
        if queues.waiting and len(queues.running) < self.max_num_seqs:
            return True
        return self.remote_kv.has_pending_work()
