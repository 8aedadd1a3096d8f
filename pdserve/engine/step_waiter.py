"""Waits for a launched engine step and for a KV connector's wake-ups at once (async scheduling).

The engine thread of an async-scheduling core reads a launched step's tokens with
``PendingStep.result()``, which blocks until the device is done. While the connector waits for
an answer that gives the scheduler something to send (a prefiller's first token, carried by a
lease claim's answer), :class:`StepWaiter` moves that wait to a thread of its own, which writes a
byte to a pipe when the step's output is ready, and the engine thread polls that pipe and the
connector's wake-up handles together: an answer that comes while the step runs is applied at
once (:meth:`pdserve.engine.core.EngineCore._read_step`), not at the next step's launch.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any, Callable

import zmq

from pdserve.types.outputs import ModelRunnerOutput, PendingStep


class StepWaiter:
    """A thread that reads launched steps' outputs, and the pipe it signals them on.

    One step at a time: :meth:`wait` hands the step to the thread and returns its output.
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        self._steps: queue.SimpleQueue = queue.SimpleQueue()
        self._result: ModelRunnerOutput | BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pdserve-step-waiter",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            pending = self._steps.get()
            if pending is None:
                return
            try:
                self._result = pending.result()
            except BaseException as e:  # raised on the engine thread by wait()
                self._result = e
            os.write(self._write_fd, b"\0")

    def wait(self, pending: PendingStep, handles: Callable[[], list[Any]],
             on_wake: Callable[[], bool]) -> ModelRunnerOutput:
        """``pending.result()``, and meanwhile ``on_wake()`` each time one of ``handles()`` (ZMQ
        sockets or file descriptors) is readable first; ``on_wake`` consumes what woke it and
        returns whether to keep watching the handles (False: only the step is waited for).

        Raises:
            What ``pending.result()`` raises.
        """
        self._steps.put(pending)
        watching = True
        while True:
            poller = zmq.Poller()
            poller.register(self._read_fd, zmq.POLLIN)
            if watching:
                for handle in handles():
                    poller.register(handle, zmq.POLLIN)
            events = dict(poller.poll())
            if self._read_fd in events:
                return self._take()
            watching = on_wake()

    def _take(self) -> ModelRunnerOutput:
        os.read(self._read_fd, 1)
        result, self._result = self._result, None
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """Stop the thread (after the step it waits for, if any) and close the pipe."""
        self._steps.put(None)
        self._thread.join(timeout=10)
        os.close(self._read_fd)
        os.close(self._write_fd)
