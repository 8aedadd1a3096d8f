"""API key, health, /metrics, and aborting engine requests when the client goes away."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from tests.support.live_server import live_server, wait_until
from tests.support.fake_engine_for_server import FakeEngine
from prometheus_client.parser import text_string_to_metric_families

from pdserve.entrypoints.server import build_app

USER_HI = [{"role": "user", "content": "hi"}]


async def test_api_key_protects_v1_only() -> None:
    engine = FakeEngine()
    app = build_app(engine, api_key="s3cret")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            for method, path, body in (("POST", "/v1/completions", {"prompt": "x"}),
                                       ("POST", "/v1/chat/completions", {"messages": USER_HI}),
                                       ("GET", "/v1/models", None)):
                r = await c.request(method, path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                err = r.json()["error"]
                assert err["type"] == "AuthenticationError"
                assert err["code"] == 401
        # Malformed JSON without a key is still 401: auth runs before the body is read.
        r = await c.post("/v1/completions", content=b"{",
                         headers={"content-type": "application/json"})
        assert r.status_code == 401
        assert engine.calls == {}
        ok = {"Authorization": "Bearer s3cret"}
        r = await c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=ok)
        assert r.status_code == 200
        assert (await c.get("/v1/models", headers=ok)).status_code == 200
        assert (await c.get("/health")).status_code == 200
        assert (await c.get("/metrics")).status_code == 200


async def test_health_follows_engine(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    assert (await client.get("/health")).status_code == 200
    fake_engine.dead = True
    r = await client.get("/health")
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "ServiceUnavailableError"


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def test_metrics_endpoint(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    import dataclasses

    fake_engine.stats_value = dataclasses.replace(
        fake_engine.stats_value, num_waiting=2, num_waiting_for_remote_kvs=1, kv_cache_usage=0.25, num_free_blocks=75,
        prompt_tokens_total=40, prompt_tokens_computed_total=30, prompt_tokens_cached_total=6,
        prompt_tokens_transferred_total=4, generation_tokens_total=12, num_preemptions_total=1)
    for _ in range(2):
        r = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3})
        assert r.status_code == 200
    fake_engine.emit_connector_stats({"xfer_time_s": [0.002, 0.004], "bytes": [4096],
                                      "num_descriptors": [3], "num_failed_transfers": 2,
                                      "num_kv_expired_reqs": 1})
    r = await client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    text = r.text
    s = _samples(text)
    assert s[("pdserve:num_requests_waiting", ())] == 3
    assert s[("pdserve:kv_cache_usage_perc", ())] == 0.25
    assert s[("pdserve:kv_cache_free_blocks", ())] == 75
    assert s[("pdserve:kv_cache_total_blocks", ())] == 100
    assert s[("pdserve:prompt_tokens_total", ())] == 40
    assert s[("pdserve:prompt_tokens_computed_total", ())] == 30
    assert s[("pdserve:prompt_tokens_cached_total", ())] == 6
    assert s[("pdserve:prompt_tokens_transferred_total", ())] == 4
    assert s[("pdserve:generation_tokens_total", ())] == 12
    assert s[("pdserve:num_preemptions_total", ())] == 1
    assert s[("pdserve:request_success_total", (("finish_reason", "length"),))] == 2
    assert s[("pdserve:time_to_first_token_seconds_count", ())] == 2
    assert s[("pdserve:e2e_request_latency_seconds_count", ())] == 2
    assert s[("pdserve:time_per_output_token_seconds_count", ())] == 2
    assert s[("pdserve:nixl_xfer_time_seconds_count", ())] == 2
    assert s[("pdserve:nixl_bytes_transferred_sum", ())] == 4096
    assert s[("pdserve:nixl_num_descriptors_count", ())] == 1
    # Exposed names are exactly the documented ones (no doubled or missing _total).
    assert "\npdserve:nixl_num_failed_transfers 2.0\n" in text
    assert "\npdserve:nixl_num_kv_expired_reqs 1.0\n" in text
    assert "\npdserve:nixl_num_failed_notifications 0.0\n" in text
    assert "_total_total" not in text


async def _start_stream(base: str, path: str, body: dict) -> None:
    """Opens a streaming request and drops the connection after the response headers."""
    async with httpx.AsyncClient(base_url=base, timeout=10) as c:
        async with c.stream("POST", path, json=body) as r:
            assert r.status_code == 200


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": USER_HI})])
async def test_client_disconnect_aborts_request(stream: bool, path: str, body: dict) -> None:
    engine = FakeEngine()
    engine.gate = asyncio.Event()  # requests wait "in the queue" until released
    app = build_app(engine)
    async with live_server(app) as base:
        req = {**body, "max_tokens": 8, "n": 2, "stream": stream}
        client = httpx.AsyncClient(base_url=base, timeout=10)
        task = asyncio.create_task(client.post(path, json=req))
        await wait_until(lambda: len(engine.active) == 2)
        task.cancel()  # closes the connection while the engine is still working
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.aclose()
        await wait_until(lambda: not engine.active)
        assert sorted(engine.aborted) == sorted(engine.calls)
        assert len(engine.aborted) == 2
        # The server still serves.
        engine.gate.set()
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            r = await c.post(path, json={**body, "max_tokens": 2})
            assert r.status_code == 200


async def test_disconnect_mid_stream_aborts() -> None:
    engine = FakeEngine()
    engine.token_delay_s = 0.01
    app = build_app(engine)
    async with live_server(app) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            async with c.stream("POST", "/v1/completions",
                                json={"prompt": "hi", "max_tokens": 50, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break  # got one token; leave
        await wait_until(lambda: not engine.active)
        (rid,) = engine.calls
        assert engine.aborted == [rid]
