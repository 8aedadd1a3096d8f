"""Real ``pdserve serve`` and ``pdserve proxy`` subprocesses for end-to-end tests.

Each process gets free localhost ports, logs stdout+stderr to a file, is polled until ready (an
engine's ``/health`` answers 200; a proxy prints ``listening on URL``) and is stopped by
:meth:`Process.stop` (SIGTERM, then SIGKILL after 30 s). Callers stop every process they start,
in a ``finally``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

#: Seconds an engine instance may take to load the model and answer ``/health``.
STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    """A free localhost TCP port (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def nixl_config(role: str, **extra: Any) -> dict:
    """A ``--kv-transfer-config`` dict for the NIXL connector in ``role`` (``kv_producer`` /
    ``kv_consumer``); ``kv_load_failure_policy`` goes at the top level, any other keyword into
    ``kv_connector_extra_config``."""
    cfg: dict[str, Any] = {"kv_connector": "NixlConnector", "kv_role": role}
    policy = extra.pop("kv_load_failure_policy", None)
    if policy:
        cfg["kv_load_failure_policy"] = policy
    if extra:
        cfg["kv_connector_extra_config"] = extra
    return cfg


class Process:
    """A child process whose stdout+stderr go to ``log_path``; stopped by :meth:`stop`.

    Args:
        cmd: the command line.
        log_path: file receiving the process's output.
        env: variables added to this process's environment.
    """

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._cmd, self._env = cmd, dict(os.environ, **(env or {}))
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

    def log_tail(self, n: int = 40) -> str:
        """The last ``n`` lines of the log ("" when it cannot be read)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        """Raises RuntimeError (with the log tail) when the process has exited."""
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM; SIGKILL if still running after 30 s; closes the log."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class EngineServer(Process):
    """``pdserve serve MODEL`` on a free port, with its own NIXL side-channel port.

    Args:
        model: model directory.
        log_path: file receiving the process's output.
        kv_config: ``--kv-transfer-config`` dict (e.g. :func:`nixl_config`), or None for a plain
            instance.
        args: extra CLI arguments.
    """

    def __init__(self, model: str, log_path: Path, kv_config: dict | None = None,
                 args: list[str] | None = None):
        self.port = free_port()
        self.side_channel_port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(self.port),
               *(args or [])]
        if kv_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_config)]
        super().__init__(cmd, log_path, {"PDSERVE_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                         "PDSERVE_NIXL_SIDE_CHANNEL_PORT":
                                             str(self.side_channel_port),
                                         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

    def wait_ready(self, deadline: float) -> None:
        """Polls ``/health`` until 200, until ``time.monotonic()`` passes ``deadline``.

        Raises:
            RuntimeError: the process exited. TimeoutError: not ready by ``deadline``.
        """
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"{self.url} not ready in time:\n{self.log_tail()}")

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as metric name -> value, summed over label sets."""
        values: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_part, _, value = line.rpartition(" ")
                name = name_part.split("{", 1)[0]
                try:
                    values[name] = values.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return values


def start_all(servers: list[EngineServer], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Waits until every server is ready, all within one ``timeout_s`` deadline."""
    deadline = time.monotonic() + timeout_s
    for s in servers:
        s.wait_ready(deadline)


class ProxyServer(Process):
    """``pdserve proxy --port 0`` in front of the given instances; ``url`` once it listens.

    Args:
        prefillers, decoders: the instances (on this host).
        log_path: file receiving the proxy's output.
        extra: extra CLI arguments (e.g. ``["--multi-turn"]``).
    """

    def __init__(self, prefillers: list[EngineServer], decoders: list[EngineServer], log_path: Path,
                 extra: list[str] | None = None):
        cmd = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0",
               "--prefiller-ports", *(str(s.port) for s in prefillers),
               "--decoder-ports", *(str(s.port) for s in decoders), *(extra or [])]
        super().__init__(cmd, log_path)
        self.url = ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Waits for the ``listening on URL`` line and sets ``url``.

        Raises:
            RuntimeError: the process exited. TimeoutError: no such line within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            m = re.search(r"listening on (\S+)", self.log_path.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return
            time.sleep(0.1)
        raise TimeoutError(f"proxy not listening in time:\n{self.log_tail()}")


class RedisServer(Process):
    """``redis-server`` on a free localhost port, without persistence (for the proxy's
    ``--state-store``); ``url`` is ``redis://127.0.0.1:PORT/0``. Skips the test when
    ``redis-server`` is not installed (``.ci/run`` installs it).

    Args:
        log_path: file receiving the server's output.
        port: the port to listen on (default: a free one; give the old one to restart).
    """

    def __init__(self, log_path: Path, port: int | None = None):
        import shutil

        import pytest

        exe = shutil.which("redis-server")
        if exe is None:
            pytest.skip("redis-server is not installed")
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        super().__init__([exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no"], log_path)

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the port accepts connections.

        Raises:
            RuntimeError: the process exited. TimeoutError: not ready within ``timeout`` s.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.05)
        raise TimeoutError(f"redis-server not ready in time:\n{self.log_tail()}")
