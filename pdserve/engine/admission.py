"""Admission of waiting requests into a step: local prefix-cache hit, the KV connector's
external hit, block allocation, and parking requests whose KV loads asynchronously. Pure
bookkeeping: no torch.

Step 2 of the :class:`~pdserve.engine.scheduler.Scheduler`'s policy (see its module docstring):
waiting requests in FCFS order while fewer than ``max_num_seqs`` run and token budget remains.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from pdserve.types.outputs import SchedulerOutput
from pdserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


class Admission(enum.Enum):
    """What :func:`try_schedule_waiting` did with a waiting request."""

    SCHEDULED = "scheduled"  # now running, in this step's output
    REMOTE = "remote"  # parked in WAITING_FOR_REMOTE_KVS while its KV loads
    SKIP = "skip"  # nothing to compute now; stays waiting
    BLOCKED = "blocked"  # not enough free blocks: stop scheduling waiting requests this step


def admit_waiting(sched: "Scheduler", out: SchedulerOutput, budget: int) -> int:
    """Schedule waiting requests into ``out`` in FCFS order; requests that cannot run now keep
    their place at the front of the queue.

    Once a request is blocked on free blocks, later requests that need no prefix lookup because
    they already hold their blocks (KV loaded from elsewhere) may still go ahead: otherwise they
    could hold the very blocks the blocked request waits for.

    Args:
        budget: tokens left in this step (``max_num_batched_tokens`` minus those scheduled).

    Returns:
        The tokens left in the budget.
    """
    skipped: list[Request] = []
    blocked = False
    while sched.waiting and budget > 0:
        if len(sched.running) >= sched.max_num_seqs:
            break
        if blocked and not any(r.block_ids for r in sched.waiting):
            break
        req = sched.waiting.popleft()
        if blocked and not req.block_ids:
            skipped.append(req)
            continue
        status = try_schedule_waiting(sched, req, out, budget)
        if status is Admission.SCHEDULED:
            budget -= len(out.scheduled[-1].token_ids)
        elif status in (Admission.SKIP, Admission.BLOCKED):
            blocked = blocked or status is Admission.BLOCKED
            skipped.append(req)
    sched.waiting.extendleft(reversed(skipped))
    return budget


def try_schedule_waiting(sched: "Scheduler", req: Request, out: SchedulerOutput, budget: int) -> Admission:
    """Schedule one waiting request (taken off the waiting queue by the caller), within
    ``budget`` tokens; see :class:`Admission` for the outcomes."""
    kvm = sched.kv_cache_manager
    remote_kv = sched.remote_kv
    computed_blocks: list[int] = []
    num_local = 0
    num_external = 0
    load_async = False
    fresh = not req.block_ids and req.num_computed_tokens == 0
    if fresh:
        computed_blocks, num_local = kvm.get_computed_blocks(req)
        num_external, load_async = remote_kv.num_matched_tokens(req, num_local)

    if load_async:
        if kvm.allocate_slots(req, num_external, computed_blocks) is None:
            return Admission.BLOCKED
        req.num_computed_tokens = num_local
        _record_cached(sched, req, num_local)
        remote_kv.start_async_load(req, num_local, num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        sched.waiting_for_remote[req.request_id] = req
        return Admission.REMOTE

    # Tokens whose KV will exist before this step's forward pass (cache hit + sync load);
    # at least one token is always computed, for the logits.
    start = min(num_local + num_external, req.num_tokens - 1) if fresh else req.num_computed_tokens
    num_new = min(req.num_tokens - start, budget)
    if num_new <= 0:
        return Admission.SKIP
    room = (start - num_local + num_new) if fresh else num_new
    if kvm.allocate_slots(req, room, computed_blocks) is None:
        return Admission.BLOCKED
    if fresh:
        remote_kv.blocks_allocated(req, num_local, num_external, start)
        _record_cached(sched, req, num_local)
        req.num_computed_tokens = start
    req.status = RequestStatus.RUNNING
    sched.running.append(req)
    sched.add_scheduled(out, req, num_new)
    return Admission.SCHEDULED


def _record_cached(sched: "Scheduler", req: Request, num_local: int) -> None:
    if req.num_cached_tokens < 0:  # first scheduling only
        req.num_cached_tokens = num_local
        sched.prompt_tokens_cached_total += min(num_local, req.num_prompt_tokens)
