"""The P->D request flow through the proxy, observed by fake P and D instances."""

import asyncio
import json

from aiohttp import web

from tests.support.router_fakes import prefill_params, sse, wait_until

STATELESS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
             "remote_block_ids": None, "remote_host": None, "remote_port": None}


async def test_completion_legs_bodies_and_request_id(make_cluster):
    c = await make_cluster()
    # (stream_options, dropped from the prefill leg, need stream=true: tests/router/test_router_bodies.py)
    body = {"model": "m", "prompt": "Hello", "max_tokens": 20, "min_tokens": 3, "temperature": 0,
            "n": 1}
    status, headers, raw = await c.post("/v1/completions", body, {"X-Request-Id": "req-42"})
    assert status == 200
    (p_req,), (d_req,) = c.prefillers[0].received, c.decoders[0].received
    assert p_req.path == d_req.path == "/v1/completions"
    assert p_req.body == {"model": "m", "prompt": "Hello", "max_tokens": 1, "temperature": 0,
                          "stream": False, "min_tokens": 1, "kv_transfer_params": STATELESS,
                          "pdserve_decode_leg": {"max_tokens": 20, "min_tokens": 3}}
    assert d_req.body == dict(body, kv_transfer_params=prefill_params("p0", "req-42"))
    assert p_req.request_id == d_req.request_id == headers["X-Request-Id"] == "req-42"
    answer = json.loads(raw)
    assert answer["served_by"] == "d0" and answer["choices"][0]["text"] == "Hello world"


async def test_generated_request_id_is_shared_and_returned(make_cluster):
    c = await make_cluster()
    status, headers, _ = await c.post("/v1/chat/completions",
                                      {"model": "m", "messages": [{"role": "user", "content": "x"}]})
    assert status == 200
    rid = headers["X-Request-Id"]
    assert len(rid) == 32 and int(rid, 16) >= 0
    assert c.prefillers[0].received[0].request_id == c.decoders[0].received[0].request_id == rid
    assert c.prefillers[0].received[0].path == "/v1/chat/completions"
    assert c.decoders[0].received[0].path == "/v1/chat/completions"


async def test_streaming_is_passed_through_chunk_by_chunk(make_cluster):
    c = await make_cluster()
    gate = asyncio.Event()
    first = sse({"choices": [{"index": 0, "text": "one"}]})
    rest = sse({"choices": [{"index": 0, "text": "two"}]}) + b"data: [DONE]\n\n"

    async def gated(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await gate.wait()  # the rest only comes after the client has seen the first event
        await resp.write(rest)
        await resp.write_eof()
        return resp

    c.decoders[0].handler = gated
    async with c.session.post(c.url + "/v1/completions",
                              json={"model": "m", "prompt": "x", "stream": True}) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        got = b""
        while len(got) < len(first):
            got += await asyncio.wait_for(r.content.readany(), 5)
        assert got == first
        gate.set()
        got += await r.content.read()
    assert got == first + rest
    assert c.prefillers[0].received[0].body["stream"] is False
    assert c.decoders[0].received[0].body["stream"] is True


async def test_round_robin_uses_every_instance_in_turn(make_cluster):
    c = await make_cluster(n_prefill=2, n_decode=2)
    for _ in range(4):
        status, _, raw = await c.post("/v1/completions", {"model": "m", "prompt": "x"})
        assert status == 200
    assert [len(p.received) for p in c.prefillers] == [2, 2]
    assert [len(d.received) for d in c.decoders] == [2, 2]
    # each D got the params of the P that prefilled its request
    for d in c.decoders:
        for rec in d.received:
            assert rec.body["kv_transfer_params"]["remote_request_id"].endswith(rec.request_id)


async def _hold_one_stream_on_d0(c):
    """Open a streaming request that D0 answers only after ``gate`` is set."""
    gate = asyncio.Event()

    async def held(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await gate.wait()
        await resp.write(b"data: [DONE]\n\n")
        return resp

    c.decoders[0].handler = held
    task = asyncio.create_task(c.post("/v1/completions", {"model": "m", "prompt": "x", "stream": True}))
    await wait_until(lambda: len(c.decoders[0].received) == 1)
    c.decoders[0].handler = None
    return gate, task


async def test_least_loaded_avoids_the_busy_decoder(make_cluster):
    c = await make_cluster(n_decode=2, routing="least-loaded")
    gate, task = await _hold_one_stream_on_d0(c)
    for _ in range(3):
        assert (await c.post("/v1/completions", {"model": "m", "prompt": "y"}))[0] == 200
    assert [len(d.received) for d in c.decoders] == [1, 3]
    gate.set()
    assert (await task)[0] == 200
    assert [u.in_flight for u in c.proxy.proxy.decoders.upstreams] == [0, 0]


async def test_round_robin_ignores_load(make_cluster):
    c = await make_cluster(n_decode=2)  # the counterpart of the test above
    gate, task = await _hold_one_stream_on_d0(c)
    for _ in range(3):
        assert (await c.post("/v1/completions", {"model": "m", "prompt": "y"}))[0] == 200
    assert [len(d.received) for d in c.decoders] == [2, 2]  # d0 busy or not, it takes its turns
    gate.set()
    await task


async def test_prefiller_without_params_lets_decoder_compute_the_prompt(make_cluster):
    c = await make_cluster()

    async def plain(inst, request, rec):
        return web.json_response({"choices": [{"text": "H"}]})

    c.prefillers[0].handler = plain
    assert (await c.post("/v1/completions", {"model": "m", "prompt": "x",
                                             "kv_transfer_params": {"a": 1}}))[0] == 200
    assert "kv_transfer_params" not in c.decoders[0].received[0].body


async def test_upstream_key_replaces_client_authorization(make_cluster):
    c = await make_cluster(api_key="client-key", upstream_api_key="inst-key")
    status, _, raw = await c.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert status == 401
    assert json.loads(raw) == {"error": {
        "message": "invalid or missing API key (send 'Authorization: Bearer KEY')",
        "type": "AuthenticationError", "param": None, "code": 401}}
    status, _, _ = await c.post("/v1/completions", {"model": "m", "prompt": "x"},
                                {"Authorization": "Bearer wrong"})
    assert status == 401
    assert c.prefillers[0].received == [] and c.decoders[0].received == []
    status, _, _ = await c.post("/v1/completions", {"model": "m", "prompt": "x"},
                                {"Authorization": "Bearer client-key"})
    assert status == 200
    assert c.prefillers[0].received[0].headers["Authorization"] == "Bearer inst-key"
    assert c.decoders[0].received[0].headers["Authorization"] == "Bearer inst-key"


async def test_client_authorization_forwarded_without_upstream_key(make_cluster):
    c = await make_cluster(api_key="shared")
    await c.post("/v1/completions", {"model": "m", "prompt": "x"}, {"Authorization": "Bearer shared"})
    assert c.prefillers[0].received[0].headers["Authorization"] == "Bearer shared"
    assert c.decoders[0].received[0].headers["Authorization"] == "Bearer shared"
    c2 = await make_cluster()
    await c2.post("/v1/completions", {"model": "m", "prompt": "x"})
    assert "Authorization" not in c2.prefillers[0].received[0].headers


async def test_openai_client_through_proxy(make_cluster):
    import openai

    c = await make_cluster(api_key="k")
    client = openai.AsyncOpenAI(base_url=c.url + "/v1", api_key="k", max_retries=0)
    try:
        out = await client.completions.create(model="m", prompt="x", max_tokens=5)
        assert out.choices[0].text == "Hello world"
        pieces = [ch.choices[0].text async for ch in
                  await client.completions.create(model="m", prompt="x", max_tokens=5, stream=True)]
        assert pieces == ["Hel", "lo", " world"]
        try:
            await client.completions.create(model="m", prompt="x", n=2)
        except openai.BadRequestError as e:
            assert e.status_code == 400 and "'n' > 1" in e.message
        else:
            raise AssertionError("n=2 was accepted")
    finally:
        await client.close()
