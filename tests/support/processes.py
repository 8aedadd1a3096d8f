"""Child processes for end-to-end tests: logs, readiness waits that scale to the machine, and
clean stops (used through ``tests/support/servers.py``).

:func:`wait_progressing` polls until a condition holds and fails only when a process exited, or
when none of the processes it waits for made progress (used CPU or wrote to its log) for
:data:`STALL_TIMEOUT_S`, or after :data:`MAX_WAIT_S` in all: a slow, busy machine only makes the
wait longer; a hung start still fails.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

#: A start fails when no process it waits for used CPU or logged anything for this long (s).
STALL_TIMEOUT_S = 240.0
#: Upper bound on any one readiness wait, however busy the machine (s).
MAX_WAIT_S = 1800.0
#: Seconds between two looks at whether a process being waited for still makes progress.
PROGRESS_CHECK_S = 5.0
#: Seconds a process gets to exit after SIGTERM before SIGKILL.
STOP_TIMEOUT_S = 120.0
#: Environment of every child: nothing is downloaded.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_table() -> dict[int, list[str]]:
    """``/proc/PID/stat`` fields (after the command name) of every process, in one scan."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat_fields(int(entry))
            if fields is not None:
                table[int(entry)] = fields
    return table


def descendants(root: int, table: dict[int, list[str]] | None = None) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time in clock ticks (so a reused pid is
    not confused with the original). ``table``: a :func:`_process_table` scan to reuse."""
    table = _process_table() if table is None else table
    children: dict[int, list[int]] = {}
    for pid, fields in table.items():
        children.setdefault(int(fields[1]), []).append(pid)
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = int(table[child][19])
                todo.append(child)
    return found


def new_descendants(before: dict[int, int]) -> dict[int, int]:
    """The live descendants of this process that are not in ``before`` (an earlier
    :func:`descendants` of it): what a test started, not the session's shared servers."""
    return {pid: start for pid, start in descendants(os.getpid()).items()
            if before.get(pid) != start}


def with_command(procs: dict[int, int], needle: str) -> dict[int, int]:
    """The entries of ``procs`` whose command line contains ``needle``."""
    found = {}
    for pid, start in procs.items():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if needle.encode() in f.read():
                    found[pid] = start
        except OSError:
            pass
    return found


def still_running(procs: dict[int, int]) -> list[int]:
    """The pids of ``procs`` (pid -> start time) that still exist and are not zombies."""
    left = []
    for pid, start in procs.items():
        fields = _stat_fields(pid)
        if fields is not None and int(fields[19]) == start and fields[0] != "Z":
            left.append(pid)
    return left


class Process:
    """A child process whose stdout+stderr go to ``log_path``; stopped by :meth:`stop`.

    Args:
        cmd: the command line.
        log_path: file receiving the process's output.
        env: variables added to this process's environment (plus :data:`OFFLINE_ENV`).
    """

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._cmd, self._env = cmd, dict(os.environ, **OFFLINE_ENV, **(env or {}))
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self._env)

    def start_again(self) -> None:
        """Run the same command line again (same ports) after the process ended; the log
        continues in the same file."""
        assert self.proc.poll() is not None, "still running"
        self._log.close()
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=self._env)

    def log_text(self) -> str:
        """The whole log ("" when it cannot be read)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the log."""
        return "\n".join(self.log_text().splitlines()[-n:])

    def check_alive(self) -> None:
        """Raises RuntimeError (with the log tail) when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_tail()}")

    def progress_mark(self, table: dict[int, list[str]]) -> tuple[int, int]:
        """(CPU clock ticks of the process and its descendants, log size): both grow while it
        works. ``table``: a :func:`_process_table` scan."""
        try:
            size = self.log_path.stat().st_size
        except OSError:
            size = 0
        ticks = 0
        for pid in (self.proc.pid, *descendants(self.proc.pid, table)):
            if pid in table:
                ticks += int(table[pid][11]) + int(table[pid][12])  # utime + stime
        return ticks, size

    def stop(self) -> None:
        """SIGTERM; SIGKILL if still running after :data:`STOP_TIMEOUT_S`; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the process and all its descendants at once; returns when they are gone."""
        family = descendants(self.proc.pid)
        self.proc.kill()
        self.proc.wait(10)
        for pid in still_running(family):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while still_running(family):
            if time.monotonic() > deadline:
                raise TimeoutError(f"processes {sorted(family)} survived SIGKILL")
            time.sleep(0.05)


def stop_together(procs: list[Process]) -> None:
    """Stops ``procs`` in parallel: SIGTERM to every one still running first, then
    :meth:`Process.stop` on each (so their shutdowns overlap instead of adding up)."""
    for p in procs:
        if p.proc.poll() is None:
            p.proc.terminate()
    for p in procs:
        p.stop()


def wait_progressing(ready: Callable[[], bool], procs: list[Process], what: str,
                     stall_timeout_s: float = STALL_TIMEOUT_S,
                     max_wait_s: float = MAX_WAIT_S, poll_s: float = 0.2) -> None:
    """Polls ``ready()`` until it is true, for as long as ``procs`` are alive and progressing.

    Args:
        ready: the condition (exceptions it raises propagate).
        procs: the processes being waited for.
        what: named in the error messages.
        stall_timeout_s: fail when none of ``procs`` used CPU or logged for this long.
        max_wait_s: fail after this long in any case.

    Raises:
        RuntimeError: one of ``procs`` exited. TimeoutError: stalled, or ``max_wait_s`` passed.
    """
    start = last_progress = last_check = time.monotonic()
    marks = [p.progress_mark(_process_table()) for p in procs]
    while True:
        for p in procs:
            p.check_alive()
        if ready():
            return
        now = time.monotonic()
        if now - last_check >= PROGRESS_CHECK_S:
            table = _process_table()
            new = [p.progress_mark(table) for p in procs]
            last_check = now
            if new != marks:
                marks, last_progress = new, now
        if now - last_progress > stall_timeout_s or now - start > max_wait_s:
            tails = "\n".join(f"--- {p.log_path.name}\n{p.log_tail()}" for p in procs)
            raise TimeoutError(f"{what}: not ready after {now - start:.0f} s "
                               f"(no progress for {now - last_progress:.0f} s):\n{tails}")
        time.sleep(poll_s)
