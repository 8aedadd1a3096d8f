"""A CUDA MPS control daemon of one ``pdserve up``'s own (``--cuda-mps``), so that engines sharing
a GPU run their kernels side by side instead of in turns.

Without MPS, two processes on one GPU (P and D of a one-GPU deployment) are time-sliced: while
the decoder's steps run, the prefiller's kernels wait for a slice, and the reverse. Under NVIDIA's
Multi-Process Service the processes' kernels go to one server that runs them concurrently, as
streams of one process would be (NVIDIA, "Multi-Process Service", the MPS documentation shipped
with the driver). The daemon started here uses pipe and log directories under ``--log-dir``, so
it serves this deployment's engines only (they get ``CUDA_MPS_PIPE_DIRECTORY`` and
``CUDA_MPS_LOG_DIRECTORY``), and it is told to quit when the deployment stops. Measured effect
on a one-GPU P/D deployment: docs/benchmarks.md, "One GPU under MPS".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from pdserve.launcher.errors import LaunchError

#: The daemon's executable (on ``PATH``; NVIDIA's driver installs it beside ``nvidia-smi``).
CONTROL = "nvidia-cuda-mps-control"
#: Seconds the daemon gets to create its control pipe after ``-d``, and to quit.
READY_TIMEOUT_S = 10.0
#: Longest Unix socket path (bytes): ``sun_path`` holds 108 with its terminating NUL (Linux,
#: unix(7)); the daemon's pipe ``<directory>/pipe/control`` is such a socket.
SOCKET_PATH_MAX = 107


class CudaMps:
    """One MPS control daemon whose pipe and log directories lie under ``directory``.

    Args:
        directory: created if missing; ``pipe/`` and ``log/`` go under it. Its path must be
            short: the daemon's pipe is a Unix socket path (at most :data:`SOCKET_PATH_MAX`
            bytes).
        control: the control executable (a name looked up on ``PATH``, or a path).

    Attributes:
        directory: as given.
        env: the variables that point a CUDA process at this daemon
            (``CUDA_MPS_PIPE_DIRECTORY``, ``CUDA_MPS_LOG_DIRECTORY``).
    """

    def __init__(self, directory: Path, control: str = CONTROL):
        self.directory = Path(directory)
        self.control = control
        pipe, log = self.directory / "pipe", self.directory / "log"
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(log)}
        self._started = False

    def _run(self, args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([self.control, *args], input=stdin, text=True, capture_output=True,
                              env={**os.environ, **self.env}, timeout=READY_TIMEOUT_S)

    def start(self) -> dict[str, str]:
        """Start the daemon (``nvidia-cuda-mps-control -d``) and wait for its control pipe.

        Returns:
            :attr:`env`, for every engine's environment.

        Raises:
            LaunchError: the executable is not found, the daemon exits non-zero, or its
                control pipe does not appear within :data:`READY_TIMEOUT_S` (the message
                carries the daemon's own log lines).
        """
        if shutil.which(self.control) is None:
            raise LaunchError(f"--cuda-mps: {self.control} not found on PATH (it comes with the "
                              f"NVIDIA driver)")
        pipe = Path(self.env["CUDA_MPS_PIPE_DIRECTORY"])
        if len(os.fsencode(pipe / "control")) > SOCKET_PATH_MAX:
            raise LaunchError(f"--cuda-mps: the pipe path {pipe} is too long for a Unix socket; "
                              f"use a shorter --log-dir")
        pipe.mkdir(parents=True, exist_ok=True)
        Path(self.env["CUDA_MPS_LOG_DIRECTORY"]).mkdir(parents=True, exist_ok=True)
        try:
            res = self._run(["-d"])
        except subprocess.TimeoutExpired:
            raise LaunchError(f"--cuda-mps: {self.control} -d did not return within "
                              f"{READY_TIMEOUT_S:.0f} s") from None
        if res.returncode != 0:
            raise LaunchError(f"--cuda-mps: {self.control} -d exited with {res.returncode}: "
                              f"{(res.stderr or res.stdout).strip()[-500:]}{self._log_tail()}")
        self._started = True
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (pipe / "control").exists():
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"--cuda-mps: the MPS control daemon made no pipe in {pipe} "
                                  f"within {READY_TIMEOUT_S:.0f} s{self._log_tail()}")
            time.sleep(0.05)
        return dict(self.env)

    def stop(self) -> None:
        """Tell the daemon to quit (it waits for its clients to end first). Idempotent; never
        raises: a daemon that does not answer within :data:`READY_TIMEOUT_S` is left running,
        and its log (under :attr:`directory`) says why."""
        if not self._started:
            return
        self._started = False
        try:
            self._run([], stdin="quit\n")
        except (OSError, subprocess.TimeoutExpired):
            pass

    def _log_tail(self) -> str:
        path = Path(self.env["CUDA_MPS_LOG_DIRECTORY"]) / "control.log"
        try:
            lines = path.read_text(errors="replace").splitlines()[-5:]
        except OSError:
            return ""
        return ("; its log " + str(path) + ":\n  " + "\n  ".join(lines)) if lines else ""
