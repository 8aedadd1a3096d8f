"""Failures in the concurrent hand-off before D's first token (docs/proxy.md): a failing
prefiller closes the waiting decode leg and both legs go again with a new transfer id; a refused
decoder is replaced with the same transfer id; a failing decoder has P's blocks released (or P's
leg closed); a client that leaves closes both legs. No path leaves P's blocks held."""

import asyncio
import json

import aiohttp
from aiohttp import web

from tests.support.handoff_fakes import SideChannels, info_for
from tests.support.router_fakes import sse, wait_until

from .conftest import unused_port
from .test_router_failover import drop_before_answering, fallbacks, respond, retries

BODY = {"model": "m", "prompt": "x", "max_tokens": 8}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


async def concurrent_cluster(make_cluster, **kwargs):
    c = await make_cluster(instance_info=info_for(), **kwargs)
    channels = SideChannels()
    channels.install(c.prefillers, c.decoders)
    return c, channels


def transfer_ids(received):
    return [r.body["kv_transfer_params"].get("transfer_id") or
            r.body["kv_transfer_params"].get("remote_transfer_id") for r in received]


def after_decoder_arrived(decoder, handler):
    """A prefill handler that acts only once the decode leg reached ``decoder`` (D waits)."""
    async def wrapped(inst, request, rec):
        await wait_until(lambda: len(decoder.received) >= 1)
        return await handler(inst, request, rec)
    return wrapped


async def assert_slots_free(c):
    proxy = c.proxy.proxy
    await wait_until(lambda: all(u.in_flight == 0 for u in
                                 proxy.prefillers.upstreams + proxy.decoders.upstreams))
    for up in proxy.prefillers.upstreams:
        target = proxy.handoff_targets.prefill(up)
        assert target is None or target.in_flight == [0] * len(target.in_flight)


async def test_failing_prefiller_closes_the_waiting_decode_leg_and_both_legs_go_again(
        make_cluster):
    for failing, path, body in ((respond(500), "/v1/completions", BODY),
                                (drop_before_answering, "/v1/chat/completions",
                                 dict(CHAT, stream=True))):
        c, _ = await concurrent_cluster(make_cluster, n_prefill=2)
        p0, p1, d = *c.prefillers, c.decoders[0]
        p0.handler = after_decoder_arrived(d, failing)
        status, _, raw = await c.post(path, body, {"X-Request-Id": "r1"})
        assert status == 200 and b"world" in raw
        # chat: the first leg's opening chunk reached the client, the second leg's did not
        assert raw.count(b'"role"') == (1 if "chat" in path else 0)
        assert [len(p0.received), len(p1.received), len(d.received)] == [1, 1, 2]
        first, second = transfer_ids(d.received)
        assert transfer_ids(p0.received) == [first] and transfer_ids(p1.received) == [second]
        assert first != second
        assert d.received[1].body["kv_transfer_params"]["remote_engine_id"] == "engine-p1"
        await wait_until(lambda: d.cancelled == ["r1"])  # the closed leg: D aborted it
        assert retries(c, "prefill") == 1 and retries(c, "decode") == 0
        assert p0.released == p1.released == []
        await assert_slots_free(c)


async def test_refusing_prefiller_is_skipped_free_and_without_one_the_decoder_serves_alone(
        make_cluster):
    c, _ = await concurrent_cluster(make_cluster, n_prefill=2)
    await c.prefillers[0].close()  # known, with endpoints, then gone
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d0"
    assert retries(c, "prefill") == 0 and len(c.prefillers[1].received) == 1
    assert transfer_ids(c.decoders[0].received)[-1] == transfer_ids(c.prefillers[1].received)[0]

    solo, _ = await concurrent_cluster(make_cluster)
    await solo.prefillers[0].close()
    status, _, raw = await solo.post("/v1/completions", BODY)
    assert status == 200 and fallbacks(solo) == 1
    pending, plain = solo.decoders[0].received
    assert "remote_transfer_id" in pending.body["kv_transfer_params"]
    assert "kv_transfer_params" not in plain.body  # decode-only: D prefills it itself
    await wait_until(lambda: len(solo.decoders[0].cancelled) == 1)
    await assert_slots_free(solo)

    strict, _ = await concurrent_cluster(make_cluster, enforce_disagg=True)
    await strict.prefillers[0].close()
    status, _, raw = await strict.post("/v1/completions", BODY)
    assert status == 503 and "--enforce-disagg" in json.loads(raw)["error"]["message"]
    await wait_until(lambda: len(strict.decoders[0].cancelled) == 1)


async def test_refused_decoder_is_replaced_with_the_same_transfer_id(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c, _ = await concurrent_cluster(make_cluster, decode_urls=[dead])
    for _ in range(2):  # round robin: the second request tries the dead decoder first
        assert (await c.post("/v1/completions", BODY))[0] == 200
    p, d = c.prefillers[0], c.decoders[0]
    assert len(p.received) == 2  # P untouched by the refusal: one prefill per request
    assert transfer_ids(d.received) == transfer_ids(p.received)
    assert retries(c, "prefill") == retries(c, "decode") == 0 and p.released == []
    assert c.proxy.proxy.metrics.errors.labels(upstream=dead, leg="decode")._value.get() == 1


async def test_failing_decoder_has_the_prefill_blocks_released_and_is_retried(make_cluster):
    c, channels = await concurrent_cluster(make_cluster, n_decode=2)
    p, d0, d1 = c.prefillers[0], *c.decoders

    async def fail_after_the_read(inst, request, rec):
        await channels.claim(rec.body["kv_transfer_params"]["remote_transfer_id"])
        return await respond(500, "decoder crashed")(inst, request, rec)

    d0.handler = fail_after_the_read
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 200 and json.loads(raw)["served_by"] == "d1"
    first, second = transfer_ids(p.received)
    assert transfer_ids(d0.received) == [first] and transfer_ids(d1.received) == [second]
    await wait_until(lambda: p.released == [channels.held[first]])  # through the guard
    assert retries(c, "decode") == 1 and retries(c, "prefill") == 0
    await assert_slots_free(c)


async def test_decoder_failing_while_the_prefill_runs_closes_the_prefill_leg(make_cluster):
    c, channels = await concurrent_cluster(make_cluster, n_decode=2)
    p, d0, d1 = c.prefillers[0], *c.decoders
    never = asyncio.Event()
    calls = []

    async def first_prefill_hangs(inst, request, rec):
        calls.append(rec)
        if len(calls) == 1:
            await never.wait()
        return await channels.prefill(inst, request, rec)

    async def kv_read_failed(inst, request, rec):  # an in-band 503 before any token
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]}))
        await resp.write(sse({"error": {"message": "KV load failed", "type": "upstream_error",
                                        "param": None, "code": 502}}) + b"data: [DONE]\n\n")
        return resp

    p.handler, d0.handler = first_prefill_hangs, kv_read_failed
    status, _, raw = await c.post("/v1/chat/completions", dict(CHAT, stream=True),
                                  {"X-Request-Id": "r2"})
    assert status == 200 and b"KV load failed" not in raw and b"world" in raw
    await wait_until(lambda: p.cancelled == ["r2"])  # P's leg closed: P aborts, frees blocks
    assert p.released == [] and len(d1.received) == 1
    assert retries(c, "decode") == 1
    breaker = c.proxy.proxy.health.breaker(c.proxy.proxy.decoders.upstreams[0])
    assert breaker.failures == 0  # a failed KV read is the prefiller's failure
    await assert_slots_free(c)


async def test_client_leaving_closes_both_legs_and_releases_an_answered_prefill(make_cluster):
    c, channels = await concurrent_cluster(make_cluster)
    p, d = c.prefillers[0], c.decoders[0]
    never = asyncio.Event()

    async def hanging(inst, request, rec):
        await never.wait()

    async def opening_then_silence(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                 "content": ""}}]}))
        await never.wait()

    for p_handler, answered in ((hanging, False), (channels.prefill, True)):
        p.handler, d.handler = p_handler, opening_then_silence
        n = len(d.received)
        session = aiohttp.ClientSession()
        task = asyncio.create_task(session.post(
            c.url + "/v1/chat/completions", json=dict(CHAT, stream=True),
            headers={"X-Request-Id": f"gone-{answered}"}))
        await wait_until(lambda: len(d.received) == n + 1 and len(p.received) == n + 1)
        if answered:
            await wait_until(lambda: c.proxy.proxy.prefillers.upstreams[0].in_flight == 0)
        task.cancel()
        await session.close()
        await wait_until(lambda: f"gone-{answered}" in d.cancelled)
        if answered:  # P had answered: its blocks are released
            await wait_until(lambda: p.released == [channels.held[transfer_ids(p.received)[-1]]])
        else:  # P's leg was closed: P aborts the prefill
            await wait_until(lambda: p.cancelled == ["gone-False"])
            assert p.released == []
        await assert_slots_free(c)
    metrics = c.proxy.proxy.metrics
    await wait_until(lambda: metrics.requests.labels(endpoint="chat_completions",
                                                     status="499")._value.get() == 2)


async def test_mixed_load_with_a_failing_decoder_leaves_no_block_held(make_cluster):
    c, channels = await concurrent_cluster(make_cluster, n_prefill=2, n_decode=2,
                                           breaker_failures=100)
    calls = 0

    async def flaky(inst, request, rec):
        nonlocal calls
        calls += 1
        if calls % 2:
            await channels.claim(rec.body["kv_transfer_params"]["remote_transfer_id"])
            return await respond(500)(inst, request, rec)
        return await channels.decode(inst, request, rec)

    c.decoders[0].handler = flaky
    results = await asyncio.gather(*(c.post("/v1/completions", dict(BODY, stream=i % 2 == 0))
                                     for i in range(20)))
    assert [r[0] for r in results] == [200] * 20
    n_failed = (calls + 1) // 2
    assert n_failed >= 3 and retries(c, "decode") == n_failed
    prefills = sum(len(p.received) for p in c.prefillers)
    assert prefills == 20 + n_failed
    # every prefill was read by the decoder that answered, or released on P
    await wait_until(lambda: sum(len(p.released) for p in c.prefillers) == n_failed)
    await asyncio.sleep(0.05)
    assert sum(len(p.released) for p in c.prefillers) == n_failed
    await assert_slots_free(c)
