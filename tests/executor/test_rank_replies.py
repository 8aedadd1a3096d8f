"""Collecting the ranks' answers (pdserve/executor/multiproc.py, ``TPExecutor._collect``): a rank
that failed sends its reason before it exits, and the executor reports that reason even when it
notices the exit before the reason reaches its socket; a rank that exits without a word is
reported by its exit code."""

from __future__ import annotations

import pickle
import threading
import time

import pytest
import zmq

from pdserve.executor import multiproc
from pdserve.executor.messages import WorkerReply
from pdserve.executor.multiproc import RankFailedError, TPExecutor


@pytest.fixture
def sockets():
    ctx = zmq.Context()
    results = ctx.socket(zmq.PULL)
    results.bind("inproc://results")
    sender = ctx.socket(zmq.PUSH)
    sender.connect("inproc://results")
    yield results, sender
    sender.close(0)
    results.close(0)
    ctx.term()


class ExitedProcess:
    """A worker process that has exited with code 1 (``subprocess.Popen``'s ``poll`` and
    ``pid``)."""

    pid = 4242

    def poll(self) -> int:
        return 1


def _executor_with_an_exited_rank(results) -> TPExecutor:
    """A TP 2 executor's answer-collecting state only: its rank 1 has already exited."""
    ex = TPExecutor.__new__(TPExecutor)
    ex.size = 2
    ex._results = results
    ex._dead = None
    ex._procs = [ExitedProcess()]
    return ex


def test_a_reason_sent_before_the_exit_but_read_after_it_is_reported(sockets):
    results, sender = sockets
    ex = _executor_with_an_exited_rank(results)
    late = threading.Timer(0.5, lambda: sender.send(pickle.dumps(
        WorkerReply(1, error="RuntimeError: out of memory"))))
    late.start()
    try:
        with pytest.raises(RankFailedError, match=r"^TP rank 1 failed: RuntimeError: out of "
                                                  r"memory$"):
            ex._collect()
    finally:
        late.join()


def test_a_rank_that_exits_without_a_word_is_reported_by_its_exit_code(sockets, monkeypatch):
    monkeypatch.setattr(multiproc, "LAST_ANSWER_WAIT_S", 0.3)
    results, _ = sockets
    ex = _executor_with_an_exited_rank(results)
    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match=r"^TP rank 1 \(pid 4242\) exited with code 1$"):
        ex._collect()
    assert time.monotonic() - t0 < 5
