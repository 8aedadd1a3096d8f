"""One child process of ``pdserve up``: started in its own session (process group) with
``PR_SET_PDEATHSIG``, signalled alone or with its whole group, its group's liveness, and its
log file's tail."""

from __future__ import annotations

import ctypes
import os
import shlex
import signal
import subprocess
from collections import deque
from pathlib import Path

from pdserve.launcher.plan import ChildSpec

LOG_TAIL_LINES = 40

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _load_prctl():
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: rely on the launcher's own cleanup
        return None


_PRCTL = _load_prctl()  # looked up in the parent: the forked child should do as little as possible


def _die_with_parent(parent_pid: int) -> None:
    """``preexec_fn`` of every child: SIGTERM when the launcher dies, even by SIGKILL (Linux)."""
    if _PRCTL is None:
        return
    _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def tail_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The last ``n`` lines of a text file (``[]`` if it does not exist)."""
    try:
        with open(path, errors="replace") as f:
            return [line.rstrip("\n") for line in deque(f, maxlen=n)]
    except OSError:
        return []


def _group_alive(pgid: int) -> bool:
    """True while a process of group ``pgid`` runs. Zombies do not count: a process that has
    exited but that nobody reaped yet (an orphan waiting for init) has left nothing behind.
    Uses ``/proc`` where there is one, else ``killpg(pgid, 0)`` (which counts zombies)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        entries = None
    if entries is not None:
        for entry in entries:
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # exited meanwhile
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                return True
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Child:
    """A started child: its spec, ``Popen`` handle and log file."""

    def __init__(self, spec: ChildSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.ready = False
        self.starts = 0  # times the process was started (restarts: starts - 1)

    def start(self) -> None:
        """Starts the process (again, after it exited: same command, log appended).

        Raises:
            OSError: the command cannot be executed.
        """
        env = dict(os.environ)
        env.update(self.spec.env)
        parent = os.getpid()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.spec.argv)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.spec.argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent))
        self.starts += 1

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to the child process itself."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def signal_group(self, sig: int) -> None:
        """Sends ``sig`` to the child's whole process group (the child and what it spawned)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def group_alive(self) -> bool:
        """True while the child or any process of its group exists."""
        if self.proc is None:
            return False
        return self.proc.poll() is None or _group_alive(self.proc.pid)
