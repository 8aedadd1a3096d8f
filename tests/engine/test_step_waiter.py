"""Reading a launched step while the KV connector's answers are watched (async scheduling,
pdserve/engine/step_waiter.py): the waiter returns the step's output and calls back on each
wake-up before it; through the engine core over the fake runner, a prefiller's first token that
comes while a step runs goes out before that step's tokens are read."""

from __future__ import annotations

import os
import threading
import time

import pytest

from pdserve.engine.step_waiter import StepWaiter
from pdserve.types.outputs import ModelRunnerOutput
from tests.kv_transfer.test_partial_loads import pull, tracker
from tests.support.engine_fakes import (
    FakeConnectorWorker,
    FakeRemote,
    add,
    assert_all_free,
    collect,
    drain,
    make_core,
    reference_generate,
    run_until_done,
)


class Pipe:
    """A wake-up handle: readable once :meth:`ring` wrote to it, until drained."""

    def __init__(self):
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)

    def ring(self) -> None:
        os.write(self.w, b"\0")

    def drain(self) -> None:
        try:
            while os.read(self.r, 4096):
                pass
        except BlockingIOError:
            pass


class Blocked:
    """A launched step whose output is ready once ``done`` is set."""

    def __init__(self, output=None, error: BaseException | None = None):
        self.done = threading.Event()
        self.output = output if output is not None else ModelRunnerOutput()
        self.error = error

    def result(self):
        assert self.done.wait(10)
        if self.error is not None:
            raise self.error
        return self.output


def test_the_waiter_calls_back_on_each_wake_up_then_returns_the_steps_output():
    waiter, pipe, step = StepWaiter(), Pipe(), Blocked()
    wakes: list[float] = []

    def on_wake() -> bool:
        pipe.drain()
        wakes.append(time.monotonic())
        if len(wakes) == 1:
            threading.Timer(0.02, pipe.ring).start()  # a second answer
        else:
            step.done.set()
        return True

    threading.Timer(0.02, pipe.ring).start()
    try:
        assert waiter.wait(step, lambda: [pipe.r], on_wake) is step.output
        assert len(wakes) == 2
        # a step already done, no wake-up: its output; an error in the step is raised here
        ready = Blocked()
        ready.done.set()
        assert waiter.wait(ready, lambda: [pipe.r], on_wake) is ready.output
        failed = Blocked(error=RuntimeError("device error"))
        failed.done.set()
        with pytest.raises(RuntimeError, match="device error"):
            waiter.wait(failed, lambda: [pipe.r], on_wake)
    finally:
        waiter.close()


def test_a_waiter_told_to_stop_watching_only_waits_for_the_step():
    waiter, pipe, step = StepWaiter(), Pipe(), Blocked()
    wakes: list[int] = []

    def on_wake() -> bool:
        wakes.append(1)  # not drained: a handle still watched would wake it again at once
        threading.Timer(0.05, step.done.set).start()
        return False

    pipe.ring()
    try:
        assert waiter.wait(step, lambda: [pipe.r], on_wake) is step.output
        assert wakes == [1]
    finally:
        waiter.close()


class AnsweringWorker(FakeConnectorWorker):
    """The fake worker, except that a load's first token comes with its claim's answer, which
    :meth:`answer` delivers later (from another thread) through a wake-up."""

    def __init__(self, remote: FakeRemote):
        super().__init__(remote)
        self.pipe = Pipe()
        self._held: dict[str, int] = {}  # first tokens whose answer has not come yet

    def start_load_kv(self):
        super().start_load_kv()
        self._held.update(self._first)
        self._first = {}

    def answer(self) -> None:
        self._first.update(self._held)
        self._held = {}
        self.pipe.ring()

    def wakeup_handles(self):
        return [self.pipe.r]

    def handle_wakeup(self):
        self.pipe.drain()

    def expects_answer(self) -> bool:
        return bool(self._held)


def test_a_first_token_answered_while_a_step_runs_goes_out_before_the_step_is_read():
    """A decoder's load waits for the claim answer that carries the prefiller's first token; it
    comes while a launched step runs: the core, waiting for that step, applies the answer and
    sends the token at once (``core.emit``), not at the next launch. Tokens are unchanged."""
    p = list(range(60, 71))
    expected = reference_generate(p, 4)
    remote = FakeRemote(load_delay_steps=4, first_tokens={"d": expected[0]})
    core, runner = make_core(remote=remote, async_scheduling=True)
    worker = AnsweringWorker(remote)
    worker.register_kv_cache(runner.kv, 4)
    core.connector_worker = worker
    runner.set_kv_connector_worker(worker)
    res: dict = {}
    order: list[str] = []
    emitted = threading.Event()

    def emit(outs):
        order.append("emit:" + ",".join(o.request_id for o in outs))
        if any(o.request_id == "d" for o in outs):
            emitted.set()
        collect(res, outs)

    core.emit = emit
    launch = runner.execute_async
    answered: list[bool] = []

    def execute_async(sched):
        pending = launch(sched)
        result = pending.result

        def read():  # the first step read while the load waits: its answer comes meanwhile
            if worker.expects_answer() and not answered:
                answered.append(True)
                threading.Timer(0.05, worker.answer).start()
                emitted.wait(5)
            order.append("read")
            return result()

        pending.result = read
        return pending

    runner.execute_async = execute_async
    add(core, "local", [5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    collect(res, core.step()[0])
    add(core, "d", p, kv_transfer_params={"remote": True}, max_tokens=4)
    for _ in range(20):
        order[:] = []
        outputs, _ = core.step()
        collect(res, outputs)
        if answered:
            break
    else:
        raise AssertionError("no step was read while the load waited for its answer")
    assert order[:2] == ["emit:d", "read"], order
    assert all(o.request_id != "d" for o in outputs)  # sent once
    assert res["d"].tokens == expected[:1]
    run_until_done(core, res)
    assert res["d"].tokens == expected
    assert res["local"].tokens == reference_generate([5, 6, 7, 8], 12)
    drain(core)
    assert_all_free(core)
    core.shutdown()


def test_the_nixl_loads_await_an_answer_only_while_a_first_token_claim_is_unanswered():
    """``expects_answer`` of the NIXL worker: a load whose claim answer brings the owner's
    first token awaits it until answered; a pull (no first token) never does."""
    import dataclasses

    plain = pull()
    first = dataclasses.replace(plain, starts_with_first_token=True)
    loads, out, _, _, _, _ = tracker({"ok": True, "lease_expiry_in": 60.0, "first_token_id": 7})
    loads.add("p1", plain)
    assert not loads.awaits_first_token()
    loads.add("d1", dataclasses.replace(first, request_id="d1"))
    assert loads.awaits_first_token()  # handshake, then claim: not answered yet
    loads.progress(time.monotonic())  # the fake side channel answers at once
    assert out.first_tokens == {"d1": 7} and not out.load_errors
    assert not loads.awaits_first_token()
