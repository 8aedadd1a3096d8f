"""The tensor-parallel executor on CPU (gloo), with a scripted KV connector per rank
(pdserve/testing/fake_connectors.py): every rank's connector is created in its own process,
registered at the same time (its all_gather reaches every rank), polled every step (also an
empty one), and the ranks' reports are merged; a rank failing at start-up leaves no process."""

from __future__ import annotations

import os
import time

import pytest

from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import SchedulerOutput
from pdserve.executor.multiproc import RankFailedError, TPExecutor
from pdserve.testing.fake_connectors import failing_worker, scripted_worker

from tests.support.processes import descendants, new_descendants, still_running, with_command

pytestmark = pytest.mark.slow

#: the command of a TP worker process (what these tests start; the session's shared servers
#: and their children run beside them)
WORKER = "pdserve.executor.worker"


def _config(path: str) -> EngineConfig:
    return EngineConfig(model=path, device="cpu", tensor_parallel_size=2, max_model_len=128,
                        num_gpu_blocks_override=32)


def _step(ex: TPExecutor, meta: dict):
    return ex.execute(SchedulerOutput(kv_connector_metadata=meta)).kv_connector_output


def test_connector_per_rank_registered_polled_and_merged(tiny_llama_path):
    before = descendants(os.getpid())
    ex = TPExecutor(_config(tiny_llama_path), connector_factory=scripted_worker)
    try:
        ex.allocate_kv_cache(ex.determine_num_blocks())
        worker = ex.connector_worker
        worker.register_kv_cache(ex.kv_cache, ex.kv_cache_spec)
        ex.set_kv_connector_worker(worker)
        # rank 0 in this process, rank 1 in another; each holds 1 of the 2 KV heads
        workers = with_command(new_descendants(before), WORKER)
        pid1 = next(iter(workers))
        gathered = [(0, os.getpid(), 1, 2), (1, pid1, 1, 2)]
        assert [tuple(g) for g in ex.connector_worker.rank0.gathered] == gathered
        assert ex.kv_cache_spec.num_kv_heads == 1 and ex.kv_cache_spec.total_num_kv_heads == 2
        # an empty step polls both ranks; rank 0 alone finishing "a" is not enough
        # (the first token, known from the lease claim, is rank 0's and goes out at once)
        out = _step(ex, {"recv": {0: ["a"]}, "first": {"a": 7}, "send": {1: ["s"]}})
        assert out.finished_recving == set() and out.finished_sending == set()
        assert out.first_tokens == {"a": 7}
        assert out.stats["polls"] == 2
        assert out.stats["gathered"] == [list(g) for g in gathered] * 2
        # rank 1 reports "a" a step later: now it is done
        out = _step(ex, {"recv": {1: ["a"]}, "send": {0: ["s"]}})
        assert out.finished_recving == {"a"} and out.first_tokens == {}
        assert out.finished_sending == {"s"}
        # a failure on rank 1 only fails the load
        out = _step(ex, {"recv": {0: ["b"], 1: ["b"]}, "invalid": {1: [3]}})
        assert out.finished_recving == {"b"} and out.invalid_block_ids == {3}
        assert str(out.load_errors["b"]) == "transport error: rank 1"
        # a rank that fails in a step fails the step, naming it
        with pytest.raises(RankFailedError, match="TP rank 1 failed: RuntimeError: scripted"):
            _step(ex, {"fail_rank": 1})
        # the failed rank exits; shutting down after it is gone must not wait on it
        deadline = time.monotonic() + 60
        while still_running({pid1: workers[pid1]}) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not still_running({pid1: workers[pid1]})
        time.sleep(0.5)  # the worker's control connection is closed by now
        # as on a busy machine where the watchdog thread has not run yet: the executor has
        # not noticed the exit, and shutdown must find it instead of waiting to send to it
        ex._dead = None
    finally:
        t0 = time.monotonic()
        ex.shutdown()
        assert time.monotonic() - t0 < 30, "shutdown waited on a dead rank"
    assert not still_running(with_command(new_descendants(before), WORKER))


def test_rank_failing_at_startup_leaves_no_process(tiny_llama_path):
    before = descendants(os.getpid())
    with pytest.raises(RankFailedError, match="TP rank 1 failed: .*scripted start-up failure"):
        TPExecutor(_config(tiny_llama_path), connector_factory=failing_worker)
    assert not still_running(with_command(new_descendants(before), WORKER))
