"""The engine-core loop sleeps while only KV work is pending and wakes when the connector
worker signals (a finished transfer, a side-channel answer), not at its next poll timeout."""

from __future__ import annotations

import os
import queue
import threading
import time

import pytest
import zmq

from tests.support.engine_fakes import FakeConnectorWorker, FakeRemote, add, make_core
from pdserve.types.kv_params import KVTransferParams
from pdserve.engine import core as core_mod
from pdserve.engine import core_loop
from pdserve.types.core_messages import (
    AddRequest, Shutdown, StepOutputs, make_encoder, make_input_decoder, make_output_decoder,
)
from pdserve.types.sampling_params import SamplingParams
from pdserve.kv_transfer.nixl.stats import StatsRecorder
from pdserve.kv_transfer.wakeup import Waker

pytestmark = pytest.mark.timeout(120)


class SignallingWorker(FakeConnectorWorker):
    """A fake worker whose loads finish only when the test says so; it then wakes the loop
    through its :class:`Waker` and asks for no polling in between."""

    def __init__(self, remote: FakeRemote):
        super().__init__(remote)
        self.waker = Waker()
        self.posted = threading.Event()
        self.done: set[str] = set()
        self.lock = threading.Lock()
        self.wakeups = 0

    def wakeup_handles(self):
        return [self.waker.fileno()]

    def handle_wakeup(self):
        self.wakeups += 1
        self.waker.drain()

    def next_poll_in(self):
        return None  # only a wake-up brings news

    def start_load_kv(self):
        super().start_load_kv()
        if self._in_flight:
            self.posted.set()

    def get_finished(self, finished_request_ids):
        with self.lock:
            done, self.done = self.done, set()
        for entry_id in list(self._in_flight):
            self._in_flight[entry_id][0] = 1 if entry_id in done else 10**9
        return super().get_finished(finished_request_ids)

    def complete(self, request_id: str) -> None:
        """Another thread: the transfer of ``request_id`` is done."""
        with self.lock:
            self.done.add(request_id)
        self.waker.wake()


def test_finished_transfer_wakes_the_core_loop(monkeypatch):
    # Without the wake-up the loop would sleep for an hour: the test's 60 s wait would fail.
    monkeypatch.setattr(core_mod, "IDLE_POLL_INTERVAL_S", 3600.0)
    remote = FakeRemote()
    core, _ = make_core(remote=remote)
    worker = SignallingWorker(remote)
    core.connector_worker = worker
    core.runner.set_kv_connector_worker(worker)
    worker.register_kv_cache(core.runner.kv_cache, core.runner.kv_cache_spec)

    ctx = zmq.Context()
    socks = []

    def pair(name):
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind(f"inproc://{name}")
        push.connect(f"inproc://{name}")
        socks.extend((pull, push))
        return push, pull

    to_core, core_in = pair("core-input")
    core_out, from_core = pair("core-output")
    enc, dec = make_encoder(), make_output_decoder()
    loop_error: list[BaseException] = []

    def run():
        try:
            core_loop._core_loop(core, core_in, core_out, enc, make_input_decoder(), os.getppid())
        except BaseException as e:  # reported by the test
            loop_error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        to_core.send(enc.encode(AddRequest(
            request_id="r", prompt_token_ids=list(range(1, 9)),
            sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
            kv_transfer_params=KVTransferParams.parse({"remote": True}))))
        assert worker.posted.wait(60), "the load was never posted"
        # the load is in flight; the core now waits (for up to IDLE_POLL_INTERVAL_S)
        worker.complete("r")
        tokens = []
        while not tokens:
            assert from_core.poll(60_000), f"no output after the wake-up ({loop_error})"
            msg = dec.decode(from_core.recv())
            if isinstance(msg, StepOutputs):
                tokens += [t for o in msg.outputs if o.request_id == "r" for t in o.new_token_ids]
        assert worker.wakeups >= 1
    finally:
        to_core.send(enc.encode(Shutdown()))
        thread.join(30)
        for sock in socks:
            sock.close(0)
        ctx.term()
        worker.waker.close()
    assert not thread.is_alive()
    assert not loop_error, loop_error


class SummaryWorker(FakeConnectorWorker):
    """A fake worker with the NIXL worker's interval recorder; notes when each summary line
    is written."""

    def __init__(self, remote: FakeRemote, interval_s: float):
        super().__init__(remote)
        self.recorder = StatsRecorder(interval_s)
        self.lines: queue.SimpleQueue[float] = queue.SimpleQueue()

    def next_stats_log_in(self):
        return self.recorder.next_log_in()

    def log_stats(self):
        if self.recorder.maybe_log() is not None:
            self.lines.put(time.monotonic())


def test_transfer_summary_line_is_written_while_the_core_idles(monkeypatch):
    # Idle, the loop would sleep for an hour: only the summary line's deadline can wake it.
    monkeypatch.setattr(core_mod, "IDLE_POLL_INTERVAL_S", 3600.0)
    interval_s = 0.5
    remote = FakeRemote()
    core, _ = make_core(remote=remote)
    worker = SummaryWorker(remote, interval_s)
    core.connector_worker = worker
    # one finished transfer, taken by a step, then nothing more to do
    worker.recorder.current.record_transfer(0.002, 0.0001, 4096, 1)
    assert worker.recorder.take_delta() is not None
    t_transfer = time.monotonic()
    assert not core.has_work()

    ctx = zmq.Context()
    to_core, core_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    core_in.bind("inproc://summary-input")
    to_core.connect("inproc://summary-input")
    core_out, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    from_core.bind("inproc://summary-output")
    core_out.connect("inproc://summary-output")
    enc = make_encoder()
    loop_error: list[BaseException] = []

    def run():
        try:
            core_loop._core_loop(core, core_in, core_out, enc, make_input_decoder(),
                                 os.getppid())
        except BaseException as e:  # reported by the test
            loop_error.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        logged_at = worker.lines.get(timeout=interval_s + 1.0)
        assert logged_at - t_transfer >= interval_s - 0.05
        # idle from now on: no further line
        with pytest.raises(queue.Empty):
            worker.lines.get(timeout=3 * interval_s)
    finally:
        to_core.send(enc.encode(Shutdown()))
        thread.join(30)
        for sock in (to_core, core_in, core_out, from_core):
            sock.close(0)
        ctx.term()
    assert not thread.is_alive()
    assert not loop_error, loop_error


def test_core_steps_at_once_when_a_finished_load_makes_a_request_runnable():
    # The step that reports a finished load puts its request back in the waiting queue; the
    # loop must schedule it at once, not one KV poll tick later.
    remote = FakeRemote(load_delay_steps=1)
    core, _ = make_core(remote=remote)
    add(core, "r", list(range(1, 10)), {"remote": True}, max_tokens=2)
    sched = core.scheduler
    for _ in range(20):
        core.step()
        if any(r.request_id == "r" for r in sched.queues.waiting) and "r" not in sched.remote_kv.waiting_for_remote:
            break
    else:
        pytest.fail("the load never finished")
    assert not sched.queues.running
    assert core.wait_timeout_s(False) == 0.0
    core.step()  # schedules the request's last prompt token
    assert not sched.loaded_since_schedule
    assert not any(r.request_id == "r" for r in sched.queues.waiting)
