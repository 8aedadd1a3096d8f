"""The fast lane starts no process: a test not marked ``slow`` that starts one fails.

``pytest -m "not slow"`` is the lane a developer runs after every change, so it must not wait
for engines, NIXL peers, TP workers or any other process. :class:`ProcessGuard` wraps every way
a test can start one (``subprocess.Popen``, and through it ``subprocess.run`` and asyncio's
subprocesses; ``multiprocessing`` processes of every start method, ``torch.multiprocessing``
included; ``os.fork``, ``os.posix_spawn``, ``os.system``) and, while a test without the
``slow`` marker runs (its setup, call and teardown), refuses the start with
:class:`ProcessInFastTest`. The refusal is also recorded, so a test whose code under test
catches the exception still fails (:meth:`ProcessGuard.take`, read by tests/conftest.py).
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from pathlib import PurePath
from typing import Any, Callable

#: programs that libraries run for themselves to look something up (``ldconfig -p`` from
#: ``ctypes.util.find_library``, ``uname -p`` from ``platform.processor()`` as the openai client
#: asks it, ``fc-list`` from matplotlib's font cache), and the compilers that Triton and NVRTC's
#: callers run to build a kernel on a GPU machine (``gcc``/``cc`` for Triton's driver module,
#: ``ptxas``, ``nvcc``, ``cuobjdump``): not a process the test starts
LIBRARY_PROBES = frozenset({"ldconfig", "uname", "fc-list",
                            "gcc", "cc", "g++", "c++", "clang", "ptxas", "nvcc", "cuobjdump",
                            "nvdisasm"})


class ProcessInFastTest(RuntimeError):
    """A test not marked ``slow`` tried to start a process."""


def _program(args: Any) -> str:
    """The program name of ``Popen``'s ``args`` (a sequence, or a command string)."""
    if isinstance(args, (str, bytes, os.PathLike)):
        first = os.fsdecode(args).split(maxsplit=1)
    else:
        first = [os.fsdecode(args[0])] if args else []
    return PurePath(first[0]).name if first else ""


class ProcessGuard:
    """Refuses process starts while a test without the ``slow`` marker runs.

    Attributes:
        test_id: node id of the running unmarked test, or None (outside tests, or while a
            ``slow`` test runs: then every start is allowed).
    """

    def __init__(self) -> None:
        self.test_id: str | None = None
        self._refused: list[str] = []
        self._installed = False

    def install(self) -> None:
        """Wrap the process-starting functions (idempotent; for the whole session)."""
        if self._installed:
            return
        self._installed = True
        guard = self

        popen_init = subprocess.Popen.__init__

        def guarded_popen_init(popen: subprocess.Popen, *args: Any, **kw: Any) -> None:
            argv = args[0] if args else kw.get("args")
            if _program(argv) not in LIBRARY_PROBES:
                guard.check(f"subprocess.Popen({argv!r})")
            popen_init(popen, *args, **kw)

        subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]

        process_start = multiprocessing.process.BaseProcess.start

        def guarded_start(process: multiprocessing.process.BaseProcess) -> None:
            guard.check(f"multiprocessing {type(process).__name__}.start() of {process.name}")
            process_start(process)

        multiprocessing.process.BaseProcess.start = guarded_start  # type: ignore[method-assign]

        for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "system"):
            if hasattr(os, name):
                setattr(os, name, self._guarded(name, getattr(os, name)))

    def _guarded(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kw: Any) -> Any:
            self.check(f"os.{name}{args[:1]!r}")
            return fn(*args, **kw)

        guarded.__name__ = name
        return guarded

    def check(self, what: str) -> None:
        """Raise :class:`ProcessInFastTest` (and record it) if an unmarked test is running.

        Args:
            what: the start being attempted, for the message.
        """
        if self.test_id is None:
            return
        message = (f"{self.test_id} starts a process ({what}) but is not marked slow: mark it "
                   "@pytest.mark.slow (or the module's pytestmark), so that "
                   "pytest -m 'not slow' starts no process")
        self._refused.append(message)
        raise ProcessInFastTest(message)

    def take(self) -> list[str]:
        """The refusals since the last call (then forgotten)."""
        refused, self._refused = self._refused, []
        return refused
