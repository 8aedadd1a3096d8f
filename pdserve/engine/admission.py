"""Admission of waiting requests into a step: local prefix-cache hit, the KV connector's
external hit, block allocation, and parking requests whose KV loads asynchronously. Pure
bookkeeping: no torch.

Step 2 of the :class:`~pdserve.engine.scheduler.Scheduler`'s policy (see its module docstring):
waiting requests in FCFS order while fewer than ``max_num_seqs`` run and token budget remains.
"""

from __future__ import annotations

import enum

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.remote_kv import RemoteKV
from pdserve.engine.request_queues import RequestQueues, scheduled_request
from pdserve.engine.tier_loads import TierLoads
from pdserve.types.outputs import SchedulerOutput
from pdserve.types.request import Request, RequestStatus


class Admission(enum.Enum):
    """What :meth:`Admitter.try_schedule` did with a waiting request."""

    SCHEDULED = "scheduled"  # now running, in this step's output
    REMOTE = "remote"  # parked in WAITING_FOR_REMOTE_KVS (or _TIER_KVS) while its KV loads
    SKIP = "skip"  # nothing to compute now; stays waiting
    BLOCKED = "blocked"  # not enough free blocks: stop scheduling waiting requests this step


class Admitter:
    """Moves waiting requests into a step (or parks them while their KV loads), and counts the
    prompt tokens they found in the local prefix cache.

    Args:
        queues: the scheduler's waiting and running requests.
        kv_cache_manager: the engine's block manager.
        remote_kv: the scheduler's remote-KV state (external hits, loads, parking).
        max_num_seqs: most requests running at once.
        tier_loads: the KV cache tiers' loads (None: no tiers): a fresh request whose prefix
            goes on in a tier past its device hit parks while those blocks come back.

    Attributes:
        prompt_tokens_cached_total: prompt tokens served from the local prefix cache, over all
            admitted requests (each counted at its first scheduling only).
    """

    def __init__(self, queues: RequestQueues, kv_cache_manager: KVCacheManager, remote_kv: RemoteKV,
                 max_num_seqs: int, tier_loads: TierLoads | None = None):
        self.queues = queues
        self.tier_loads = tier_loads
        self.kv_cache_manager = kv_cache_manager
        self.remote_kv = remote_kv
        self.max_num_seqs = max_num_seqs
        self.prompt_tokens_cached_total = 0

    def admit_waiting(self, sched_out: SchedulerOutput, budget: int) -> int:
        """Schedule waiting requests into ``sched_out`` in FCFS order; requests that cannot run
        now keep their place at the front of the queue.

        Once a request is blocked on free blocks, later requests that need no prefix lookup
        because they already hold their blocks (KV loaded from elsewhere) may still go ahead:
        otherwise they could hold the very blocks the blocked request waits for.

        Args:
            budget: tokens left in this step (``max_num_batched_tokens`` minus those scheduled).

        Returns:
            The tokens left in the budget.
        """
        waiting, running = self.queues.waiting, self.queues.running
        skipped: list[Request] = []
        blocked = False
        while waiting and budget > 0:
            if len(running) >= self.max_num_seqs:
                break
            if blocked and not any(r.block_ids for r in waiting):
                break
            req = waiting.popleft()
            if blocked and not req.block_ids:
                skipped.append(req)
                continue
            status = self.try_schedule(req, sched_out, budget)
            if status is Admission.SCHEDULED:
                budget -= len(sched_out.scheduled[-1].token_ids)
            elif status in (Admission.SKIP, Admission.BLOCKED):
                blocked = blocked or status is Admission.BLOCKED
                skipped.append(req)
        waiting.extendleft(reversed(skipped))
        return budget

    def try_schedule(self, req: Request, sched_out: SchedulerOutput, budget: int) -> Admission:
        """Schedule one waiting request (taken off the waiting queue by the caller), within
        ``budget`` tokens; see :class:`Admission` for the outcomes."""
        kvm = self.kv_cache_manager
        remote_kv = self.remote_kv
        computed_blocks: list[int] = []
        num_local = 0
        num_external = 0
        load_async = False
        fresh = not req.block_ids and req.num_computed_tokens == 0
        tiers = self.tier_loads
        # back from a tier load: the connector is asked about what lies beyond, as when fresh
        consult = fresh or (tiers is not None and req.request_id in tiers.loaded)
        if fresh:
            computed_blocks, num_local = kvm.get_computed_blocks(req)
            if tiers is not None:
                loading = tiers.try_load(req, computed_blocks, num_local)
                if loading == 0:
                    return Admission.BLOCKED
                if loading is not None:
                    self._record_cached(req, num_local + loading)
                    if req.request_id not in tiers.loaded:
                        return Admission.REMOTE  # parked until its disk reads end
                    # host tier only: loaded in this step, scheduled as one back from a load
                    fresh, consult, computed_blocks = False, True, []
        if consult and not fresh:
            num_local = req.num_computed_tokens
        if consult:
            num_external, load_async = remote_kv.num_matched_tokens(req, num_local)

        if load_async:
            if kvm.allocate_slots(req, num_external, computed_blocks) is None:
                return Admission.BLOCKED
            req.num_computed_tokens = num_local
            self._record_cached(req, num_local)
            remote_kv.start_async_load(req, num_local, num_external)
            if tiers is not None:
                tiers.loaded.discard(req.request_id)
            return Admission.REMOTE

        # Tokens whose KV will exist before this step's forward pass (cache hit + sync load);
        # at least one token is always computed, for the logits.
        start = min(num_local + num_external, req.num_tokens - 1) if consult else req.num_computed_tokens
        num_new = min(req.num_tokens - start, budget)
        if num_new <= 0:
            return Admission.SKIP
        room = (start - num_local + num_new) if consult else num_new
        if kvm.allocate_slots(req, room, computed_blocks) is None:
            return Admission.BLOCKED
        if consult:
            remote_kv.blocks_allocated(req, num_local, num_external, start)
            self._record_cached(req, num_local)
            req.num_computed_tokens = start
            if tiers is not None:
                tiers.loaded.discard(req.request_id)
        req.status = RequestStatus.RUNNING
        self.queues.running.append(req)
        sched_out.scheduled.append(scheduled_request(req, req.num_computed_tokens, num_new))
        return Admission.SCHEDULED

    def _record_cached(self, req: Request, num_local: int) -> None:
        if req.num_cached_tokens < 0:  # first scheduling only
            req.num_cached_tokens = num_local
            self.prompt_tokens_cached_total += min(num_local, req.num_prompt_tokens)
