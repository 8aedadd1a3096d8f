"""Scheduling step n+1 while step n is still running (overlapped scheduling). Pure bookkeeping:
no torch.

:func:`schedule_overlapped` is the :class:`~pdserve.engine.scheduler.Scheduler`'s policy (its
module docstring) applied to the state the scheduler *will* have once step n is committed,
without knowing step n's sampled tokens:

- a request sampled in step n has one more token than the host knows; step n+1 decodes it from a
  placeholder (:attr:`ScheduledRequest.input_from_previous_step`), the runner feeding step n's
  sampled token on the device;
- a request whose step-n token certainly finishes it (``max_tokens`` or ``max_model_len``
  reached) is left out; one that may finish on EOS or a stop token is scheduled, and if it does
  finish, step n+1's token for it is dropped at commit (the request is no longer running) and
  its blocks stay held until step n+1 is done (:meth:`KVCacheManager.set_in_flight`);
- a chunked prefill continues after step n's chunk.

It returns None (the engine then waits for step n, commits it, and schedules synchronously)
whenever the overlapped step would need what only the synchronous path does: preemption (a
running request finds no free block), presence / frequency / repetition penalties for a request
whose last token is not known yet, or a synchronous KV load in step n (its failure policy may
rewind the request). Step n+1 is never a multi-step round: with ``num_scheduler_steps > 1``,
once every running request decodes and nothing waiting could join, the synchronous scheduler
decides (:func:`~pdserve.engine.multi_step.schedule_multi_step`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.engine.admission import admit_waiting
from pdserve.types.outputs import PLACEHOLDER_TOKEN, ScheduledRequest, SchedulerOutput
from pdserve.types.request import Request

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


def finishes_by_length(sched: "Scheduler", req: Request) -> bool:
    """True when the token ``req`` samples in the step now running certainly finishes it
    (``max_tokens`` or ``max_model_len`` reached, whatever the token is)."""
    num_output_tokens = len(req.output_token_ids)
    return (num_output_tokens + 1 >= req.sampling_params.max_tokens
            or req.num_prompt_tokens + num_output_tokens + 1 >= sched.max_model_len)


def schedule_overlapped(sched: "Scheduler", running_step: SchedulerOutput) -> SchedulerOutput | None:
    """Step n+1 given ``running_step`` (step n), launched but not yet committed, or None when
    it must be scheduled synchronously after step n's commit (see the module docstring).

    Running requests come first (those not in step n, then continuing ones, decodes before
    prefills, as :meth:`Scheduler.schedule` orders them), then waiting ones
    (:func:`~pdserve.engine.admission.admit_waiting`). Blocks allocated before a None return
    stay with their requests, for their next steps.
    """
    if running_step.num_steps > 1 or sched.remote_kv.sync_loads or _round_next(sched, running_step):
        return None
    in_step = {sr.request_id: sr for sr in running_step.scheduled}
    # (request, first position to compute, tokens known to the host + in flight, whether the
    # last of those is in flight); decodes first, then prefills, each in running order
    decodes: list[tuple[Request, int, int, bool]] = []
    prefills: list[tuple[Request, int, int, bool]] = []
    for req in sched.running:
        sr = in_step.get(req.request_id)
        start = req.num_computed_tokens
        total = req.num_tokens
        pending = False
        if sr is not None:
            start += len(sr.token_ids)
            if sr.sample:
                if finishes_by_length(sched, req):
                    continue
                if req.sampling_params.uses_penalties:
                    return None
                pending = True
                total += 1
        if start >= total:
            continue
        (prefills if start < req.num_prompt_tokens else decodes).append((req, start, total, pending))

    out = SchedulerOutput()
    budget = sched.max_num_batched_tokens
    kvm = sched.kv_cache_manager
    for req, start, total, pending in decodes + prefills:
        if budget <= 0:
            break
        num_new = min(total - start, budget)
        # room for the in-flight step's tokens too: num_computed_tokens is not advanced yet
        if kvm.allocate_slots(req, start - req.num_computed_tokens + num_new) is None:
            return None  # preemption: only the synchronous path preempts
        out.scheduled.append(_scheduled(req, start, num_new, total, pending))
        budget -= num_new
    budget = admit_waiting(sched, out, budget)
    if not out.scheduled:
        return None
    out.total_num_scheduled_tokens = sched.max_num_batched_tokens - budget
    return sched.close_step(out)


def _round_next(sched: "Scheduler", running_step: SchedulerOutput) -> bool:
    """True when a multi-step round may follow ``running_step``: rounds are on, every running
    request decodes in it, no waiting request could be admitted, and nothing rules a round out
    (the conditions of :func:`~pdserve.engine.multi_step.schedule_multi_step`)."""
    if sched.num_scheduler_steps <= 1:
        return False
    if sched.waiting and len(sched.running) < sched.max_num_seqs:
        return False
    if sched.waiting_for_remote or sched.has_pending_kv_work():
        return False
    if len(running_step.scheduled) != len(sched.running):
        return False
    for sr in running_step.scheduled:
        sp = sr.sampling_params
        if (not sr.sample or len(sr.token_ids) != 1 or sp.logprobs is not None
                or sp.uses_penalties or sr.output_position() + 1 < sp.min_tokens):
            return False
    return True


def _scheduled(req: Request, start: int, num_new: int, total: int, pending: bool) -> ScheduledRequest:
    """``req``'s tokens ``start .. start + num_new - 1`` of ``total`` (known to the host plus
    the one in flight); with ``pending``, the one token is the placeholder of the output
    sampled by the running step."""
    return ScheduledRequest(
        request_id=req.request_id,
        token_ids=[PLACEHOLDER_TOKEN] if pending else req.token_ids(start, start + num_new),
        num_computed_tokens=start,
        block_ids=req.block_ids,
        sample=start + num_new == total,
        sampling_params=req.sampling_params,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=req.output_token_ids,
        eos_token_id=req.eos_token_id,
        input_from_previous_step=pending,
        num_output_tokens=len(req.output_token_ids) + 1 if pending else -1,
    )

