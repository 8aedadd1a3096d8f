"""A client that goes away: what the fake P and D observe.

Documented behaviour (docs/proxy.md): mid-stream the decode request is closed, so D aborts it;
during the prefill leg the prefill request is closed, so P aborts it and frees its blocks, and no
decode leg is ever sent.
"""

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from tests.support.router_fakes import sse, wait_until


async def _send_and_leave(url, body, until):
    """Send ``body`` on a fresh connection, wait for ``until()``, then drop the connection."""
    session = aiohttp.ClientSession()
    task = asyncio.create_task(session.post(url, json=body))
    try:
        await wait_until(until)
    finally:
        task.cancel()
        await session.close()


async def test_disconnect_mid_stream_cancels_the_decode_request(make_cluster):
    c = await make_cluster()
    never = asyncio.Event()

    async def slow(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"text": "first"}]}))
        await never.wait()

    c.decoders[0].handler = slow
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(c.url + "/v1/completions",
                                  json={"model": "m", "prompt": "x", "stream": True})
        assert b"first" in await asyncio.wait_for(resp.content.readany(), 5)
        resp.close()  # the client goes away mid-stream
    finally:
        await session.close()
    d = c.decoders[0]
    await wait_until(lambda: d.cancelled == [d.received[0].request_id])
    await wait_until(lambda: c.proxy.proxy.decoders.upstreams[0].in_flight == 0)
    metrics = c.proxy.proxy.metrics
    await wait_until(lambda: metrics.requests.labels(endpoint="completions",
                                                     status="499")._value.get() == 1)


async def test_disconnect_during_prefill_aborts_prefill_and_skips_decode(make_cluster):
    c = await make_cluster()
    never = asyncio.Event()

    async def slow_prefill(inst, request, rec):
        await never.wait()

    p = c.prefillers[0]
    p.handler = slow_prefill
    await _send_and_leave(c.url + "/v1/completions", {"model": "m", "prompt": "x"},
                          lambda: len(p.received) == 1)
    await wait_until(lambda: p.cancelled == [p.received[0].request_id])
    await wait_until(lambda: c.proxy.proxy.prefillers.upstreams[0].in_flight == 0)
    # the proxy is still serving, and no decode leg was ever sent for the abandoned request
    p.handler = None
    status, _, _ = await c.post("/v1/completions", {"model": "m", "prompt": "y"})
    assert status == 200
    assert [json.dumps(r.body["prompt"]) for r in c.decoders[0].received] == ['"y"']


async def test_disconnect_during_non_streaming_decode_cancels_it(make_cluster):
    c = await make_cluster()
    never = asyncio.Event()

    async def slow_decode(inst, request, rec):
        await never.wait()

    d = c.decoders[0]
    d.handler = slow_decode
    await _send_and_leave(c.url + "/v1/completions", {"model": "m", "prompt": "x"},
                          lambda: len(d.received) == 1)
    await wait_until(lambda: d.cancelled == [d.received[0].request_id])
    await wait_until(lambda: c.proxy.proxy.decoders.upstreams[0].in_flight == 0)


@pytest.mark.parametrize("migration_limit", [0, 3], ids=["relay", "migratable"])
async def test_a_client_that_closes_after_done_got_its_answer(make_cluster, migration_limit):
    """SDK clients stop reading at ``[DONE]`` and close: when D's stream ends later, the proxy
    answered the request whole (200), it is no client that went away (499)."""
    c = await make_cluster(migration_limit=migration_limit)
    never = asyncio.Event()

    async def done_then_linger(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"id": "x", "choices": [{"index": 0, "text": "all",
                                                      "finish_reason": "length"}]}))
        await resp.write(b"data: [DONE]\n\n")
        await never.wait()  # the end of D's response comes late

    c.decoders[0].handler = done_then_linger
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(c.url + "/v1/completions",
                                  json={"model": "m", "prompt": "x", "stream": True})
        got = b""
        while b"[DONE]" not in got:
            got += await asyncio.wait_for(resp.content.readany(), 5)
        assert b"all" in got
        resp.close()  # as the openai SDK does once it has [DONE]
    finally:
        await session.close()
    await wait_until(lambda: c.proxy.proxy.decoders.upstreams[0].in_flight == 0)
    requests = c.proxy.proxy.metrics.requests
    await wait_until(lambda: requests.labels(endpoint="completions", status="200")._value.get() == 1)
    assert requests.labels(endpoint="completions", status="499")._value.get() == 0
