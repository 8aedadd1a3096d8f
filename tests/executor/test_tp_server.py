"""``pdserve serve -tp 2`` on CPU: streamed and plain completions equal a TP 1 server's, token
for token; killing one rank's process takes the instance down: a request in flight gets a 503, the
server exits non-zero within seconds and no process of it is left."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.servers import (
    POOL_COMMON, EngineServer, descendants, generate, start_all, still_running)

pytestmark = pytest.mark.slow

#: how long the server may take to exit after a rank died (seconds; a loaded machine)
EXIT_WITHIN_S = 30.0


@pytest.fixture(scope="module")
def servers(tiny_llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tp-server")
    single = EngineServer(tiny_llama_path, logs / "tp1.log", args=POOL_COMMON)
    sharded = EngineServer(tiny_llama_path, logs / "tp2.log",
                           args=[*POOL_COMMON, "-tp", "2", "--num-scheduler-steps", "2"])
    try:
        start_all([single, sharded])
        yield single, sharded
    finally:
        single.stop()
        sharded.stop()


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
def test_tp2_server_greedy_equals_tp1(servers, endpoint, stream):
    single, sharded = servers
    body = {"model": single.client.get("/v1/models").json()["data"][0]["id"],
            "max_tokens": 12, "temperature": 0, "stream": stream, "ignore_eos": True}
    if endpoint == "completions":
        body["prompt"] = "The quick brown fox jumps over the lazy dog. " * 3
    else:
        body["messages"] = [{"role": "user", "content": "Say something about foxes."}]
    ref = generate(single, endpoint, body)
    out = generate(sharded, endpoint, body)
    assert ref["status"] == 200 and out["status"] == 200, (ref, out)
    assert ref["text"] and out["text"] == ref["text"]


def test_killing_a_rank_stops_the_server(servers):
    _, sharded = servers
    family = descendants(sharded.proc.pid)
    workers = [pid for pid in family
               if b"pdserve.executor.worker" in open(f"/proc/{pid}/cmdline", "rb").read()]
    assert len(workers) == 1, family
    # a request in flight when the rank dies gets the API's 503
    body = {"model": sharded.client.get("/v1/models").json()["data"][0]["id"], "prompt": "Hi",
            "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(generate, sharded, "completions", body)
        sharded.wait_metrics(lambda m: m.get("pdserve:num_requests_running", 0) >= 1)
        os.kill(workers[0], signal.SIGKILL)
        start = time.monotonic()
        out = answer.result(EXIT_WITHIN_S)
    assert out["status"] == 503 and out["error"]["error"]["code"] == 503, out
    code = sharded.proc.wait(EXIT_WITHIN_S)
    assert code != 0 and time.monotonic() - start < EXIT_WITHIN_S
    assert "TP rank 1" in sharded.log_text()
    with pytest.raises(httpx.TransportError):
        sharded.client.get("/health", timeout=5)
    deadline = time.monotonic() + 10
    while still_running(family) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not still_running(family)
