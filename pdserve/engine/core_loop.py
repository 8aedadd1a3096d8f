"""The engine-core process: its entry point :func:`run_engine_core` and the loop that connects
its ZMQ sockets (the protocol of :mod:`pdserve.types.core_messages`) to an
:class:`~pdserve.engine.core.EngineCore`.

The loop blocks in one poll on its input socket and the connector's wake-up handles for as long
as :meth:`EngineCore.wait_timeout_s <pdserve.engine.core.EngineCore.wait_timeout_s>` allows,
then steps the core and sends its outputs and stats (docs/architecture.md, "Core loop
wake-ups").
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
import traceback
from typing import Any

from pdserve.utils import phase_trace
from pdserve.types.engine_config import EngineConfig
from pdserve.engine import ipc_dir
from pdserve.engine.core import IDLE_POLL_INTERVAL_S, EngineCore
from pdserve.types.core_messages import (
    AbortRequests,
    AddRequest,
    CoreAddresses,
    CoreFailed,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_TIMEOUT_S,
    Ping,
    Ready,
    ReleaseEarly,
    Shutdown,
    StartupFailed,
    StepOutputs,
    make_encoder,
    make_input_decoder,
)
from pdserve.types.outputs import EngineCoreOutput
from pdserve.kv_transfer.wakeup import sync_poller
from pdserve.utils.process_gc import freeze_start_up_objects

logger = logging.getLogger("pdserve.engine.core")  # the engine core's log lines, one name

# Seconds between stats-only messages while the scheduler state changes without token output.
STATS_INTERVAL_S = 0.1


def _model_info_dict(model_info: Any) -> dict[str, Any]:
    if dataclasses.is_dataclass(model_info):
        return dataclasses.asdict(model_info)
    return dict(vars(model_info))


def run_engine_core(config: EngineConfig, addresses: CoreAddresses) -> None:
    """Entry point of the engine-core process: build the core, then loop until told to stop.

    Startup failures are sent to the front end as :class:`StartupFailed` (then exit code 1);
    failures while running as :class:`CoreFailed`. Exits on its own when the parent dies.
    """
    kv = config.kv_transfer_config
    phase_trace.set_role(phase_trace.kv_role_prefix(kv.kv_role if kv is not None else None)
                         + ".core")
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
            # The composition root of the engine-core process: the executor (torch, the model)
            # is imported here, lazily, so that the core and the API process never import it.
            from pdserve.executor import create_executor

            core = EngineCore(config, create_executor)
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
        freeze_start_up_objects()
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
    scheduler = core.scheduler

    def emit(outputs: list[EngineCoreOutput]) -> None:
        """Send outputs known at a step's launch now, before the core waits for the running
        step (:meth:`EngineCore._async_step`)."""
        phase_trace.mark("core.send_early")
        out_sock.send(encoder.encode(StepOutputs(outputs=outputs)))

    core.emit = emit
    # A remote rank (pdserve/types/core_messages.py): heartbeats both ways.
    last_input = last_sent = time.monotonic()
    while True:
        # Wait for input or a connector wake-up (side-channel answer or notice, finished
        # handshake): not at all while the last step computed tokens, until the connector's
        # next deadline while only KV work is pending, long (but bounded, to notice a dead
        # parent) when idle. Never spins a core when nothing can progress.
        timeout_s = core.wait_timeout_s(progressed)
        # With requests in it the loop says it lives at least every HEARTBEAT_INTERVAL_S (a
        # waiting request's stream sends keep-alives only while its core does, so a core stuck
        # in a step is still taken for failed: pdserve/entrypoints/job_runner.py).
        busy = scheduler.has_unfinished_requests()
        if busy:
            timeout_s = min(timeout_s, HEARTBEAT_INTERVAL_S)
        if stats_stale:
            timeout_s = min(timeout_s, max(0.0, last_stats_time + STATS_INTERVAL_S - time.monotonic()))
        wakeups = sync_poller(poller, wakeups, core.wakeup_handles())
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
                    phase_trace.mark("core.add")
                    rejected = core.add_request(msg)
                    phase_trace.mark("core.added")
                    if rejected is not None:
                        early_outputs.append(rejected)
                elif isinstance(msg, AbortRequests):
                    core.abort_requests(msg.request_ids)
                elif isinstance(msg, ReleaseEarly):
                    core.release_early(msg.request_id, msg.block_ids)
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
                ipc_dir.remove_owned_by(parent)  # its sockets' folder: nobody else removes it
                return

        stepping = core.has_work() or bool(scheduler.finished_request_ids)
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
                (remote or busy) and now - last_sent >= HEARTBEAT_INTERVAL_S):
            if outputs:
                phase_trace.mark("core.send_out")
            out_sock.send(encoder.encode(StepOutputs(outputs=outputs, stats=stats, connector_stats=conn_stats)))
            last_sent = now
