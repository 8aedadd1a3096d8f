"""Real ``pdserve serve`` and ``pdserve proxy`` subprocesses for end-to-end proxy tests."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    """A free localhost TCP port (bound once, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A child process whose stdout+stderr go to ``log_path``; stopped by :meth:`stop`."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.log_path.name} exited with {self.proc.returncode}:\n"
                               f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


class EngineServer(Process):
    """``pdserve serve MODEL`` on a free port, with its own NIXL side-channel port."""

    def __init__(self, model: str, log_path: Path, kv_role: str | None, args: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(self.port), *args]
        if kv_role is not None:
            cmd += ["--kv-transfer-config",
                    json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role})]
        super().__init__(cmd, log_path, {"PDSERVE_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                         "PDSERVE_NIXL_SIDE_CHANNEL_PORT": str(free_port()),
                                         "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})

    def wait_ready(self, deadline: float) -> None:
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


class ProxyServer(Process):
    """``pdserve proxy --port 0`` in front of the given instances; ``url`` once it listens."""

    def __init__(self, prefillers: list[EngineServer], decoders: list[EngineServer], log_path: Path,
                 extra: list[str] | None = None):
        cmd = [sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0",
               "--prefiller-ports", *(str(s.port) for s in prefillers),
               "--decoder-ports", *(str(s.port) for s in decoders), *(extra or [])]
        super().__init__(cmd, log_path)
        self.url = ""

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            m = re.search(r"listening on (\S+)", self.log_path.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return
            time.sleep(0.1)
        raise TimeoutError(f"proxy not listening in time:\n{self.log_tail()}")
