"""End to end: the only prefiller is killed (SIGKILL); ``pdserve proxy`` answers every request
through decode-only fallback on the real decoder, with the greedy output of a single instance,
counts the fallbacks, leaves no KV block held, and with ``--enforce-disagg`` answers 503."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.processes import stop_together
from tests.support.servers import POOL_COMMON, EngineServer, ProxyServer, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when a goldsmith in Mainz",
    "In the morning the fishing boats leave the harbour and return in the evening with their catch",
]
FALLBACK = "pdserve:proxy_decode_only_fallback_total"


def proxy_metric(proxy: ProxyServer, name: str) -> float:
    for line in proxy.client.get("/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0


def text_of(client: httpx.Client, body: dict) -> str:
    if not body.get("stream"):
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    out = ""
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                out += "".join(ch.get("text") or "" for ch in event.get("choices") or [])
    return out


def test_killed_prefiller_is_replaced_by_decode_only_fallback(server_pool, tmp_path):
    model = server_pool.model
    pooled = server_pool.get("single", "d_fail")
    single, d = pooled["single"], pooled["d_fail"]
    p = EngineServer(model, tmp_path / "p.log", nixl_config("kv_producer"), list(POOL_COMMON))
    proxies: list[ProxyServer] = []
    try:
        start_all([p])
        proxy = ProxyServer([p], [d], tmp_path / "proxy.log", ["--breaker-failures", "2"])
        proxies.append(proxy)
        proxy.wait_ready()
        body = {"model": model, "max_tokens": 12, "temperature": 0.0}
        expected = {prompt: text_of(single.client, dict(body, prompt=prompt)) for prompt in PROMPTS}
        before = d.metrics().get("pdserve:prompt_tokens_transferred_total", 0.0)
        assert text_of(proxy.client, dict(body, prompt=PROMPTS[0])) == expected[PROMPTS[0]]
        assert d.metrics().get("pdserve:prompt_tokens_transferred_total", 0.0) > before  # P/D
        assert proxy_metric(proxy, FALLBACK) == 0

        p.kill()  # SIGKILL: no goodbye, its port refuses connections
        n = 0
        for stream in (False, True):
            for prompt in PROMPTS:
                assert text_of(proxy.client, dict(body, prompt=prompt, stream=stream)) == \
                    expected[prompt], (prompt, stream)
                n += 1
        assert proxy_metric(proxy, FALLBACK) == n
        health = proxy.client.get("/health").json()
        assert health["status"] == "degraded" and health["breakers"]["prefill"] == {p.url: "open"}
        d.wait_all_blocks_free()

        strict = ProxyServer([p], [d], tmp_path / "proxy-strict.log", ["--enforce-disagg"])
        proxies.append(strict)
        strict.wait_ready()
        r = strict.client.post("/v1/completions", json=dict(body, prompt=PROMPTS[0]))
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert error["type"] == "upstream_unavailable" and "--enforce-disagg" in error["message"]
        assert p.url in error["message"]
    finally:
        stop_together([*proxies, p])
