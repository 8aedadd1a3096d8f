"""`pdserve bench multi-turn` against real processes: one `pdserve serve` on the tiny Llama, and
a P/D deployment (`pdserve up --multi-turn`) with `--send-conversation-id`."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.bench.multi_turn import main
from pdserve.bench.runner import count_prompt_tokens
from pdserve.bench.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 300
ENGINE_ARGS = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spec(tmp_path: Path, num_conversations: int, user_tokens: int) -> Path:
    spec = {
        "filetype": "generate_conversations",
        "num_conversations": num_conversations,
        "prompt_input": {
            "num_turns": {"distribution": "constant", "value": 6},
            "common_prefix_num_tokens": {"distribution": "constant", "value": 40},
            "num_tokens": {"distribution": "uniform", "min": user_tokens, "max": user_tokens + 10},
        },
        "prompt_output": {"num_tokens": {"distribution": "uniform", "min": 4, "max": 8}},
    }
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _stop(proc: subprocess.Popen) -> None:
    """Stop a child started in its own session, with everything it spawned."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def _wait_healthy(proc: subprocess.Popen, url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.3)


@pytest.fixture
def engine_server(tmp_path, tiny_llama_path):
    port = _free_port()
    log = tmp_path / "serve.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", tiny_llama_path, "--port", str(port),
             *ENGINE_ARGS],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url + "/health", log)
        yield url
    finally:
        _stop(proc)


def test_against_a_real_engine(tmp_path, capsys, engine_server, tiny_llama_path):
    stats_path, out_path = tmp_path / "stats.json", tmp_path / "answers.json"
    rc = main(["-i", str(_spec(tmp_path, 3, 20)), "-m", tiny_llama_path, "-u", engine_server,
               "-p", "2", "-k", "3", "--no-progress", "--stats-json-output", str(stats_path),
               "-o", str(out_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    stats = json.loads(stats_path.read_text())
    records = stats["requests"]
    assert len(records) == 9 and all(r["ok"] for r in records)  # 3 conversations x 3 turns
    assert stats["summary"]["sections"]["turn 1"]["ttft_ms"]["count"] == 3
    assert stats["summary"]["sections"]["turns 2+"]["ttft_ms"]["count"] == 6
    for r in records:
        assert r["usage_from_server"]
        # max_tokens == min_tokens: the engine produces exactly the requested length
        assert r["output_num_tokens"] == r["max_tokens"]
        assert 0 < r["ttft_ms"] <= r["latency_ms"]
    by_conv: dict[str, list[dict]] = {}
    for r in sorted(records, key=lambda r: r["turn"]):
        by_conv.setdefault(r["conversation_id"], []).append(r)
    for turns in by_conv.values():
        assert [r["turn"] for r in turns] == [1, 2, 3]
        tokens = [r["input_num_tokens"] for r in turns]
        assert tokens[0] < tokens[1] < tokens[2]  # the history grows turn by turn

    # the server's prompt token counts equal the bench's own count of the messages it sent
    tokenizer = load_tokenizer(tiny_llama_path)
    for conv in json.loads(out_path.read_text()):
        messages = conv["messages"]
        assert [m["role"] for m in messages] == ["user", "assistant"] * 3
        for turn in range(3):
            sent = messages[: 2 * turn + 1]
            record = by_conv[conv["id"]][turn]
            assert count_prompt_tokens(tokenizer, sent) == record["input_num_tokens"]


def _metric(text: str, name: str) -> float:
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)]
    assert values, f"metric {name} not exposed"
    return sum(values)


@pytest.fixture
def pd_deployment(tmp_path, tiny_llama_path):
    port = _free_port()
    log_dir = tmp_path / "up-logs"
    log = tmp_path / "up.log"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", tiny_llama_path, "--multi-turn",
             "--port", str(port), "--log-dir", str(log_dir),
             "--startup-timeout", str(STARTUP_TIMEOUT_S), "--", *ENGINE_ARGS],
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
            start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S + 30
        status: dict = {}
        while status.get("state") != "ready":
            if proc.poll() is not None:
                pytest.fail(f"pdserve up exited with {proc.returncode}:\n{log.read_text()}")
            assert time.monotonic() < deadline, log.read_text()
            try:
                status = json.loads((log_dir / "pdserve-up.json").read_text())
            except (FileNotFoundError, json.JSONDecodeError):
                status = {}
            time.sleep(0.3)
        yield f"http://127.0.0.1:{port}", status
    finally:
        _stop(proc)


def test_through_the_multi_turn_proxy_with_conversation_ids(tmp_path, capsys, pd_deployment,
                                                            tiny_llama_path):
    url, status = pd_deployment
    stats_path = tmp_path / "stats.json"
    rc = main(["-i", str(_spec(tmp_path, 2, 30)), "-m", tiny_llama_path, "-u", url,
               "-p", "2", "--no-progress", "--send-conversation-id",
               "--stats-json-output", str(stats_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    records = json.loads(stats_path.read_text())["requests"]
    assert len(records) == 6 and all(r["ok"] for r in records)
    assert all(r["output_num_tokens"] == r["max_tokens"] for r in records)
    # The proxy linked the turns: it remembers exactly one entry per conversation id sent.
    proxy_metrics = httpx.get(url + "/metrics", timeout=30).text
    assert _metric(proxy_metrics, "pdserve:proxy_conversations") == 2
    # The answers were decoded on D from KV computed on P (P -> D over NIXL).
    decode = next(c for c in status["children"] if c["role"] == "decode")
    metrics = httpx.get(decode["url"] + "/metrics", timeout=30).text
    assert _metric(metrics, "pdserve:prompt_tokens_transferred_total") > 0
