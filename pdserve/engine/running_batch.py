"""Step 1 of the :class:`~pdserve.engine.scheduler.Scheduler`'s policy (see its module
docstring): the running requests, decodes before unfinished chunked prefills, under the token
budget, with preemption by recompute when blocks run out. Pure bookkeeping: no torch.
"""

from __future__ import annotations

import logging

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.request_queues import RequestQueues, scheduled_request
from pdserve.types.outputs import SchedulerOutput
from pdserve.types.request import Request, RequestStatus

logger = logging.getLogger("pdserve.engine.scheduler")


class RunningBatch:
    """Schedules the running requests of a step and preempts them when blocks run out.

    Args:
        queues: the scheduler's waiting and running requests.
        kv_cache_manager: the engine's block manager.

    Attributes:
        num_preemptions_total: requests preempted so far.
    """

    def __init__(self, queues: RequestQueues, kv_cache_manager: KVCacheManager):
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.num_preemptions_total = 0

    def schedule(self, sched_out: SchedulerOutput, budget: int) -> tuple[int, bool]:
        """Schedule the running requests into ``sched_out``: decodes first, then continuing
        chunked prefills, each taking ``num_tokens - num_computed_tokens`` tokens capped by
        the remaining ``budget``. When blocks run out, the most recently arrived running
        request not yet scheduled this step is preempted (:meth:`preempt`).

        Returns:
            ``(budget left, whether a request was preempted)``.
        """
        running = self.queues.running
        scheduled_ids: set[str] = set()
        preempted = False
        decodes = [r for r in running if r.num_computed_tokens >= r.num_prompt_tokens]
        prefills = [r for r in running if r.num_computed_tokens < r.num_prompt_tokens]
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
                    self.preempt(req)
                    break
                self.preempt(victim)
            if req.status != RequestStatus.RUNNING:
                continue
            sched_out.scheduled.append(scheduled_request(req, req.num_computed_tokens, num_new))
            scheduled_ids.add(req.request_id)
            budget -= num_new
        return budget, preempted

    def _pick_victim(self, scheduled_ids: set[str]) -> Request | None:
        """The running request not yet scheduled this step that arrived last."""
        candidates = [r for r in self.queues.running if r.request_id not in scheduled_ids]
        if not candidates:
            return None
        return max(candidates, key=lambda r: r.arrival_time)

    def preempt(self, req: Request) -> None:
        """Free the request's blocks (and with them its memoised block hashes, see
        :meth:`KVCacheManager.free`) and queue it for recomputation at the waiting front."""
        self.queues.running.remove(req)
        self.kv_cache_manager.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.queues.waiting.appendleft(req)
        logger.debug("preempted request %s (%d tokens)", req.request_id, req.num_tokens)
