"""End to end: ``pdserve up`` on the embedded SmolLM2, a two-turn chat through the proxy.

Starts the real deployment (one prefiller, one decoder, the multi-turn proxy; separate processes,
NIXL over UCX between P and D) exactly as a user would, talks to it with the ``openai`` client,
checks on the decoder's ``/metrics`` that the prompt's KV cache came from the prefiller, then
sends SIGTERM to the launcher and checks that every process it started (children and their own
children, found by scanning ``/proc``) is gone.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_TIMEOUT_S = 600  # the first start converts the GGUF once into the cache
SHUTDOWN_TIMEOUT_S = 90


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stat(pid: int) -> tuple[int, int, str] | None:
    """(ppid, start time in clock ticks, state) of a process, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return int(fields[1]), int(fields[19]), fields[0]


def _descendants(root: int) -> dict[int, int]:
    """Every live descendant of ``root``: pid -> start time (so a reused pid is not confused)."""
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append(int(entry))
                starts[int(entry)] = stat[1]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found[child] = starts[child]
                todo.append(child)
    return found


def _still_running(procs: dict[int, int]) -> list[int]:
    """The pids of ``procs`` that still exist with the same start time and are not zombies."""
    left = []
    for pid, start in procs.items():
        stat = _proc_stat(pid)
        if stat is not None and stat[1] == start and stat[2] != "Z":
            left.append(pid)
    return left


def _metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) in Prometheus text; fails if absent."""
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)]
    assert values, f"metric {name} not exposed"
    return sum(values)


class Deployment:
    """A running ``pdserve up`` subprocess and what its status file says."""

    def __init__(self, tmp_path: Path):
        self.log_dir = tmp_path / "logs"
        self.out_path = tmp_path / "pdserve-up.out"
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self.status: dict = {}
        self.processes: dict[int, int] = {}

    def start(self) -> None:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "up", "--multi-turn", "--device", "cpu",
                 "--port", str(self.port), "--log-dir", str(self.log_dir),
                 "--startup-timeout", str(STARTUP_TIMEOUT_S), "--",
                 "--kv-cache-memory", "256MiB", "--max-model-len", "2048"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        status_file = self.log_dir / "pdserve-up.json"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S + 30
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"pdserve up exited with {self.proc.returncode}:\n{self.output()}")
            try:
                self.status = json.loads(status_file.read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                self.status = {}
            if self.status.get("state") == "ready":
                break
            assert time.monotonic() < deadline, f"not ready in time:\n{self.output()}"
            time.sleep(0.5)
        self.processes = _descendants(self.proc.pid)

    def child(self, role: str) -> dict:
        return next(c for c in self.status["children"] if c["role"] == role)

    def stop(self, sig: int = signal.SIGTERM) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout=SHUTDOWN_TIMEOUT_S)

    def kill_everything(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.processes.update(_descendants(self.proc.pid))
            self.proc.kill()
            self.proc.wait()
        for pid in _still_running(self.processes):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def deployment(tmp_path):
    dep = Deployment(tmp_path)
    dep.start()
    try:
        yield dep
    finally:
        dep.kill_everything()


def test_up_two_turn_chat_with_kv_transfer(deployment):
    from openai import OpenAI

    deployment.wait_ready()
    out = deployment.output()
    endpoint = f"http://127.0.0.1:{deployment.port}"
    assert f"endpoint  {endpoint}/v1" in out
    assert "from openai import OpenAI" in out and "curl -s" in out

    # one prefiller, one decoder and the proxy, each its own process with its own ports
    roles = sorted(c["role"] for c in deployment.status["children"])
    assert roles == ["decode", "prefill", "proxy"]
    prefill, decode = deployment.child("prefill"), deployment.child("decode")
    assert prefill["side_channel_port"] != decode["side_channel_port"]
    assert {c["pid"] for c in deployment.status["children"]} <= set(deployment.processes)

    client = OpenAI(base_url=f"{endpoint}/v1", api_key="EMPTY", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    conversation = {"conversation_id": f"e2e-{uuid.uuid4().hex[:8]}"}
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                           temperature=0, extra_body=conversation)
    answer = first.choices[0].message.content
    assert "paris" in answer.lower(), answer

    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And what is the capital of Italy?"}]
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=32,
                                            temperature=0, extra_body=conversation)
    assert second.choices[0].message.content.strip()
    assert second.usage.prompt_tokens > first.usage.prompt_tokens

    # the decoder computed no prompt from scratch: its KV came from the prefiller over NIXL
    metrics = httpx.get(decode["url"] + "/metrics", timeout=30).text
    transferred = _metric(metrics, "pdserve:prompt_tokens_transferred_total")
    prompt_tokens = first.usage.prompt_tokens + second.usage.prompt_tokens
    assert 0 < transferred <= prompt_tokens
    assert _metric(metrics, "pdserve:nixl_num_failed_transfers") == 0

    rc = deployment.stop(signal.SIGTERM)
    assert rc == 0, deployment.output()
    deadline = time.monotonic() + 10
    while _still_running(deployment.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _still_running(deployment.processes) == [], deployment.output()
    assert "pdserve up: stopped (exit code 0)" in deployment.output()
    # the servers' helpers (multiprocessing's resource tracker) exit by themselves: not reported
    assert "left behind" not in deployment.output(), deployment.output()
