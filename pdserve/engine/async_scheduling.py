"""Async scheduling (``--async-scheduling``): step n+1 is scheduled and launched before the host
reads step n's tokens. Pure bookkeeping: no torch.

One async step of the engine core (:meth:`pdserve.engine.core.EngineCore._async_step`;
docs/architecture.md, "Async scheduling")::

    step n is running on the device (launched by the previous call, or now when none is)
    sched_out_{n+1} = scheduler.schedule_async(sched_out_n)      # host work, device busy
    pending_{n+1} = runner.execute_async(sched_out_{n+1})        # input tokens of decodes: step
                                                                 # n's samples, on the device
    runner_out_n = pending_n.result()                            # waits for step n only
    outputs = scheduler.update_from_output(sched_out_n, runner_out_n)  # tokens of step n

so on CUDA the device finds step n+1 queued when it finishes step n, and the host learns step
n's tokens one step later than the synchronous path does; every token is still sent as soon as
the host knows it.

:class:`AsyncSchedulingPolicy` (behind ``Scheduler.schedule_async``) is the
:class:`~pdserve.engine.scheduler.Scheduler`'s policy (its module docstring) applied to the
state the scheduler *will* have once step n is committed, without knowing step n's sampled
tokens:

- a request sampled in step n has one more token than the host knows; step n+1 decodes it from a
  placeholder (:attr:`ScheduledRequest.input_from_previous_step`), the runner feeding step n's
  sampled token on the device;
- a request whose step-n token certainly finishes it (``max_tokens`` or ``max_model_len``
  reached) is left out; one that may finish on EOS or a stop token is scheduled, and if it does
  finish (or is aborted), step n+1's token for it is dropped at commit (the request is no longer
  running) and its blocks stay held until step n+1 is done
  (:meth:`KVCacheManager.set_in_flight`), so no KV write of that step lands in a block already
  given to another request or to a KV load;
- a chunked prefill continues after step n's chunk.

Correctness is the synchronous path's: greedy and seeded tokens are the same (a seeded draw
depends on ``(seed, output position)`` only).

Steps that run synchronously (nothing overlaps them; the pipeline drains first, and the next
step is scheduled only after this one's commit):

- multi-step rounds (``--num-scheduler-steps`` > 1: once every running request decodes and
  nothing waiting could join, the synchronous scheduler decides) and connector polls with an
  empty batch;
- a step after one whose tokens the next needs on the host, or that only the synchronous
  scheduler can build (:meth:`AsyncSchedulingPolicy.schedule_next` returns None): presence /
  frequency / repetition penalties of a request still decoding, a running request that needs
  preemption (no free block), a synchronous KV load in the running step (its failure policy
  may rewind the request);
- within the runner, a batch with ``logprobs`` or penalties samples on the host (its tokens are
  read back at launch), so that step overlaps the scheduling of the next one but the host waits
  for it.
"""

from __future__ import annotations

from pdserve.engine.admission import Admitter
from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.multi_step import MultiStepRounds
from pdserve.engine.remote_kv import RemoteKV
from pdserve.engine.request_queues import RequestQueues, scheduled_request
from pdserve.types.outputs import SchedulerOutput
from pdserve.types.request import Request


class AsyncSchedulingPolicy:
    """Schedules step n+1 while step n runs (see the module docstring).

    Args:
        queues: the scheduler's waiting and running requests.
        kv_cache_manager: the engine's block manager.
        remote_kv: the scheduler's remote-KV state (synchronous loads of the running step).
        admitter: admits waiting requests, as in a synchronous step.
        multi_step: multi-step rounds (a step a round may follow is scheduled synchronously).
        max_num_batched_tokens / max_model_len: the scheduler's limits.
    """

    def __init__(self, queues: RequestQueues, kv_cache_manager: KVCacheManager, remote_kv: RemoteKV,
                 admitter: Admitter, multi_step: MultiStepRounds, max_num_batched_tokens: int,
                 max_model_len: int):
        self.queues = queues
        self.kv_cache_manager = kv_cache_manager
        self.remote_kv = remote_kv
        self.admitter = admitter
        self.multi_step = multi_step
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len

    def finishes_by_length(self, req: Request) -> bool:
        """True when the token ``req`` samples in the step now running certainly finishes it
        (``max_tokens`` or ``max_model_len`` reached, whatever the token is)."""
        num_output_tokens = len(req.output_token_ids)
        return (num_output_tokens + 1 >= req.sampling_params.max_tokens
                or req.num_prompt_tokens + num_output_tokens + 1 >= self.max_model_len)

    def schedule_next(self, running_step: SchedulerOutput) -> SchedulerOutput | None:
        """Step n+1 given ``running_step`` (step n), launched but not yet committed, or None
        when it must be scheduled synchronously after step n's commit (see the module
        docstring).

        Running requests come first (those not in step n, then continuing ones, decodes before
        prefills, as :meth:`Scheduler.schedule` orders them), then waiting ones
        (:meth:`~pdserve.engine.admission.Admitter.admit_waiting`). Blocks allocated before a
        None return stay with their requests, for their next steps.

        Returns:
            Step n+1, not yet closed (no finished ids, no connector metadata), or None.
        """
        if (running_step.num_steps > 1 or self.remote_kv.sync_loads
                or self.multi_step.may_follow(running_step)):
            return None
        in_step = {sr.request_id: sr for sr in running_step.scheduled}
        # (request, first position to compute, tokens known to the host + in flight, whether the
        # last of those is in flight); decodes first, then prefills, each in running order
        decodes: list[tuple[Request, int, int, bool]] = []
        prefills: list[tuple[Request, int, int, bool]] = []
        for req in self.queues.running:
            sr = in_step.get(req.request_id)
            start = req.num_computed_tokens
            total = req.num_tokens
            pending = False
            if sr is not None:
                start += len(sr.token_ids)
                if sr.sample:
                    if self.finishes_by_length(req):
                        continue
                    if req.sampling_params.uses_penalties:
                        return None
                    pending = True
                    total += 1
            if start >= total:
                continue
            (prefills if start < req.num_prompt_tokens else decodes).append((req, start, total, pending))

        sched_out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        kvm = self.kv_cache_manager
        for req, start, total, pending in decodes + prefills:
            if budget <= 0:
                break
            num_new = min(total - start, budget)
            # room for the in-flight step's tokens too: num_computed_tokens is not advanced yet
            if kvm.allocate_slots(req, start - req.num_computed_tokens + num_new) is None:
                return None  # preemption: only the synchronous path preempts
            sched_out.scheduled.append(scheduled_request(req, start, num_new, total, pending))
            budget -= num_new
        budget = self.admitter.admit_waiting(sched_out, budget)
        if not sched_out.scheduled:
            return None
        sched_out.total_num_scheduled_tokens = self.max_num_batched_tokens - budget
        return sched_out


def launch_phase(step: SchedulerOutput) -> str:
    """The phase-trace name of launching ``step``: ``core.launch_prefill`` when it computes a
    prompt chunk (more than one token of a request), else ``core.launch``."""
    prefill = any(len(sr.token_ids) > 1 for sr in step.scheduled)
    return "core.launch_prefill" if prefill else "core.launch"
