"""End to end: ``pdserve up`` on the embedded SmolLM2, a two-turn chat through the proxy.

Starts the real deployment (one prefiller, one decoder, the multi-turn proxy; separate processes,
NIXL over UCX between P and D) exactly as a user would, talks to it with the ``openai`` client,
checks on the decoder's ``/metrics`` that the prompt's KV cache came from the prefiller, then
sends SIGTERM to the launcher and checks that every process it started (children and their own
children, found by scanning ``/proc``) is gone.
"""

from __future__ import annotations

import re
import signal
import time
import uuid

import httpx
import pytest

from tests.support.servers import UpDeployment, still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STARTUP_TIMEOUT_S = 600  # the first start converts the GGUF once into the cache
SHUTDOWN_TIMEOUT_S = 90


def _metric(text: str, name: str) -> float:
    """Sum of the samples of ``name`` (any labels) in Prometheus text; fails if absent."""
    values = [float(m.group(1)) for m in re.finditer(
        rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", text, re.MULTILINE)]
    assert values, f"metric {name} not exposed"
    return sum(values)


@pytest.fixture
def deployment(tmp_path):
    dep = UpDeployment(["--multi-turn", "--device", "cpu", "--startup-timeout",
                        str(STARTUP_TIMEOUT_S), "--", "--kv-cache-memory", "256MiB",
                        "--max-model-len", "2048"], tmp_path / "logs")
    try:
        yield dep
    finally:
        dep.kill_everything()


def test_up_two_turn_chat_with_kv_transfer(deployment):
    from openai import OpenAI

    deployment.wait_ready()
    out = deployment.log_text()
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

    rc = deployment.signal_and_wait(signal.SIGTERM, SHUTDOWN_TIMEOUT_S)
    assert rc == 0, deployment.log_text()
    deadline = time.monotonic() + 10
    while still_running(deployment.processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(deployment.processes) == [], deployment.log_text()
    assert "pdserve up: stopped (exit code 0)" in deployment.log_text()
    # the servers' helpers (multiprocessing's resource tracker) exit by themselves: not reported
    assert "left behind" not in deployment.log_text(), deployment.log_text()


def test_up_with_data_parallel_groups(tmp_path, server_pool):
    """``--prefill-dp 2 --decode-dp 2``: one API server per group, two engine cores each; the
    proxy's requests are spread over the ranks, every decoder rank reads KV from the prefiller
    rank that computed it, and the outputs equal a single instance's."""
    from tests.support.servers import POOL_COMMON, generate

    single = server_pool.get("single")["single"]
    dep = UpDeployment([server_pool.model, "--prefill-dp", "2", "--decode-dp", "2",
                        "--device", "cpu", "--", *POOL_COMMON], tmp_path / "logs")
    try:
        dep.wait_ready()
        prefill, decode = dep.child("prefill"), dep.child("decode")
        base = prefill["side_channel_port"]
        assert prefill["data_parallel_size"] == decode["data_parallel_size"] == 2
        assert f"2 data-parallel ranks, side channels {base}-{base + 1}" in dep.log_text()
        bodies = [{"model": server_pool.model, "prompt": f"Item {i}: the harbour town's ships " * 4,
                   "max_tokens": 6, "temperature": 0} for i in range(4)]
        expected = [generate(single, "completions", b)["text"] for b in bodies]
        with httpx.Client(base_url=dep.url, timeout=300) as client:
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(4) as pool:
                answers = list(pool.map(lambda b: client.post("/v1/completions", json=b), bodies))
        assert [r.json()["choices"][0]["text"] for r in answers] == expected
        d_metrics = httpx.get(decode["url"] + "/metrics", timeout=30).text
        assert _metric(d_metrics, "pdserve:nixl_num_failed_transfers") == 0
        assert _metric(d_metrics, "pdserve:prompt_tokens_computed_total") == 0
        for rank in ("0", "1"):  # both decoder ranks read KV, both prefiller ranks computed
            assert _metric(d_metrics, f'pdserve:prompt_tokens_transferred_total{{dp_rank="{rank}"}}') > 0
            p_metrics = httpx.get(prefill["url"] + "/metrics", timeout=30).text
            assert _metric(p_metrics, f'pdserve:prompt_tokens_total{{dp_rank="{rank}"}}') > 0
        assert dep.signal_and_wait(signal.SIGTERM, SHUTDOWN_TIMEOUT_S) == 0, dep.log_text()
        deadline = time.monotonic() + 10
        while still_running(dep.processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert still_running(dep.processes) == [], dep.log_text()
    finally:
        dep.kill_everything()
