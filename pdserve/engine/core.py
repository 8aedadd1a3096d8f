"""The engine core: scheduler + model runner (+ KV connector) of one instance, stepped by a loop.

:class:`EngineCore` is usable in-process (:class:`pdserve.engine.llm_engine.LLMEngine`, tests);
the separate engine-core process that :class:`pdserve.engine.async_engine.AsyncEngine` spawns
runs it in the loop of :mod:`pdserve.engine.core_loop`. The class owns the engine's resources
(scheduler, runner, connector sides, KV-event publisher), their start-up order, the loop's wait
deadlines and their shutdown, and runs its steps: one at a time, or two deep with async
scheduling (``--async-scheduling``; what to schedule next while a step runs is the scheduler's
:mod:`pdserve.engine.async_scheduling`).

The start-up pieces that need no core (``max_model_len``, the connector sides, the KV cache
tiers) are :mod:`pdserve.engine.core_setup`; the rest is one class.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

from pdserve.utils import phase_trace
from pdserve.types.engine_config import EngineConfig
from pdserve.engine.async_scheduling import launch_phase
from pdserve.engine.executor_interface import Executor, ExecutorFactory
from pdserve.types.core_messages import AddRequest
from pdserve.engine.kv_events import KVEventPublisher
from pdserve.types.kv_events import default_snapshot_endpoint
from pdserve.types.outputs import EngineCoreOutput, ModelRunnerOutput, PendingStep, SchedulerOutput
from pdserve.types.request import Request
from pdserve.engine.core_setup import build_tiers, create_connectors, resolve_max_model_len
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.step_waiter import StepWaiter

logger = logging.getLogger(__name__)

# Seconds the core loop waits for input between connector polls while only KV transfers are
# pending (keeps transfer latency low without spinning a core), and while fully idle.
KV_POLL_INTERVAL_S = 0.001
IDLE_POLL_INTERVAL_S = 0.5


class EngineCore:
    """Scheduler, KV cache manager, model runner and (optional) KV connector of one instance.

    Args:
        config: the engine configuration.
        make_executor: builds the executor that runs the model (called once, after the
            connector sides exist): :func:`pdserve.executor.create_executor` in the engine-core
            process and :class:`~pdserve.engine.llm_engine.LLMEngine`; tests pass fakes
            (:mod:`pdserve.engine.executor_interface`).
        connectors: ``(scheduler_side, worker_side)`` to use instead of creating them from
            ``config.kv_transfer_config`` (tests inject fakes).

    Attributes:
        model_info: the runner's ``ModelInfo``.
        num_blocks: KV cache blocks.
        max_model_len: effective max sequence length (tokens).
        config: ``config`` with ``max_model_len`` resolved.
        scheduler: the :class:`Scheduler`.
        emit: None, or a callable that sends outputs at once; the core loop sets it so that
            outputs known at a step's launch (a prefiller's first token, an ended KV load) go
            out before the host waits for the running step (:meth:`_async_step`).

    Raises:
        ValueError / RuntimeError / OSError: the model or the configuration cannot be used (the
            message says why).
    """

    def __init__(self, config: EngineConfig, make_executor: ExecutorFactory,
                 connectors: tuple[Any, Any] | None = None):
        # The connector sides come first: a missing NIXL backend or a side-channel port in use
        # is then reported in a second, not after the model has loaded. Neither side needs the
        # runner until register_kv_cache below.
        if connectors is None and config.kv_transfer_config is not None:
            connectors = create_connectors(config.kv_transfer_config, config)
        self.runner: Executor | None = None
        try:
            self._build(config, make_executor, connectors)
        except BaseException:
            # the runner too: at TP > 1 it owns worker processes that must not outlive us
            for part in (*(connectors or ()), self.runner):
                if part is None:
                    continue
                try:
                    part.shutdown()
                except Exception:  # already failing: keep the first error
                    logger.exception("error while shutting down %s", type(part).__name__)
            raise

    def _build(self, config: EngineConfig, make_executor: ExecutorFactory,
               connectors: tuple[Any, Any] | None) -> None:
        runner = make_executor(config)
        self.runner = runner
        self.model_info = runner.model_info
        self.num_blocks = int(runner.determine_num_blocks())
        if self.num_blocks < 1:
            raise ValueError("no memory left for the KV cache (0 blocks)")
        self.max_model_len = resolve_max_model_len(
            config, self.model_info.max_position_embeddings, self.num_blocks
        )
        self.config = dataclasses.replace(config, max_model_len=self.max_model_len)
        runner.allocate_kv_cache(self.num_blocks)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d; prefix caching %s",
            self.num_blocks, config.block_size, self.num_blocks * config.block_size,
            self.max_model_len,
            f"on ({config.prefix_cache_eviction.value} eviction)"
            if config.enable_prefix_caching else "off",
        )
        self.connector = None
        self.connector_worker = None
        if connectors is not None:
            self.connector, self.connector_worker = connectors
            if self.connector_worker is None:  # TP > 1: rank 0's, created by the executor
                self.connector_worker = runner.connector_worker
            self.connector_worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)
            runner.set_kv_connector_worker(self.connector_worker)
        # TP 1: the only worker side is in this process (_bind_early)
        self._bind_at_once = connectors is not None and config.tensor_parallel_size == 1
        self.eos_token_ids = list(self.model_info.eos_token_ids or [])
        self.tiers = build_tiers(config, runner, self.num_blocks)
        self.scheduler = Scheduler(
            self.config, self.num_blocks, self.connector, eos_token_ids=self.eos_token_ids,
            tiers=self.tiers,
        )
        self._connector_stats: list[dict[str, Any]] = []
        # --async-scheduling: steps two deep (_async_step); TP ranks run synchronous steps only.
        self.async_scheduling = config.async_scheduling
        if config.async_scheduling and config.tensor_parallel_size > 1:
            logger.info("tensor parallelism: engine steps run synchronously "
                        "(--async-scheduling applies at TP 1)")
            self.async_scheduling = False
        # The launched step whose tokens the host has not read (async scheduling).
        self._running: tuple[SchedulerOutput, PendingStep] | None = None
        # Sends outputs known before a step's tokens (the core loop sets it; _async_step).
        self.emit: Callable[[list[EngineCoreOutput]], None] | None = None
        # Reads a launched step while the connector's answers are watched (_read_step).
        self._waiter: StepWaiter | None = None
        # KV events (--kv-events-endpoint): the block manager records, the publisher sends.
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint:
            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_snapshot_endpoint
                or default_snapshot_endpoint(config.kv_events_endpoint),
                config.block_size)
            self.scheduler.kv_cache_manager.enable_events()
            if self.tiers is not None:
                self.tiers.enable_events()

    # ---------------------------------------------------------------- requests
    def add_request(self, msg: AddRequest) -> EngineCoreOutput | None:
        """Queue a request.

        Returns:
            None when queued, else a finished output with ``finish_reason="error"`` saying why
            the request was rejected (the front end validates first; this is the last line).
        """
        eos = msg.eos_token_id
        if eos is None and self.eos_token_ids:
            eos = self.eos_token_ids[0]
        req = Request(
            request_id=msg.request_id,
            prompt_token_ids=list(msg.prompt_token_ids),
            sampling_params=msg.sampling_params,
            eos_token_id=eos,
            kv_transfer_params=msg.kv_transfer_params,
        )
        try:
            msg.sampling_params.validate()
            vocab = self.model_info.vocab_size
            bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
            self.scheduler.add_request(req)
        except ValueError as e:
            return EngineCoreOutput(
                request_id=msg.request_id,
                finish_reason="error",
                num_prompt_tokens=req.num_prompt_tokens,
                error=str(e),
            )
        self._bind_early()  # a pull's early claim
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def release_early(self, request_id: str, block_ids: list[int]) -> None:
        """The proxy's early release of blocks held for a remote reader that will not read
        them: the connector's scheduler side ends the hold if it is of exactly ``block_ids``
        (:meth:`~pdserve.kv_transfer.base.KVConnectorSchedulerSide.release_early`); no-op
        without a connector."""
        if self.connector is not None:
            self.connector.release_early(request_id, block_ids)

    # ---------------------------------------------------------------- stepping
    def has_work(self) -> bool:
        """True when a step could make progress or the connector needs polling."""
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_work()
                or self.step_in_flight)

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One engine step: schedule, execute, commit.

        When nothing is schedulable but KV transfers, notifications or leases are pending (or
        finished requests must be reported to the runner), the runner still executes an empty
        batch so the connector gets polled.

        With ``--async-scheduling`` the step is :meth:`_async_step`: the outputs are those of the
        step launched one call earlier.

        Returns:
            ``(outputs, computed)``: per-request deltas and whether any token was computed.
        """
        if self.async_scheduling:
            outputs, computed, runner_out = self._async_step()
        else:
            sched_out = self.scheduler.schedule()
            if (not sched_out.scheduled and not sched_out.finished_request_ids
                    and sched_out.kv_tier_jobs is None
                    and not self.scheduler.has_pending_kv_work()):
                return [], False
            if sched_out.scheduled and phase_trace.enabled():
                phase_trace.mark(launch_phase(sched_out))
            runner_out = self.runner.execute(sched_out)
            if sched_out.scheduled:
                phase_trace.mark("core.result")
            outputs = self.scheduler.update_from_output(sched_out, runner_out)
            self._bind_early()
            computed = bool(sched_out.scheduled)
        kv_out = runner_out.kv_connector_output if runner_out is not None else None
        if kv_out is not None and kv_out.stats:
            self._connector_stats.append(kv_out.stats)
        return outputs, computed

    @property
    def step_in_flight(self) -> bool:
        """True while a launched step's results are not committed (the core must step again)."""
        return self._running is not None

    def _async_step(self) -> tuple[list[EngineCoreOutput], bool, ModelRunnerOutput | None]:
        """One step two deep: at most one launched step whose tokens the host has not read
        while the core schedules and launches the next::

            sched_out_{n+1} = scheduler.schedule_async(sched_out_n)   # host work, device busy
            launch(sched_out_{n+1})
            early = scheduler.apply_reports(<step n+1's launch reports>)   # sent at once
            outputs = scheduler.commit_step(sched_out_n, runner_out_n)     # tokens of step n

        A launched step's connector and tier reports are taken on the host at its launch and do
        not depend on its device work, so they are applied then: a prefiller's first token or
        an ended KV load reported at a launch goes out (through :attr:`emit`, when set) before
        the host waits for step n, instead of a step later with step n+1's tokens. A step with
        nothing to compute, or a multi-step round, runs synchronously.

        Returns:
            ``(outputs, computed, runner_out)``: the committed step's per-request deltas (and
            those of the reports when there is no :attr:`emit`), whether any token was
            computed, and its runner output (None when nothing ran).
        """
        scheduler = self.scheduler
        early: list[EngineCoreOutput] = []
        if self._running is None:
            first = scheduler.schedule()
            if (not first.scheduled and not first.finished_request_ids
                    and first.kv_tier_jobs is None and not scheduler.has_pending_kv_work()):
                return [], False, None
            if not first.scheduled or first.num_steps > 1:
                runner_out = self.runner.execute(first)
                outputs = scheduler.update_from_output(first, runner_out)
                self._bind_early()
                return outputs, bool(first.scheduled), runner_out
            self._launch(first, None)
            early += self._apply_launch_reports(self._running[1])
        running, pending = self._running
        nxt = scheduler.schedule_async(running)
        self._running = None
        launched: frozenset[str] = frozenset()
        if nxt is not None:
            launched = self._launch(nxt, running)
            early += self._apply_launch_reports(self._running[1])
        if early and self.emit is not None:
            self.emit(early)
            early = []
        runner_out = self._read_step(pending)
        phase_trace.mark("core.result")
        outputs = early + scheduler.commit_step(running, runner_out)
        scheduler.kv_cache_manager.set_in_flight(launched)
        self._bind_early()
        return outputs, True, runner_out

    def _read_step(self, pending: PendingStep) -> ModelRunnerOutput:
        """``pending.result()``; at TP 1, while the connector waits for an answer that brings
        the scheduler something to send (a prefiller's first token), its wake-ups are watched
        too and a report taken when one comes is applied and sent at once (:attr:`emit`),
        instead of at the next launch (:mod:`pdserve.engine.step_waiter`)."""
        worker = self.connector_worker
        if not self._bind_at_once or self.emit is None or not worker.expects_answer():
            return pending.result()
        if self._waiter is None:
            self._waiter = StepWaiter()
        return self._waiter.wait(pending, worker.wakeup_handles, self._apply_answer)

    def _apply_answer(self) -> bool:
        """A connector wake-up while a step runs: take the worker's report, apply it and send
        what it brings; returns whether the worker still waits for such an answer."""
        worker = self.connector_worker
        worker.handle_wakeup()
        kv_out = worker.get_finished(set())
        if kv_out.stats:
            self._connector_stats.append(kv_out.stats)
        early = self.scheduler.apply_reports(kv_out, None)
        if early:
            self.emit(early)
        return worker.expects_answer()

    def _apply_launch_reports(self, step: PendingStep) -> list[EngineCoreOutput]:
        """Apply a just-launched step's connector and tier reports (:meth:`_async_step`)."""
        return self.scheduler.apply_reports(step.kv_connector_output, step.kv_tier_report)

    def _bind_early(self) -> None:
        """TP 1: give the worker side now what need not wait for the next step (the holds of
        the requests the committed step finished, whose KV it computed, and arrivals' pull
        claims: :meth:`~pdserve.kv_transfer.base.KVConnectorSchedulerSide.take_early_metadata`)."""
        if self._bind_at_once:
            early = self.connector.take_early_metadata()
            if early is not None:
                self.connector_worker.bind_connector_metadata(early)

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

    def wait_timeout_s(self, progressed: bool) -> float:
        """Seconds the core loop may block waiting for input or a connector wake-up before it
        must step again.

        0 after a step that computed tokens, after a step in which a KV load finished (its
        request can be scheduled now), or while finished requests or connector metadata wait
        to be delivered; :data:`KV_POLL_INTERVAL_S` while requests wait for blocks or a
        batch slot; while only KV work is pending, the connector worker's ``next_poll_in()``
        (it wakes the loop itself through :meth:`wakeup_handles` for everything else), or
        the base class default of one :data:`KV_POLL_INTERVAL_S` tick; otherwise
        :data:`IDLE_POLL_INTERVAL_S`. Never later than the connector worker's periodic summary
        line (``next_stats_log_in()``), which the loop writes whether or not it steps.
        """
        wait = self._step_wait_s(progressed)
        if self.connector_worker is not None:
            log_in = self.connector_worker.next_stats_log_in()
            if log_in is not None:
                wait = min(wait, max(0.0, log_in))
        return wait

    def _step_wait_s(self, progressed: bool) -> float:
        scheduler = self.scheduler
        if progressed or scheduler.finished_request_ids or scheduler.loaded_since_schedule:
            return 0.0
        if scheduler.has_pending_tier_work():  # copies in flight: see them end soon
            return KV_POLL_INTERVAL_S
        if self.connector is not None and self.connector.has_pending_metadata():
            return 0.0
        if scheduler.queues.waiting or scheduler.queues.running:
            return KV_POLL_INTERVAL_S
        if not self.has_work():
            return IDLE_POLL_INTERVAL_S
        if self.connector_worker is None:
            return KV_POLL_INTERVAL_S
        wait = self.connector_worker.next_poll_in()
        return IDLE_POLL_INTERVAL_S if wait is None else max(0.0, min(wait, IDLE_POLL_INTERVAL_S))

    def wakeup_handles(self) -> list[Any]:
        """ZMQ sockets / file descriptors the core loop polls besides its input socket (the
        connector worker's ``wakeup_handles()``; empty without one)."""
        if self.connector_worker is None:
            return []
        return list(self.connector_worker.wakeup_handles())

    def handle_wakeup(self) -> None:
        """One of :meth:`wakeup_handles` became readable: let the worker consume it."""
        if self.connector_worker is not None:
            self.connector_worker.handle_wakeup()

    def log_connector_stats(self) -> None:
        """Let the connector worker write its periodic summary line if it is due (called every
        loop iteration, also when the engine is idle)."""
        if self.connector_worker is not None:
            self.connector_worker.log_stats()

    def publish_kv_events(self) -> None:
        """Publish the prefix-cache changes of the last step as one batch (a heartbeat when
        there were none and one is due); no-op without ``--kv-events-endpoint``."""
        if self.kv_events is not None:
            events = self.scheduler.kv_cache_manager.take_events()
            if self.tiers is not None:
                events += self.tiers.take_events()
            self.kv_events.publish(events)

    def serve_kv_snapshot(self) -> None:
        """Answer a pending KV events snapshot request (its socket is readable)."""
        if self.kv_events is not None:
            self.kv_events.serve_snapshot(
                self.scheduler.kv_cache_manager.cached_block_hashes(),
                self.tiers.snapshot() if self.tiers is not None else {})

    def take_connector_stats(self) -> list[dict[str, Any]]:
        """Connector stats deltas collected since the last call."""
        stats, self._connector_stats = self._connector_stats, []
        return stats

    def stats(self) -> dict[str, Any]:
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Stop the connector and release the runner (idempotent)."""
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self._waiter is not None:
            self._waiter.close()
            self._waiter = None
        for part in (self.connector, self.connector_worker, self.runner):
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception:  # shutting down: log and keep releasing the rest
                logger.exception("error while shutting down %s", type(part).__name__)
        self.connector = self.connector_worker = None
