"""The engine core's step with overlapped (asynchronous) scheduling: step n+1 is scheduled and
launched before the host reads step n's tokens. Pure bookkeeping: no torch.

One call of :meth:`OverlappedSteps.step` (``--async-scheduling``, docs/architecture.md,
"Overlapped scheduling")::

    step n is running on the device (launched by the previous call, or now when none is)
    sched_{n+1} = schedule_overlapped(scheduler, sched_n)      # host work, device busy
    pending_{n+1} = runner.execute_async(sched_{n+1})           # input tokens of decodes: step
                                                                # n's samples, on the device
    out_n = pending_n.result()                                  # waits for step n only
    outputs = scheduler.update_from_output(sched_n, out_n)      # tokens of step n, stop checks

so on CUDA the device finds step n+1 queued when it finishes step n, and the host learns step
n's tokens one step later than the synchronous path does; every token is still sent as soon as
the host knows it.

Correctness is the synchronous path's: greedy and seeded tokens are the same (a seeded draw
depends on ``(seed, output position)`` only), ``max_tokens`` / ``max_model_len`` finishes are
known ahead and such requests are left out of step n+1; a request that stops on EOS or a stop
token at step n (or is aborted) had a token computed in step n+1 that is dropped at commit, and
its blocks stay held until step n+1 is done (:meth:`KVCacheManager.set_in_flight`), so no KV
write of that step lands in a block already given to another request or to a KV load.

Steps that run synchronously (nothing overlaps them; the pipeline drains first, and the next
step is scheduled only after this one's commit):

- multi-step rounds (``--num-scheduler-steps`` > 1) and connector polls with an empty batch;
- a step after one whose tokens the next needs on the host, or that only the synchronous
  scheduler can build (:func:`~pdserve.engine.overlap_schedule.schedule_overlapped` returns
  None): presence / frequency / repetition penalties of a request still decoding, a running
  request that needs preemption (no free block), a synchronous KV load in the running step;
- within the runner, a batch with ``logprobs`` or penalties samples on the host (its tokens are
  read back at launch), so that step overlaps the scheduling of the next one but the host waits
  for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.utils import phase_trace
from pdserve.types.outputs import EngineCoreOutput, ModelRunnerOutput, PendingStep, SchedulerOutput
from pdserve.engine.overlap_schedule import schedule_overlapped

if TYPE_CHECKING:
    from pdserve.engine.scheduler import Scheduler


def launch_phase(step: SchedulerOutput) -> str:
    """The phase-trace name of launching ``step``: ``core.launch_prefill`` when it computes a
    prompt chunk (more than one token of a request), else ``core.launch``."""
    prefill = any(len(sr.token_ids) > 1 for sr in step.scheduled)
    return "core.launch_prefill" if prefill else "core.launch"


class OverlappedSteps:
    """Runs engine steps two deep: at most one launched step whose tokens the host has not
    read while it schedules and launches the next.

    Args:
        scheduler: the engine's scheduler.
        runner: a model runner with ``execute(sched) -> ModelRunnerOutput`` and
            ``execute_async(sched) -> PendingStep``.
    """

    def __init__(self, scheduler: "Scheduler", runner: Any):
        self.scheduler = scheduler
        self.runner = runner
        self._running: tuple[SchedulerOutput, PendingStep] | None = None

    @property
    def in_flight(self) -> bool:
        """True while a launched step's results are not committed (the core must step again)."""
        return self._running is not None

    def step(self) -> tuple[list[EngineCoreOutput], bool, ModelRunnerOutput | None]:
        """One engine step (see the module docstring).

        Returns:
            ``(outputs, computed, runner_output)``: the committed step's per-request deltas,
            whether any token was computed, and its runner output (None when nothing ran).
        """
        sched = self.scheduler
        if self._running is None:
            first = sched.schedule()
            if not first.scheduled and not first.finished_request_ids and not sched.has_pending_kv_work():
                return [], False, None
            if not first.scheduled or first.num_steps > 1:
                out = self.runner.execute(first)
                return sched.update_from_output(first, out), bool(first.scheduled), out
            self._launch(first, None)
        running, pending = self._running
        nxt = schedule_overlapped(sched, running)
        self._running = None
        launched: frozenset[str] = frozenset()
        if nxt is not None:
            launched = self._launch(nxt, running)
        out = pending.result()
        phase_trace.mark("core.result")
        outputs = sched.update_from_output(running, out)
        sched.kv_cache_manager.set_in_flight(launched)
        return outputs, True, out

    def _launch(self, step: SchedulerOutput, running: SchedulerOutput | None) -> frozenset[str]:
        """Launch ``step``; the blocks of its requests and of ``running``'s stay held until they
        are known to be done. Returns the ids of ``step``'s requests."""
        if phase_trace.enabled():
            phase_trace.mark(launch_phase(step))
        ids = frozenset([sr.request_id for sr in step.scheduled])
        held = ids if running is None else ids.union([sr.request_id for sr in running.scheduled])
        self.scheduler.kv_cache_manager.set_in_flight(held)
        self._running = (step, self.runner.execute_async(step))
        return ids
