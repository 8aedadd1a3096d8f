"""End to end through ``pdserve proxy`` in the concurrent hand-off (docs/proxy.md): an instance
that dies in the middle of a hand-off costs the client nothing it already had and leaks no block.

- **P killed while D waits**: P is frozen (SIGSTOP, with its engine core) before the request, so
  the decode leg reaches D, whose pending claim waits at P's side channel; then P is killed. The
  proxy closes the decode leg (D aborts the pending request and frees its blocks) and, with no
  prefiller left, D serves the request alone: the client's answer equals one instance's. A
  chat stream's client has D's opening chunk before P is killed; it gets no second one, and
  every chunk of D's second request carries the first one's id and created.
- **D killed while P holds the KV for it**: D is frozen before the request, so P prefills and
  holds the prompt's blocks under the transfer id for a reader that never comes; then D is
  killed. The proxy releases P's blocks at once (well before P's lease) and answers the client
  with an OpenAI-style error: no decoder is left.

The client leaving before P has prefilled is
``test_concurrent_handoff_e2e.py::test_a_client_gone_before_the_prefill_frees_both_sides``.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import threading

import httpx
import pytest

from tests.support.processes import descendants
from tests.support.servers import BLOCK_SIZE as B
from tests.support.servers import POOL_COMMON as COMMON
from tests.support.servers import EngineServer, ProxyServer, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LEASE_S = 120.0  # long: blocks freed within seconds were released, not expired
FALLBACK = "pdserve:proxy_decode_only_fallback_total"


def signal_family(server: EngineServer, sig: signal.Signals) -> None:
    """Send ``sig`` to the server's API process and every process below it (its engine core)."""
    for pid in (server.proc.pid, *descendants(server.proc.pid)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def proxy_counter(proxy: ProxyServer, name: str) -> float:
    total = 0.0
    for line in proxy.client.get("/metrics").text.splitlines():
        if line.startswith(name):
            total += float(line.rpartition(" ")[2])
    return total


def body(model: str, seed: int, stream: bool) -> dict:
    prompt = [(seed * 7919 + i * 31) % 900 + 10 for i in range(5 * B + 3)]
    return {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "stream": stream}


def completion_text(response: httpx.Response, stream: bool) -> str:
    assert response.status_code == 200, response.text
    if not stream:
        return response.json()["choices"][0]["text"]
    text = ""
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            event = httpx.Response(200, content=line[len("data: "):]).json()
            assert "error" not in event, event
            text += "".join(ch.get("text") or "" for ch in event.get("choices") or [])
    return text


@pytest.fixture
def deployment(server_pool, tmp_path, request):
    """An own P or D (``request.param``: which one the test kills), the pooled other one, the
    pooled oracle ``single`` and a proxy over the pair (started after a first request warmed
    its role check and P's endpoints)."""
    pooled = server_pool.get("single", "p", "d_fail")
    own_role = request.param
    if own_role == "p":
        own = EngineServer(server_pool.model, tmp_path / "p.log",
                           nixl_config("kv_producer", kv_lease_duration=LEASE_S), COMMON)
    else:
        own = EngineServer(server_pool.model, tmp_path / "d.log", nixl_config("kv_consumer"),
                           COMMON)
    proxy = None
    try:
        start_all([own])
        p, d = (own, pooled["d_fail"]) if own_role == "p" else (pooled["p"], own)
        proxy = ProxyServer([p], [d], tmp_path / "proxy.log")
        proxy.wait_ready()
        warm = proxy.client.post("/v1/completions", json=body(server_pool.model, 1, False))
        assert warm.status_code == 200, warm.text
        yield {"p": p, "d": d, "single": pooled["single"], "proxy": proxy,
               "model": server_pool.model}
    finally:
        if proxy is not None:
            proxy.stop()
        own.kill()


@pytest.mark.parametrize("deployment", ["p"], indirect=True)
def test_prefiller_killed_while_the_decoder_waits(deployment):
    p, d, proxy = deployment["p"], deployment["d"], deployment["proxy"]
    req = body(deployment["model"], 2, stream=True)
    expected = deployment["single"].client.post(
        "/v1/completions", json=dict(req, stream=False)).json()["choices"][0]["text"]
    fallbacks = proxy_counter(proxy, FALLBACK)
    signal_family(p, signal.SIGSTOP)
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(proxy.client.post, "/v1/completions", json=req)
        # the decode leg is in: D waits for P's KV at P's frozen side channel
        d.wait_metrics(lambda m: m.get("pdserve:num_requests_waiting", 0) >= 1)
        p.kill()
        response = answer.result(timeout=120)
    assert completion_text(response, stream=True) == expected
    assert proxy_counter(proxy, FALLBACK) == fallbacks + 1  # D served it alone
    d.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("deployment", ["p"], indirect=True)
def test_prefiller_killed_after_the_chat_streams_opening_chunk(deployment):
    p, d, proxy = deployment["p"], deployment["d"], deployment["proxy"]
    req = {"model": deployment["model"], "max_tokens": 6, "temperature": 0,
           "messages": [{"role": "user", "content": "Name a river, then " + "a bridge " * 20}]}
    expected = deployment["single"].client.post(
        "/v1/chat/completions", json=req).json()["choices"][0]["message"]["content"]
    fallbacks = proxy_counter(proxy, FALLBACK)
    opened = threading.Event()

    def read_stream() -> list[dict]:
        events = []
        with proxy.client.stream("POST", "/v1/chat/completions",
                                 json=dict(req, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[len("data: "):]))
                    opened.set()
        return events

    signal_family(p, signal.SIGSTOP)
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(read_stream)
        # D's opening chunk reaches the client while D waits at P's frozen side channel
        assert opened.wait(60) and not answer.done()
        p.kill()
        events = answer.result(timeout=120)
    assert not any("error" in e for e in events), events
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events
                   if e["choices"]) == expected
    assert sum("role" in e["choices"][0]["delta"] for e in events if e["choices"]) == 1
    assert len({e["id"] for e in events}) == 1 and len({e["created"] for e in events}) == 1
    assert proxy_counter(proxy, FALLBACK) == fallbacks + 1  # D served it alone
    d.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("deployment", ["d"], indirect=True)
def test_decoder_killed_while_the_prefiller_holds_its_kv(deployment):
    p, d, proxy = deployment["p"], deployment["d"], deployment["proxy"]
    expired = p.metrics().get("pdserve:nixl_num_kv_expired_reqs", 0.0)
    signal_family(d, signal.SIGSTOP)
    with cf.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(proxy.client.post, "/v1/completions",
                             json=body(deployment["model"], 3, stream=False))
        # P prefilled and holds the prompt's blocks for D's claim
        p.wait_metrics(lambda m: m["pdserve:kv_cache_free_blocks"]
                       < m["pdserve:kv_cache_total_blocks"])
        d.kill()
        response = answer.result(timeout=120)
    assert response.status_code in (502, 503), response.text
    error = response.json()["error"]
    assert error["code"] == response.status_code and error["message"], error
    m = p.wait_all_blocks_free(timeout_s=15)  # released by the proxy, not by the 120 s lease
    assert m.get("pdserve:nixl_num_kv_expired_reqs", 0.0) == expired
    assert proxy.client.get("/health").status_code in (200, 503)  # the proxy still answers
