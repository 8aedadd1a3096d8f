"""The tensor-parallel executor: rank 0's :class:`ModelRunner` in the engine-core process and
ranks ``1..N-1`` in worker processes (:mod:`.worker`), driven together, one scheduler step at a
time, behind the runner's interface.

Each call is broadcast to the workers over ZMQ (``ipc://``, pickled :mod:`.messages`), done on
rank 0, then every worker's answer is collected; the model's collectives go through
``torch.distributed`` (:mod:`pdserve.distributed`). Control messages do not use
``torch.distributed``, so a dead worker is seen (its answer never comes, its process is gone)
instead of hanging a collective: a watchdog thread waits on every worker process; when one
exits unexpectedly it kills the other workers and ends the engine-core process with exit code
1: at once when the engine core is between calls (its loop would not notice), else unless the
call fails and the engine core stops by itself within :data:`DEATH_GRACE_S` (the answer wait
sees the death within a tenth of a second; a collective of gloo fails when its peer is gone;
one of NCCL might wait forever). Workers die with the engine core (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import pdserve

from pdserve.types.engine_config import EngineConfig
from pdserve.distributed.communication import tp_all_gather_object
from pdserve.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from pdserve.types.outputs import ModelRunnerOutput, SchedulerOutput
from pdserve.executor.kv_merge import KVOutputMerger, TierReportMerger
from pdserve.executor.messages import (
    AllocateKVCache,
    AllocateKVTiers,
    ConnectorFactory,
    Execute,
    NumBlocksRequest,
    RegisterKVCache,
    Shutdown,
    WorkerInit,
    WorkerReply,
)
from pdserve.kv_transfer.base import KVCacheSpec, KVConnectorWorkerSide, TPRank
from pdserve.types.model_info import ModelInfo

logger = logging.getLogger("pdserve.executor")

#: Seconds the watchdog gives the engine core, inside an executor call, to fail by itself
#: after a worker died, before it ends the process.
DEATH_GRACE_S = 10.0
#: Seconds a worker gets to exit after Shutdown before it is killed.
SHUTDOWN_TIMEOUT_S = 10.0
#: Seconds between liveness checks while waiting for the workers' answers.
_ANSWER_POLL_S = 0.1
#: Seconds a rank found dead gets for its last answer (the reason it failed, sent before it
#: exits) to arrive before the executor reports the exit alone.
LAST_ANSWER_WAIT_S = 2.0


class RankFailedError(RuntimeError):
    """A TP rank failed or died (the message names the rank and the reason)."""


class TPExecutor:
    """Runs one instance's model over ``config.tensor_parallel_size`` ranks (> 1).

    Args:
        config: the engine configuration.
        connector_factory: builds each rank's KV connector worker side in that rank's process
            (:data:`~pdserve.executor.messages.ConnectorFactory`); None: ``create_connector``
            when ``config.kv_transfer_config`` is set, else no connector.

    Attributes:
        model_info: rank 0's (the model's) summary.
        connector_worker: rank 0's connector worker side as the engine core sees it
            (:class:`TPConnectorWorker`), or None without a connector.

    Raises:
        ValueError / RuntimeError: the model does not split over the ranks, a rank's device is
            missing, or a rank failed to start (the message says which and why). Every started
            worker is stopped before the error propagates.
    """

    def __init__(self, config: EngineConfig, connector_factory: ConnectorFactory | None = None):
        self.size = config.tensor_parallel_size
        if self.size < 2:
            raise ValueError(f"TPExecutor needs tensor_parallel_size > 1, got {self.size}")
        self.config = config
        self._procs: list[subprocess.Popen] = []
        self._closing = threading.Event()
        self._dead: str | None = None
        self._tmpdir = tempfile.mkdtemp(prefix="pdserve-tp-")
        self._ctx: Any = None
        self.runner: Any = None
        self.connector_worker: TPConnectorWorker | None = None
        self._rank0_connector: KVConnectorWorkerSide | None = None
        self._merger = KVOutputMerger(self.size)
        self._tier_merger = TierReportMerger(self.size)
        self._poll_due: list[float] = []  # monotonic times at which ranks > 0 want a poll
        self._started = False
        self._controls: list[Any] = []
        self._results: Any = None
        self._in_call = True  # start-up is a call: the watchdog lets it fail by itself
        try:
            self._start(connector_factory)
        except BaseException:
            self.shutdown()
            raise
        self._in_call = False

    # ---------------------------------------------------------------- start-up
    def _start(self, connector_factory: ConnectorFactory | None) -> None:
        import zmq

        from pdserve.models.loader import (
            check_model_splits,
            check_tp_devices,
            resolve_device,
            tp_device,
        )
        from pdserve.runner.model_runner import ModelRunner

        config = self.config
        check_model_splits(config)
        base = resolve_device(config.device)
        check_tp_devices(config, base, torch.cuda.device_count() if base.type == "cuda" else 0)
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{self._tmpdir}/results")
        self._controls = []
        init_method = f"file://{self._tmpdir}/dist-init"
        # the workers import this very package, wherever it lies
        package_root = str(Path(pdserve.__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (package_root, os.environ.get("PYTHONPATH")) if p)}
        for rank in range(1, self.size):
            ctl = self._ctx.socket(zmq.PUSH)
            ctl.setsockopt(zmq.LINGER, 0)
            address = f"ipc://{self._tmpdir}/control-{rank}"
            ctl.bind(address)
            self._controls.append(ctl)
            init_file = Path(self._tmpdir, f"init-{rank}.pickle")
            init_file.write_bytes(pickle.dumps(WorkerInit(config, rank, self.size, init_method,
                                                          connector_factory)))
            self._procs.append(subprocess.Popen(
                [sys.executable, "-m", "pdserve.executor.worker", str(init_file), address,
                 f"ipc://{self._tmpdir}/results"], env=env))
        threading.Thread(target=self._watch, name="pdserve-tp-watchdog", daemon=True).start()
        logger.info("tensor parallelism: %d ranks, workers %s", self.size,
                    [p.pid for p in self._procs])
        device = tp_device(base, config, 0)
        if device.type == "cpu":
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // self.size))
        init_tensor_parallel(0, self.size, device, init_method)
        tp = TPRank(0, self.size, tp_all_gather_object)
        if connector_factory is not None:
            self._rank0_connector = connector_factory(config, tp)
        elif config.kv_transfer_config is not None:
            from pdserve.kv_transfer.factory import create_connector

            self._rank0_connector = create_connector(config.kv_transfer_config, "worker", config,
                                                     tp=tp)
        if self._rank0_connector is not None:
            self.connector_worker = TPConnectorWorker(self._rank0_connector, self)
        self.runner = ModelRunner(config)
        self._collect()  # every worker loaded its shard
        self._started = True

    def _watch(self) -> None:
        """Watchdog thread: the first worker to exit while the executor is not closing takes
        the instance down (module docstring)."""
        import multiprocessing.connection as mpc

        pidfds = {os.pidfd_open(proc.pid): (rank, proc)
                  for rank, proc in enumerate(self._procs, start=1)}
        try:
            ready = mpc.wait(list(pidfds))
            rank, proc = pidfds[ready[0]]
        finally:
            for fd in pidfds:
                os.close(fd)
        if self._closing.is_set():
            return
        code = proc.wait()
        self._dead = f"TP rank {rank} (pid {proc.pid}) exited with code {code}"
        logger.error("%s; stopping the instance", self._dead)
        self._kill_workers()
        if not self._closing.wait(DEATH_GRACE_S if self._in_call else 0.0):
            logger.error("engine core did not stop after TP rank %d died; exiting", rank)
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            logging.shutdown()
            os._exit(1)

    # ---------------------------------------------------------------- messages
    def _broadcast(self, msg: Any) -> None:
        """Send ``msg`` to every worker.

        A control socket whose worker is gone has no peer, and a plain ``send`` on it would
        block for ever; sends never block here, and a send that cannot go out is retried until
        the worker is found dead.

        Raises:
            RankFailedError: a worker died before it could be sent ``msg``.
        """
        import zmq

        raw = pickle.dumps(msg)
        for ctl in self._controls:
            while True:
                try:
                    ctl.send(raw, zmq.NOBLOCK)
                    break
                except zmq.Again:
                    dead = self._dead or self._exited_worker()
                    if dead:
                        raise RankFailedError(dead) from None
                    time.sleep(_ANSWER_POLL_S)

    def _collect(self) -> list[WorkerReply]:
        """Every worker's answer to the last broadcast, by rank (1..N-1).

        Raises:
            RankFailedError: a worker answered with an error, or died.
        """
        import zmq

        replies: dict[int, WorkerReply] = {}
        dead: str | None = None
        while len(replies) < self.size - 1:
            if not self._results.poll(_ANSWER_POLL_S * 1000, zmq.POLLIN):
                if dead is not None:  # its last answer did not come either
                    raise RankFailedError(dead)
                dead = self._dead or self._exited_worker()
                if dead is not None and not self._results.poll(LAST_ANSWER_WAIT_S * 1000,
                                                                zmq.POLLIN):
                    raise RankFailedError(dead)
                continue
            reply: WorkerReply = pickle.loads(self._results.recv())
            if reply.error is not None:
                raise RankFailedError(f"TP rank {reply.rank} failed: {reply.error}")
            replies[reply.rank] = reply
        return [replies[r] for r in range(1, self.size)]

    def _exited_worker(self) -> str | None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                return f"TP rank {rank} (pid {proc.pid}) exited with code {code}"
        return None

    # ---------------------------------------------------------------- runner interface
    @property
    def model_info(self) -> ModelInfo:
        return self.runner.model_info

    @property
    def kv_cache(self) -> torch.Tensor | None:
        """Rank 0's KV cache shard."""
        return self.runner.kv_cache

    @property
    def kv_cache_spec(self) -> KVCacheSpec | None:
        """Rank 0's KV cache geometry (``num_kv_heads`` of rank 0, ``total_num_kv_heads``)."""
        return self.runner.kv_cache_spec

    def determine_num_blocks(self) -> int:
        """The fewest KV blocks any rank can hold (every rank allocates that many)."""
        self._in_call = True
        self._broadcast(NumBlocksRequest())
        counts = [int(self.runner.determine_num_blocks())]
        counts += [int(r.value) for r in self._collect()]
        self._in_call = False
        if len(set(counts)) > 1:
            logger.info("KV blocks per rank %s; every rank uses %d", counts, min(counts))
        return min(counts)

    def allocate_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` blocks of KV cache on every rank."""
        self._in_call = True
        self._broadcast(AllocateKVCache(num_blocks))
        self.runner.allocate_kv_cache(num_blocks)
        self._collect()
        self._in_call = False

    def allocate_kv_tiers(self, host_blocks: int, disk_dir: str | None) -> None:
        """Allocate every rank's KV cache tiers (each its shard of every block)."""
        self._in_call = True
        self._broadcast(AllocateKVTiers(host_blocks, disk_dir))
        self.runner.allocate_kv_tiers(host_blocks, disk_dir)
        self._collect()
        self._in_call = False

    def register_kv_caches(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        """Register every rank's KV cache with its connector worker side at the same time
        (rank 0's with ``kv_cache`` / ``spec``; the workers' with their own)."""
        self._in_call = True
        self._broadcast(RegisterKVCache())
        if self._rank0_connector is not None:
            self._rank0_connector.register_kv_cache(kv_cache, spec)
        self._collect()
        self._in_call = False

    def set_kv_connector_worker(self, worker: KVConnectorWorkerSide | None) -> None:
        """Attach rank 0's connector worker side (given as :attr:`connector_worker`) to rank
        0's runner; the workers attached theirs when they registered."""
        if isinstance(worker, TPConnectorWorker):
            worker = worker.rank0
        self.runner.set_kv_connector_worker(worker)

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's output, with the ranks' connector outputs
        merged (:mod:`.kv_merge`).

        Raises:
            RankFailedError: a rank failed or died.
        """
        self._in_call = True
        self._broadcast(Execute(sched_out))
        out = self.runner.execute(sched_out)
        replies = self._collect()
        self._in_call = False
        now = time.monotonic()
        self._poll_due = [now + r.next_poll_in for r in replies if r.next_poll_in is not None]
        outputs = [out.kv_connector_output] + [r.value[0] for r in replies]
        if any(o is not None for o in outputs):
            out.kv_connector_output = self._merger.merge(outputs)
        out.kv_tier_report = self._tier_merger.merge(
            [out.kv_tier_report] + [r.value[1] for r in replies])
        return out

    def workers_next_poll_in(self) -> float | None:
        """Seconds until a rank > 0 wants its connector polled (as of its last step), or None."""
        if not self._poll_due:
            return None
        return max(0.0, min(self._poll_due) - time.monotonic())

    # ---------------------------------------------------------------- shutdown
    def _kill_workers(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def shutdown(self) -> None:
        """Stop every worker (Shutdown, then SIGKILL after :data:`SHUTDOWN_TIMEOUT_S`), release
        rank 0's runner and connector, leave the TP group (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        if not self._started:
            self._kill_workers()  # half started: workers may wait in the rendezvous
        elif self._dead is None:
            try:
                self._broadcast(Shutdown())
            except RankFailedError as e:  # a worker is gone: the wait and kill below apply
                logger.warning("could not send Shutdown to every TP worker: %s", e)
            except Exception:  # sockets already gone: the kill below still applies
                logger.exception("could not send Shutdown to the TP workers")
        deadline = time.monotonic() + SHUTDOWN_TIMEOUT_S
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("TP worker %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        for part in (self._rank0_connector, self.runner):
            if part is None:
                continue
            try:
                part.shutdown()
            except Exception:  # shutting down: log and release the rest
                logger.exception("error while shutting down %s", type(part).__name__)
        destroy_tensor_parallel()
        if self._ctx is not None:
            for sock in [*self._controls, self._results]:
                if sock is not None:
                    sock.close(0)
            self._ctx.term()
            self._ctx = None
        shutil.rmtree(self._tmpdir, ignore_errors=True)


class TPConnectorWorker(KVConnectorWorkerSide):
    """Rank 0's KV connector worker side as the engine core sees it at TP > 1: every call goes
    to rank 0's worker side, except :meth:`register_kv_cache` (registers every rank's cache at
    once) and :meth:`next_poll_in` (also the other ranks' wishes, from their last step).

    Args:
        rank0: rank 0's worker side.
        executor: the executor of the instance.
    """

    def __init__(self, rank0: KVConnectorWorkerSide, executor: TPExecutor):
        self.rank0 = rank0
        self._executor = executor

    def register_kv_cache(self, kv_cache: Any, spec: KVCacheSpec) -> None:
        self._executor.register_kv_caches(kv_cache, spec)

    def bind_connector_metadata(self, metadata: Any) -> None:
        self.rank0.bind_connector_metadata(metadata)

    def start_load_kv(self) -> None:
        self.rank0.start_load_kv()

    def get_finished(self, finished_request_ids: set[str]) -> Any:
        return self.rank0.get_finished(finished_request_ids)

    def wakeup_handles(self) -> list[Any]:
        return self.rank0.wakeup_handles()

    def handle_wakeup(self) -> None:
        self.rank0.handle_wakeup()

    def next_poll_in(self) -> float | None:
        waits = [w for w in (self.rank0.next_poll_in(), self._executor.workers_next_poll_in())
                 if w is not None]
        return min(waits) if waits else None

    def next_stats_log_in(self) -> float | None:
        return self.rank0.next_stats_log_in()

    def log_stats(self) -> None:
        self.rank0.log_stats()

    def shutdown(self) -> None:
        """Nothing: the executor shuts rank 0's worker side down with the other ranks'."""
