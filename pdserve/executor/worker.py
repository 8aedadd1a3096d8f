"""A tensor-parallel rank ``1..N-1`` in its own process: ``python -m pdserve.executor.worker
INIT_FILE CONTROL_ADDRESS RESULT_ADDRESS`` (started by
:class:`~pdserve.executor.multiproc.TPExecutor`; ``INIT_FILE`` holds the pickled
:class:`~.messages.WorkerInit`).

The process joins the instance's TP group, creates its KV connector worker side (when the
instance has a connector), builds its :class:`~pdserve.runner.model_runner.ModelRunner` (its
device, weight shard and KV cache shard), then answers the executor's messages
(:mod:`.messages`) in order. Between messages it serves its connector's wake-ups and periodic
log line, as the engine-core loop does for rank 0.

It exits on :class:`~.messages.Shutdown`; after any error (answered first, so rank 0 fails with
the reason), so that no rank waits in a collective for it; and when its parent (the engine-core
process) dies (``PR_SET_PDEATHSIG`` and a parent check every poll).
"""

from __future__ import annotations

import ctypes
import logging
import os
import pickle
import signal
import sys
import traceback
from typing import Any

from pdserve.executor.messages import (
    AllocateKVCache,
    AllocateKVTiers,
    Execute,
    NumBlocksRequest,
    RegisterKVCache,
    Shutdown,
    WorkerInit,
    WorkerReply,
)
from pdserve.kv_transfer.wakeup import sync_poller

logger = logging.getLogger("pdserve.executor")

#: Seconds between parent checks while no message comes.
IDLE_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the parent dies (Linux ``PR_SET_PDEATHSIG``); exit at once when it
    already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        except (OSError, AttributeError):
            pass  # the parent check of the loop still applies
    if os.getppid() != parent_pid:
        os._exit(1)


class RankWorker:
    """One rank's runner and connector, driven by the executor's messages.

    Args:
        init: the :class:`WorkerInit` message.

    Raises:
        anything the model load, the TP rendezvous or the connector raise.
    """

    def __init__(self, init: WorkerInit):
        import torch

        from pdserve.distributed.communication import tp_all_gather_object
        from pdserve.distributed.parallel_state import init_tensor_parallel
        from pdserve.kv_transfer.base import TPRank
        from pdserve.models.loader import resolve_device, tp_device
        from pdserve.runner.model_runner import ModelRunner

        self.rank = init.rank
        config = init.config
        device = tp_device(resolve_device(config.device), config, init.rank)
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // init.size))
        init_tensor_parallel(init.rank, init.size, device, init.init_method)
        self.connector: Any = None
        tp = TPRank(init.rank, init.size, tp_all_gather_object)
        if init.connector_factory is not None:
            self.connector = init.connector_factory(config, tp)
        elif config.kv_transfer_config is not None:
            from pdserve.kv_transfer.factory import create_connector

            self.connector = create_connector(config.kv_transfer_config, "worker", config, tp=tp)
        self.runner = ModelRunner(config)

    def handle(self, msg: Any) -> Any:
        """Answer one message (the value of the reply)."""
        runner = self.runner
        if isinstance(msg, Execute):
            out = runner.execute(msg.sched_out)
            return out.kv_connector_output, out.kv_tier_report
        if isinstance(msg, NumBlocksRequest):
            return int(runner.determine_num_blocks())
        if isinstance(msg, AllocateKVCache):
            runner.allocate_kv_cache(msg.num_blocks)
            return None
        if isinstance(msg, AllocateKVTiers):
            runner.allocate_kv_tiers(msg.host_blocks, msg.disk_dir)
            return None
        if isinstance(msg, RegisterKVCache):
            if self.connector is not None:
                self.connector.register_kv_cache(runner.kv_cache, runner.kv_cache_spec)
                runner.set_kv_connector_worker(self.connector)
            return None
        raise ValueError(f"unexpected message {type(msg).__name__}")

    def next_poll_in(self) -> float | None:
        return None if self.connector is None else self.connector.next_poll_in()

    def shutdown(self) -> None:
        from pdserve.distributed.parallel_state import destroy_tensor_parallel

        for part in (self.connector, self.runner):
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception:  # shutting down: log and release the rest
                logger.exception("rank %d: error while shutting down %s", self.rank,
                                 type(part).__name__)
        destroy_tensor_parallel()


def _serve(worker: RankWorker, ctl: Any, res: Any, parent: int) -> None:
    """Answer messages until Shutdown; serve the connector's wake-ups in between."""
    import zmq

    poller = zmq.Poller()
    poller.register(ctl, zmq.POLLIN)
    registered: list[Any] = []
    conn = worker.connector
    while True:
        timeout = IDLE_POLL_S
        if conn is not None:
            registered = sync_poller(poller, registered, list(conn.wakeup_handles()))
            log_in = conn.next_stats_log_in()
            if log_in is not None:
                timeout = min(timeout, max(0.0, log_in))
        events = dict(poller.poll(timeout * 1000))
        if conn is not None:
            if len(events) > (ctl in events):
                conn.handle_wakeup()
            conn.log_stats()
        if os.getppid() != parent:
            logger.warning("rank %d: the engine core died; exiting", worker.rank)
            return
        if ctl not in events:
            continue
        msg = pickle.loads(ctl.recv())
        if isinstance(msg, Shutdown):
            return
        value = worker.handle(msg)
        res.send(pickle.dumps(WorkerReply(worker.rank, value,
                                          next_poll_in=worker.next_poll_in())))


def main(argv: list[str]) -> int:
    """Process entry point; returns the exit code (0 after Shutdown, 1 after an error)."""
    import zmq

    parent = os.getppid()
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine core decides when we stop
    init_file, control_address, result_address = argv
    with open(init_file, "rb") as fh:
        init: WorkerInit = pickle.load(fh)
    ctx = zmq.Context()
    ctl = ctx.socket(zmq.PULL)
    ctl.connect(control_address)
    res = ctx.socket(zmq.PUSH)
    res.setsockopt(zmq.LINGER, 5000)
    res.connect(result_address)
    logging.basicConfig(
        level=os.environ.get("PDSERVE_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s %(levelname)s [tp-rank-{init.rank}] %(name)s: %(message)s",
    )
    worker: RankWorker | None = None
    code = 0
    try:
        worker = RankWorker(init)
        res.send(pickle.dumps(WorkerReply(init.rank)))
        _serve(worker, ctl, res, parent)
    except BaseException as e:  # answer with the reason, then exit: nobody waits on us
        logger.error("rank %d failed:\n%s", init.rank, traceback.format_exc())
        res.send(pickle.dumps(WorkerReply(init.rank, error=f"{type(e).__name__}: {e}")))
        code = 1
    finally:
        if worker is not None and code == 0:
            worker.shutdown()
        ctl.close(0)
        res.close()
        ctx.term()
    if code:
        logging.shutdown()
        os._exit(code)  # no waiting for the connector's threads after a failure
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
