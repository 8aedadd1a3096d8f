"""Failing instances before the first token: retries, circuit breakers, decode-only fallback."""

import asyncio
import json

from aiohttp import web

from .conftest import unused_port
from tests.support.router_fakes import wait_until

BODY = {"model": "m", "prompt": "x", "max_tokens": 8}


def respond(status, message="boom"):
    async def handler(inst, request, rec):
        return web.json_response({"error": {"message": message, "type": "upstream_error",
                                            "param": None, "code": status}}, status=status)
    return handler


async def drop_before_answering(inst, request, rec):
    request.transport.close()  # the instance dies with the request in hand
    return web.Response(status=200)


def retries(c, leg):
    return c.proxy.proxy.metrics.retries.labels(leg=leg)._value.get()


def fallbacks(c):
    return c.proxy.proxy.metrics.decode_only_fallback._value.get()


def healthy_gauge(c, inst, leg):
    return c.proxy.proxy.metrics.upstream_healthy.labels(upstream=inst.url, leg=leg)._value.get()


async def assert_no_block_held(c, answered):
    """Every prefill was read by the decoder that answered its request, or released on P: the
    prefills are as many as the answered requests plus the releases (and stay so)."""
    prefills = sum(len(p.received) for p in c.prefillers)
    await wait_until(lambda: sum(len(p.released) for p in c.prefillers) == prefills - answered)
    await asyncio.sleep(0.05)
    assert sum(len(p.released) for p in c.prefillers) == prefills - answered


async def test_failed_prefiller_is_retried_on_another(make_cluster):
    c = await make_cluster(n_prefill=2)
    c.prefillers[0].handler = respond(500)
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d0"
    assert [len(p.received) for p in c.prefillers] == [1, 1]
    (d_req,) = c.decoders[0].received
    assert d_req.body["kv_transfer_params"]["remote_request_id"].startswith("p1-")
    assert retries(c, "prefill") == 1 and fallbacks(c) == 0


async def test_prefiller_dropping_the_connection_is_retried(make_cluster):
    c = await make_cluster(n_prefill=2)
    c.prefillers[0].handler = drop_before_answering
    status, _, _ = await c.post("/v1/completions", dict(BODY, stream=True))
    assert status == 200
    assert [len(p.received) for p in c.prefillers] == [1, 1]
    assert retries(c, "prefill") == 1


async def test_unreachable_prefiller_moves_on_without_spending_the_budget(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_prefill=0, prefill_urls=[dead], n_decode=1, max_retries=0)
    c2 = await make_cluster(prefill_urls=[dead], max_retries=0)
    for cluster in (c, c2):
        for _ in range(2):  # round-robin: c2's second request tries the dead one first
            assert (await cluster.post("/v1/completions", BODY))[0] == 200
        assert retries(cluster, "prefill") == 0
    assert fallbacks(c) == 2 and fallbacks(c2) == 0  # c2 had a live prefiller
    assert len(c2.prefillers[0].received) == 2
    assert c2.proxy.proxy.metrics.errors.labels(upstream=dead, leg="prefill")._value.get() == 1


async def test_decoder_failing_before_streaming_is_retried_and_the_lease_released(make_cluster):
    for stream in (False, True):
        c = await make_cluster(n_decode=2)
        c.decoders[0].handler = respond(503, "KV load from the prefiller timed out")
        status, headers, raw = await c.post("/v1/completions", dict(BODY, stream=stream))
        assert status == 200
        if stream:
            assert raw.endswith(b"data: [DONE]\n\n") and b"Hel" in raw
        else:
            assert json.loads(raw)["served_by"] == "d1"
        (first, second) = c.prefillers[0].received  # a new prefill for the second decoder
        (d0_req,), (d1_req,) = c.decoders[0].received, c.decoders[1].received
        assert d0_req.body["kv_transfer_params"]["remote_request_id"] == f"p0-{first.request_id}"
        # D0 may have claimed the first lease: it is released, the retry reads a new one
        await wait_until(lambda: len(c.prefillers[0].released) == 1)
        assert c.prefillers[0].released == [d0_req.body["kv_transfer_params"]]
        assert d1_req.body["kv_transfer_params"] == d0_req.body["kv_transfer_params"]  # same id
        assert retries(c, "decode") == 1 and retries(c, "prefill") == 0
        assert [u.in_flight for u in c.proxy.proxy.decoders.upstreams] == [0, 0]


async def test_decoder_dropping_before_its_answer_is_retried(make_cluster):
    c = await make_cluster(n_decode=2)
    c.decoders[0].handler = drop_before_answering
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d1"
    await assert_no_block_held(c, answered=1)


async def test_client_errors_are_never_retried(make_cluster):
    c = await make_cluster(n_prefill=2, n_decode=2)
    c.decoders[0].handler = c.decoders[1].handler = respond(400, "bad temperature")
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 400 and json.loads(raw)["error"]["message"] == "bad temperature"
    assert sum(len(d.received) for d in c.decoders) == 1
    assert sum(len(p.received) for p in c.prefillers) == 1
    assert retries(c, "prefill") == retries(c, "decode") == 0
    await wait_until(lambda: sum(len(p.released) for p in c.prefillers) == 1)


async def test_the_budget_is_shared_by_both_legs(make_cluster):
    c = await make_cluster(n_prefill=3, n_decode=3, max_retries=2)
    c.prefillers[0].handler = respond(500)
    c.decoders[0].handler = respond(502)
    c.decoders[1].handler = respond(500, "second decoder down")
    status, _, raw = await c.post("/v1/completions", BODY)
    # P0 failed (1 retry), D0 failed (2nd retry), D1 failed: nothing left to spend
    assert status == 500 and json.loads(raw)["error"]["message"] == "second decoder down"
    assert retries(c, "prefill") == 1 and retries(c, "decode") == 1
    assert len(c.decoders[2].received) == 0
    # three prefill legs: P0's failed (holds nothing), two leases for D0 and D1, both released
    assert sum(len(p.received) for p in c.prefillers) == 3
    await wait_until(lambda: sum(len(p.released) for p in c.prefillers) == 2)


async def test_no_retries_with_a_zero_budget(make_cluster):
    c = await make_cluster(n_prefill=2, n_decode=2, max_retries=0)
    c.decoders[0].handler = respond(500)
    assert (await c.post("/v1/completions", BODY))[0] == 500
    assert [len(d.received) for d in c.decoders] == [1, 0]


async def test_breaker_opens_skips_and_probes_back(make_cluster):
    c = await make_cluster(n_prefill=2, breaker_failures=2, breaker_backoff=0.2)
    p0, p1 = c.prefillers
    p0.handler = respond(500)
    p0.health_status = 503
    for _ in range(4):
        assert (await c.post("/v1/completions", BODY))[0] == 200
    # round-robin sent P0 two requests (each retried on P1); then it is out of rotation
    assert len(p0.received) == 2 and healthy_gauge(c, p0, "prefill") == 0
    for _ in range(4):
        assert (await c.post("/v1/completions", BODY))[0] == 200
    assert len(p0.received) == 2 and retries(c, "prefill") == 2
    async with c.session.get(c.url + "/health") as r:
        assert (await r.json())["breakers"]["prefill"] == {p0.url: "open", p1.url: "closed"}
    await asyncio.sleep(0.5)  # failed probes (503) keep it out, the back-off doubling
    assert c.proxy.proxy.health.breaker(c.proxy.proxy.prefillers.upstreams[0]).state.value == "open"
    p0.handler, p0.health_status = None, 200
    await wait_until(lambda: healthy_gauge(c, p0, "prefill") == 1, timeout=5)
    for _ in range(2):
        assert (await c.post("/v1/completions", BODY))[0] == 200
    assert len(p0.received) == 3  # back in rotation; its first answer closed the breaker
    async with c.session.get(c.url + "/health") as r:
        assert (await r.json())["breakers"]["prefill"][p0.url] == "closed"


async def test_every_prefiller_down_is_served_decode_only(make_cluster):
    dead = [f"http://127.0.0.1:{unused_port()}" for _ in range(2)]
    c = await make_cluster(n_prefill=0, prefill_urls=dead, breaker_failures=1, breaker_backoff=60)
    for stream in (False, True, False):
        status, _, raw = await c.post("/v1/completions", dict(BODY, stream=stream,
                                                              kv_transfer_params={"x": 1}))
        assert status == 200
    assert fallbacks(c) == 3
    for rec in c.decoders[0].received:  # a plain request: the decoder prefills it itself
        assert "kv_transfer_params" not in rec.body and rec.body["prompt"] == "x"
    errors = c.proxy.proxy.metrics.errors
    # each refused one connection, then was out of rotation: not tried again
    assert [errors.labels(upstream=u, leg="prefill")._value.get() for u in dead] == [1, 1]


async def test_enforce_disagg_refuses_with_503(make_cluster):
    c = await make_cluster(n_prefill=1, n_decode=1, enforce_disagg=True, breaker_failures=1,
                           breaker_backoff=60)
    p0 = c.prefillers[0]
    p0.handler = respond(500, "engine crashed")
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 503
    error = json.loads(raw)["error"]
    assert error["type"] == "upstream_unavailable" and error["code"] == 503
    assert "engine crashed" in error["message"] and "--enforce-disagg" in error["message"]
    status, _, raw = await c.post("/v1/completions", BODY)  # now out of rotation: named so
    assert status == 503 and "out of rotation (circuit open)" in json.loads(raw)["error"]["message"]
    assert len(p0.received) == 1 and c.decoders[0].received == [] and fallbacks(c) == 0


async def test_decode_only_turns_are_recorded_in_multi_turn_mode(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_prefill=0, prefill_urls=[dead], multi_turn=True)
    d_params = {"do_remote_prefill": False, "do_remote_decode": True, "remote_engine_id": "d0",
                "remote_block_ids": [[4, 5]], "remote_host": "127.0.0.1", "remote_port": 5700,
                "remote_request_id": "d0-1"}
    c.decoders[0].decoder_params = lambda n: d_params
    status, _, raw = await c.post("/v1/completions", dict(BODY, conversation_id="chat-1"))
    assert status == 200 and json.loads(raw)["kv_transfer_params"] is None
    state = c.proxy.proxy.conversations.get("chat-1")
    assert state.kv_transfer_params == d_params and state.prefiller_url is None
    assert state.decoder_url == c.decoders[0].url


async def test_mixed_load_with_a_failing_decoder_leaves_no_lease_held(make_cluster):
    c = await make_cluster(n_prefill=2, n_decode=2, breaker_failures=100)
    calls = 0

    async def flaky(inst, request, rec):
        nonlocal calls
        calls += 1
        if calls % 2:
            return await respond(500)(inst, request, rec)
        return await inst._decode(request, rec)

    c.decoders[0].handler = flaky
    results = await asyncio.gather(*(c.post("/v1/completions", dict(BODY, stream=i % 2 == 0))
                                     for i in range(20)))
    assert [r[0] for r in results] == [200] * 20
    n_failed = (calls + 1) // 2
    assert n_failed >= 3
    await assert_no_block_held(c, answered=20)
    assert sum(len(p.received) for p in c.prefillers) == 20 + n_failed
    assert retries(c, "decode") == n_failed


async def test_single_decoder_whose_kv_read_failed_serves_the_retry(make_cluster):
    c = await make_cluster(n_prefill=2)
    answers = [respond(503, "timeout: the prefiller did not answer"), None]

    async def once_then_fine(inst, request, rec):
        handler = answers.pop(0)
        return await (handler(inst, request, rec) if handler else inst._decode(request, rec))

    c.decoders[0].handler = once_then_fine
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d0"
    assert len(c.decoders[0].received) == 2 and retries(c, "decode") == 1
    await assert_no_block_held(c, answered=1)
    breaker = c.proxy.proxy.health.breaker(c.proxy.proxy.decoders.upstreams[0])
    assert breaker.failures == 0  # the prefiller's failure, not the decoder's
    # a decoder's own 500 is not retried on itself
    c.decoders[0].handler = respond(500)
    assert (await c.post("/v1/completions", BODY))[0] == 500
    assert len(c.decoders[0].received) == 3 and breaker.failures == 1
