"""The engine core: scheduler + model runner (+ KV connector), stepped in a loop.

:class:`EngineCore` is usable in-process (:class:`pdserve.engine.llm_engine.LLMEngine`, tests);
:func:`run_engine_core` is the entry point of the separate engine-core process that
:class:`pdserve.engine.async_engine.AsyncEngine` spawns, speaking the protocol of
:mod:`pdserve.engine.messages` over ZMQ.

Why one module of about 520 lines: the class is the engine loop's one owner of its resources
(scheduler, runner, connector sides, KV-event publisher) and of their start-up order, wait
deadlines and shutdown; the process entry point next to it only wires sockets to those methods.
Splitting the loop from the resources it orders would spread one life cycle over two files.
The overlapped step (``--async-scheduling``) lives in :mod:`pdserve.engine.async_step`.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import signal
import time
import traceback
from typing import Any

from pdserve.config import EngineConfig
from pdserve.engine.async_step import OverlappedSteps
from pdserve.engine.messages import (
    AbortRequests,
    AddRequest,
    CoreAddresses,
    CoreFailed,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    Ping,
    Ready,
    Shutdown,
    StartupFailed,
    StepOutputs,
    make_encoder,
    make_input_decoder,
)
from pdserve.engine.kv_events import KVEventPublisher, default_snapshot_endpoint
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Seconds the core loop waits for input between connector polls while only KV transfers are
# pending (keeps transfer latency low without spinning a core), and while fully idle.
KV_POLL_INTERVAL_S = 0.001
IDLE_POLL_INTERVAL_S = 0.5
# Seconds between stats-only messages while the scheduler state changes without token output.
STATS_INTERVAL_S = 0.1


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int, num_blocks: int) -> int:
    """Effective ``max_model_len`` in tokens.

    Default: the model's ``max_position_embeddings``, capped (with a warning) at the KV cache
    capacity ``num_blocks * block_size`` so that a single request always fits.

    Raises:
        ValueError: an explicit ``max_model_len`` exceeds the model's positions or the KV cache.
    """
    capacity = num_blocks * config.block_size
    if config.max_model_len is None:
        if max_position_embeddings > capacity:
            logger.warning(
                "max_model_len defaults to the KV cache capacity, %d tokens (the model supports %d);"
                " give the cache more memory to serve longer sequences",
                capacity, max_position_embeddings,
            )
        return min(max_position_embeddings, capacity)
    if config.max_model_len < 1:
        raise ValueError(f"max_model_len must be at least 1, got {config.max_model_len}")
    if config.max_model_len > max_position_embeddings:
        raise ValueError(
            f"max_model_len ({config.max_model_len}) is larger than the model's "
            f"max_position_embeddings ({max_position_embeddings})"
        )
    if config.max_model_len > capacity:
        raise ValueError(
            f"max_model_len ({config.max_model_len} tokens) does not fit in the KV cache "
            f"({num_blocks} blocks x {config.block_size} = {capacity} tokens); lower "
            "--max-model-len or raise --kv-cache-memory / --gpu-memory-utilization"
        )
    return config.max_model_len


def _create_connectors(kv_transfer_config: Any, engine_config: EngineConfig) -> tuple[Any, Any]:
    """Both sides of the configured KV connector (scheduler side, worker side). At TP > 1 the
    worker side is None here: the executor creates one per rank, in the rank's process."""
    try:
        from pdserve.kv_transfer.factory import create_connector
    except ImportError as e:
        raise RuntimeError(f"a KV transfer config was given but no connector is available: {e}") from e
    scheduler_side = create_connector(kv_transfer_config, "scheduler", engine_config)
    if engine_config.tensor_parallel_size > 1:
        return scheduler_side, None
    return scheduler_side, create_connector(kv_transfer_config, "worker", engine_config)


class EngineCore:
    """Scheduler, KV cache manager, model runner and (optional) KV connector of one instance.

    Args:
        config: the engine configuration.
        runner: a model runner to use instead of building the executor of
            ``config.tensor_parallel_size`` ranks (:func:`pdserve.executor.create_executor`: the
            :class:`~pdserve.runner.model_runner.ModelRunner` at TP 1; tests inject fakes).
        connectors: ``(scheduler_side, worker_side)`` to use instead of creating them from
            ``config.kv_transfer_config`` (tests inject fakes).

    Attributes:
        model_info: the runner's ``ModelInfo``.
        num_blocks: KV cache blocks.
        max_model_len: effective max sequence length (tokens).
        config: ``config`` with ``max_model_len`` resolved.
        scheduler: the :class:`Scheduler`.

    Raises:
        ValueError / RuntimeError / OSError: the model or the configuration cannot be used (the
            message says why).
    """

    def __init__(self, config: EngineConfig, runner: Any = None, connectors: tuple[Any, Any] | None = None):
        # The connector sides come first: a missing NIXL backend or a side-channel port in use
        # is then reported in a second, not after the model has loaded. Neither side needs the
        # runner until register_kv_cache below.
        if connectors is None and config.kv_transfer_config is not None:
            connectors = _create_connectors(config.kv_transfer_config, config)
        self.runner = None
        try:
            self._build(config, runner, connectors)
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

    def _build(self, config: EngineConfig, runner: Any, connectors: tuple[Any, Any] | None) -> None:
        if runner is None:
            from pdserve.executor import create_executor

            runner = create_executor(config)
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
            "KV cache: %d blocks x %d tokens = %d tokens; max_model_len %d",
            self.num_blocks, config.block_size, self.num_blocks * config.block_size, self.max_model_len,
        )
        self.connector = None
        self.connector_worker = None
        if connectors is not None:
            self.connector, self.connector_worker = connectors
            if self.connector_worker is None:  # TP > 1: rank 0's, created by the executor
                self.connector_worker = runner.connector_worker
            self.connector_worker.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)
            runner.set_kv_connector_worker(self.connector_worker)
        self.eos_token_ids = list(self.model_info.eos_token_ids or [])
        self.scheduler = Scheduler(
            self.config, self.num_blocks, self.connector, eos_token_ids=self.eos_token_ids
        )
        self._connector_stats: list[dict[str, Any]] = []
        # --async-scheduling: steps two deep (pdserve/engine/async_step.py); TP ranks run
        # synchronous steps only.
        self.overlap: OverlappedSteps | None = None
        if config.async_scheduling:
            if config.tensor_parallel_size > 1:
                logger.info("tensor parallelism: engine steps run synchronously "
                            "(--async-scheduling applies at TP 1)")
            else:
                self.overlap = OverlappedSteps(self.scheduler, runner)
        # KV events (--kv-events-endpoint): the block manager records, the publisher sends.
        self.kv_events: KVEventPublisher | None = None
        if config.kv_events_endpoint:
            self.kv_events = KVEventPublisher(
                config.kv_events_endpoint,
                config.kv_events_snapshot_endpoint
                or default_snapshot_endpoint(config.kv_events_endpoint),
                config.block_size)
            self.scheduler.kv_cache_manager.enable_events()

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
        return None

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    # ---------------------------------------------------------------- stepping
    def has_work(self) -> bool:
        """True when a step could make progress or the connector needs polling."""
        return (self.scheduler.has_unfinished_requests() or self.scheduler.has_pending_kv_work()
                or (self.overlap is not None and self.overlap.in_flight))

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One engine step: schedule, execute, commit.

        When nothing is schedulable but KV transfers, notifications or leases are pending (or
        finished requests must be reported to the runner), the runner still executes an empty
        batch so the connector gets polled.

        With ``--async-scheduling`` the step is :meth:`OverlappedSteps.step
        <pdserve.engine.async_step.OverlappedSteps.step>`: the outputs are those of the step
        launched one call earlier.

        Returns:
            ``(outputs, computed)``: per-request deltas and whether any token was computed.
        """
        if self.overlap is not None:
            outputs, computed, out = self.overlap.step()
        else:
            sched = self.scheduler.schedule()
            if not sched.scheduled and not sched.finished_req_ids and not self.scheduler.has_pending_kv_work():
                return [], False
            out = self.runner.execute(sched)
            outputs, computed = self.scheduler.update_from_output(sched, out), bool(sched.scheduled)
        kv_out = out.kv_connector_output if out is not None else None
        if kv_out is not None and kv_out.stats:
            self._connector_stats.append(kv_out.stats)
        return outputs, computed

    def wait_timeout_s(self, progressed: bool) -> float:
        """Seconds the core loop may block waiting for input or a connector wake-up before it
        must step again.

        0 after a step that computed tokens, or while finished requests or connector metadata
        wait to be delivered; :data:`KV_POLL_INTERVAL_S` while requests wait for blocks or a
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
        sched = self.scheduler
        if progressed or sched.finished_req_ids:
            return 0.0
        if self.connector is not None and self.connector.has_pending_metadata():
            return 0.0
        if sched.waiting or sched.running:
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
            self.kv_events.publish(self.scheduler.kv_cache_manager.take_events())

    def serve_kv_snapshot(self) -> None:
        """Answer a pending KV events snapshot request (its socket is readable)."""
        if self.kv_events is not None:
            self.kv_events.serve_snapshot(self.scheduler.kv_cache_manager.cached_block_hashes())

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
        for part in (self.connector, self.connector_worker, self.runner):
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception:  # shutting down: log and keep releasing the rest
                logger.exception("error while shutting down %s", type(part).__name__)
        self.connector = self.connector_worker = None


def _model_info_dict(model_info: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(model_info):
        return dataclasses.asdict(model_info)
    return dict(vars(model_info))


def run_engine_core(config: EngineConfig, addresses: CoreAddresses) -> None:
    """Entry point of the engine-core process: build the core, then loop until told to stop.

    Startup failures are sent to the front end as :class:`StartupFailed` (then exit code 1);
    failures while running as :class:`CoreFailed`. Exits on its own when the parent dies.
    """
    import zmq

    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s [engine-core] %(name)s: %(message)s",
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when we stop
    parent = os.getppid()
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 5000)
    in_sock.connect(addresses.input_address)
    out_sock.connect(addresses.output_address)
    encoder = make_encoder()
    decoder = make_input_decoder()
    core: EngineCore | None = None
    exit_code = 0
    try:
        try:
            core = EngineCore(config)
        except BaseException as e:  # any startup failure must reach the front end
            logger.error("engine core failed to start: %s", e)
            out_sock.send(encoder.encode(StartupFailed(f"{type(e).__name__}: {e}", traceback.format_exc())))
            exit_code = 1
            return
        out_sock.send(
            encoder.encode(
                Ready(
                    model_info=_model_info_dict(core.model_info),
                    num_blocks=core.num_blocks,
                    block_size=config.block_size,
                    max_model_len=core.max_model_len,
                )
            )
        )
        # The model, caches and imports live as long as the process: the garbage collector
        # skips them from now on (no full pass over them in the loop or at exit).
        gc.collect()  # start-up's own garbage is freed, not frozen
        gc.freeze()
        try:
            _core_loop(core, in_sock, out_sock, encoder, decoder, parent, addresses.remote)
        except BaseException as e:
            logger.exception("engine core failed")
            out_sock.send(encoder.encode(CoreFailed(f"{type(e).__name__}: {e}", traceback.format_exc())))
            exit_code = 1
    finally:
        if core is not None:
            core.shutdown()
        in_sock.close(0)
        out_sock.close()
        ctx.term()
        if exit_code:
            os._exit(exit_code)


def _sync_wakeup_handles(poller: Any, registered: list[Any], handles: list[Any]) -> list[Any]:
    """(Un)register the connector's wake-up handles that changed; returns the new list."""
    import zmq

    if handles == registered:
        return registered
    for h in registered:
        if not any(h is x for x in handles):
            poller.unregister(h)
    for h in handles:
        if not any(h is x for x in registered):
            poller.register(h, zmq.POLLIN)
    return list(handles)


def _core_loop(core: EngineCore, in_sock: Any, out_sock: Any, encoder: Any, decoder: Any, parent: int,
               remote: bool = False) -> None:
    import zmq

    poller = zmq.Poller()
    poller.register(in_sock, zmq.POLLIN)
    snapshot_sock = core.kv_events.snapshot_socket if core.kv_events is not None else None
    if snapshot_sock is not None:
        poller.register(snapshot_sock, zmq.POLLIN)
    wakeups: list[Any] = []
    last_stats: dict[str, Any] | None = None
    last_stats_time = 0.0
    last_parent_check = time.monotonic()
    stats_stale = False  # a changed snapshot waits for STATS_INTERVAL_S to pass
    progressed = False
    sched = core.scheduler
    # A remote rank (pdserve/engine/messages.py): heartbeats both ways.
    last_input = last_sent = time.monotonic()
    while True:
        # Wait for input or a connector wake-up (side-channel answer or notice, finished
        # handshake): not at all while the last step computed tokens, until the connector's
        # next deadline while only KV work is pending, long (but bounded, to notice a dead
        # parent) when idle. Never spins a core when nothing can progress.
        timeout_s = core.wait_timeout_s(progressed)
        if stats_stale:
            timeout_s = min(timeout_s, max(0.0, last_stats_time + STATS_INTERVAL_S - time.monotonic()))
        wakeups = _sync_wakeup_handles(poller, wakeups, core.wakeup_handles())
        early_outputs: list[EngineCoreOutput] = []
        events = dict(poller.poll(timeout_s * 1000))
        if snapshot_sock is not None and events.pop(snapshot_sock, None):
            core.serve_kv_snapshot()
        if len(events) > (in_sock in events):
            core.handle_wakeup()
        if in_sock in events:
            last_input = time.monotonic()
            while True:
                try:
                    raw = in_sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = decoder.decode(raw)
                if isinstance(msg, AddRequest):
                    rejected = core.add_request(msg)
                    if rejected is not None:
                        early_outputs.append(rejected)
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, Shutdown):
                    logger.info("engine core shutting down")
                    return
                elif isinstance(msg, Ping):
                    pass
        now = time.monotonic()
        if remote and now - last_input > HEARTBEAT_TIMEOUT_S:
            raise RuntimeError(f"no message from the API server for {HEARTBEAT_TIMEOUT_S:g} s "
                               "(the data-parallel head is gone or unreachable)")
        if not events or now - last_parent_check >= IDLE_POLL_INTERVAL_S:
            last_parent_check = now
            if os.getppid() != parent:
                logger.warning("front-end process died; engine core exiting")
                return

        stepping = core.has_work() or bool(sched.finished_req_ids)
        outputs, progressed = core.step() if stepping else ([], False)
        core.publish_kv_events()
        outputs = early_outputs + outputs
        core.log_connector_stats()
        conn_stats = core.take_connector_stats()
        now = time.monotonic()
        stats = None
        interval_over = now - last_stats_time >= STATS_INTERVAL_S
        if outputs or conn_stats or stepping or stats_stale or interval_over:
            # Snapshots without token output go out at most every STATS_INTERVAL_S; a changed
            # one held back makes the loop wake up when the interval is over.
            snapshot = core.stats()
            changed = snapshot != last_stats
            if outputs or conn_stats or (changed and interval_over):
                stats = snapshot
                last_stats = snapshot
                last_stats_time = now
                stats_stale = False
            else:
                stats_stale = changed
        if outputs or conn_stats or stats is not None or (
                remote and now - last_sent >= HEARTBEAT_INTERVAL_S):
            out_sock.send(encoder.encode(StepOutputs(outputs=outputs, stats=stats, connector_stats=conn_stats)))
            last_sent = now
