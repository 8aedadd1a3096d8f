"""GET /health, /v1/models and /metrics of the proxy; the `pdserve proxy` process itself."""

import asyncio
import json
import signal
import subprocess
import sys

import pytest

from .conftest import unused_port


async def get(c, path, headers=None):
    async with c.session.get(c.url + path, headers=headers) as r:
        return r.status, r.headers.copy(), await r.read()


async def test_health_needs_one_prefiller_and_one_decoder(make_cluster):
    c = await make_cluster(n_prefill=2, n_decode=1, enforce_disagg=True)
    p0, p1 = (p.url for p in c.prefillers)
    d0 = c.decoders[0].url
    status, _, raw = await get(c, "/health")
    assert (status, json.loads(raw)) == (200, {
        "prefill": {p0: True, p1: True}, "decode": {d0: True}, "status": "ok",
        "breakers": {"prefill": {p0: "closed", p1: "closed"}, "decode": {d0: "closed"}}})
    c.prefillers[0].health_status = 503
    status, _, raw = await get(c, "/health")
    assert status == 200 and json.loads(raw)["prefill"] == {p0: False, p1: True}
    c.prefillers[1].health_status = 500
    status, _, raw = await get(c, "/health")
    assert (status, json.loads(raw)["status"]) == (503, "unhealthy")
    c.prefillers[0].health_status = c.prefillers[1].health_status = 200
    c.decoders[0].health_status = 503
    assert (await get(c, "/health"))[0] == 503


async def test_health_without_prefillers_is_degraded_when_decode_only_is_allowed(make_cluster):
    c = await make_cluster()
    c.prefillers[0].health_status = 503
    status, _, raw = await get(c, "/health")
    assert (status, json.loads(raw)["status"]) == (200, "degraded")
    c.decoders[0].health_status = 503
    status, _, raw = await get(c, "/health")
    assert (status, json.loads(raw)["status"]) == (503, "unhealthy")


async def test_health_with_unreachable_decoder(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_decode=0, decode_urls=[dead])
    status, _, raw = await get(c, "/health")
    assert status == 503 and json.loads(raw)["decode"] == {dead: False}


async def test_models_from_a_decoder_then_a_prefiller(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(decode_urls=[dead], n_decode=0, api_key="k")
    assert (await get(c, "/v1/models"))[0] == 401
    status, _, raw = await get(c, "/v1/models", {"Authorization": "Bearer k"})
    assert status == 200 and json.loads(raw)["data"][0]["owned_by"] == "p0"
    c2 = await make_cluster()
    status, _, raw = await get(c2, "/v1/models")
    assert status == 200 and json.loads(raw)["data"][0]["owned_by"] == "d0"


async def test_models_all_unreachable_is_503(make_cluster):
    dp, dd = f"http://127.0.0.1:{unused_port()}", f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_prefill=0, n_decode=0, prefill_urls=[dp], decode_urls=[dd])
    status, _, raw = await get(c, "/v1/models")
    assert status == 503
    assert json.loads(raw)["error"]["message"] == (
        f"decode instance {dd} unreachable (Connection refused); "
        f"prefill instance {dp} unreachable (Connection refused)")


async def test_metrics_count_requests_errors_latency_and_in_flight(make_cluster):
    c = await make_cluster(api_key="k", max_retries=0)  # one failed request, not retried
    hdr = {"Authorization": "Bearer k"}
    for _ in range(3):
        assert (await c.post("/v1/completions", {"model": "m", "prompt": "x"}, hdr))[0] == 200
    assert (await c.post("/v1/chat/completions", {"model": "m", "messages": [], "n": 3}, hdr))[0] == 400

    async def broken(inst, request, rec):
        from aiohttp import web
        return web.Response(status=503, text="overloaded")

    c.decoders[0].handler = broken
    assert (await c.post("/v1/completions", {"model": "m", "prompt": "x"}, hdr))[0] == 503
    status, headers, raw = await get(c, "/metrics")  # no key needed for /metrics
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    text = raw.decode()
    d, p = c.decoders[0].url, c.prefillers[0].url
    for line in [
        'pdserve:proxy_requests_total{endpoint="completions",status="200"} 3.0',
        'pdserve:proxy_requests_total{endpoint="chat_completions",status="400"} 1.0',
        'pdserve:proxy_requests_total{endpoint="completions",status="503"} 1.0',
        f'pdserve:proxy_errors_total{{leg="decode",upstream="{d}"}} 1.0',
        f'pdserve:proxy_errors_total{{leg="prefill",upstream="{p}"}} 0.0',
        'pdserve:proxy_added_latency_seconds_count 3.0',
        f'pdserve:proxy_in_flight_requests{{leg="decode",upstream="{d}"}} 0.0',
        f'pdserve:proxy_in_flight_requests{{leg="prefill",upstream="{p}"}} 0.0',
    ]:
        assert line in text, line


@pytest.mark.slow
async def test_pdserve_proxy_process_serves_and_stops_on_sigterm(make_cluster):
    c = await make_cluster()  # fakes + an in-process proxy; the subprocess is a second proxy
    p_port, d_port = (int(x.url.rsplit(":", 1)[1]) for x in (c.prefillers[0], c.decoders[0]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0", "--prefiller-port", str(p_port),
        "--decoder-port", str(d_port), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert line.startswith("pdserve proxy listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        async with c.session.post(url + "/v1/completions", json={"model": "m", "prompt": "x"}) as r:
            assert r.status == 200 and (await r.json())["served_by"] == "d0"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.slow
async def test_pdserve_proxy_port_in_use_exits_1(make_cluster):
    c = await make_cluster()
    used = c.url.rsplit(":", 1)[1]
    out = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve.cli", "proxy", "--port", used, "--prefiller-port", "1",
        "--decoder-port", "2", stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(out.communicate(), 60)
    finally:
        if out.returncode is None:
            out.kill()
            await out.wait()
    assert out.returncode == 1 and f"cannot listen on 127.0.0.1:{used}" in err.decode()
