"""Multi-step scheduling (``num_scheduler_steps > 1``): rounds of several decode steps run back
to back for every running request, and their commit. Pure bookkeeping: no torch.

A round saves the scheduling and host round trips between decode steps when nothing on the
host can change the batch in between; the :class:`~pdserve.engine.scheduler.Scheduler` asks
:func:`schedule_multi_step` first on every step and falls back to a single step when it returns
None.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.types.outputs import EngineCoreOutput, SchedulerOutput
from pdserve.types.request import Request, RequestStatus

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


def schedule_multi_step(sched: "Scheduler") -> SchedulerOutput | None:
    """A round of up to ``num_scheduler_steps`` decode steps for every running request, or
    None when this step must be scheduled normally.

    Only when every running request is a plain decode (one token to compute, nothing waiting
    that could be admitted, no KV transfer or lease pending, and no request whose next tokens
    depend on host-side state: penalties, logprobs, ``min_tokens`` not yet reached). The round
    is shortened so that no position passes ``max_model_len``; each request gets blocks for all
    its tokens up front (none are preempted for this: if the blocks are short, the step is
    scheduled normally). A request that stops inside the round keeps only the tokens up to its
    stop (see :func:`commit_multi_step`); the rest of its round was wasted GPU work.

    Returns:
        The round (``num_steps`` > 1, one scheduled token per request), or None.
    """
    running = sched.running
    if not running or len(running) > sched.max_num_batched_tokens:
        return None
    if sched.waiting and len(running) < sched.max_num_seqs:
        return None
    if sched.waiting_for_remote or sched.has_pending_kv_work():
        return None
    steps = sched.num_scheduler_steps
    for req in running:
        if req.num_computed_tokens != req.num_tokens - 1 or req.num_computed_tokens < req.num_prompt_tokens:
            return None
        sp = req.sampling_params
        if (sp.logprobs is not None or sp.repetition_penalty != 1.0 or sp.presence_penalty != 0.0
                or sp.frequency_penalty != 0.0 or req.num_output_tokens < sp.min_tokens):
            return None
        steps = min(steps, sched.max_model_len - req.num_computed_tokens)
    if steps <= 1:
        return None
    kvm = sched.kv_cache_manager
    for req in running:
        if kvm.allocate_slots(req, steps) is None:
            return None  # blocks given to earlier requests stay theirs, for later steps
    out = SchedulerOutput(num_steps=steps)
    for req in running:
        sched.add_scheduled(out, req, 1)
    out.total_num_scheduled_tokens = len(running) * steps
    return sched.close_step(out)


def commit_multi_step(sched: "Scheduler", req: Request, tokens: list[int] | None) -> EngineCoreOutput:
    """Commit a multi-step round of one request: its tokens in order up to the first that
    stops it; every kept token but a final stopping one had its KV computed.

    Args:
        tokens: the round's sampled tokens of ``req``, in step order (None or empty: the
            runner sampled nothing, and the request fails).
    """
    if not tokens:
        sched.running.remove(req)
        return sched.finish(req, RequestStatus.FINISHED_ERROR, "the model runner sampled no token")
    kept: list[int] = []
    for token in tokens:
        req.num_computed_tokens += 1
        kept.append(token)
        status, stop_reason = sched.accept_token(req, token)
        if status is not None:
            sched.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
            return sched.finish_with_tokens(req, status, stop_reason, kept, [])
    sched.kv_cache_manager.cache_blocks(req, req.num_computed_tokens)
    return sched.output(req, kept, None)
