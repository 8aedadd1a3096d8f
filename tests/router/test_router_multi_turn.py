"""--multi-turn: D's kv_transfer_params of turn k reach P with turn k+1 (docs/architecture.md, "Multi-turn: bidirectional transfer")."""

import asyncio
import json
import time

import pytest

from pdserve.router import app as app_module
from pdserve.router.bodies import MAX_CONVERSATION_ID_CHARS

from .test_router_flow import STATELESS


def decoder_params(name):
    """Per-turn params a fake D returns: block ids and request id change every turn."""
    def make(turn):
        return {"do_remote_decode": True, "remote_block_ids": [10 * turn, 10 * turn + 1],
                "remote_num_tokens": 32 * turn, "remote_blocks_expiry_time": time.time() + 480,
                "remote_host": "127.0.0.1", "remote_port": 5700, "remote_engine_id": f"engine-{name}",
                "remote_request_id": f"{name}-turn{turn}"}
    return make


def expected_prefill_params(d_params):
    return {**STATELESS, **d_params, "do_remote_decode": True, "do_remote_prefill": False}


def chat(turn, **extra):
    return {"model": "m", "messages": [{"role": "user", "content": f"turn {turn}"}], **extra}


async def run_turns(c, stream, n=4, **extra):
    for turn in range(1, n + 1):
        status, _, raw = await c.post("/v1/chat/completions", chat(turn, stream=stream, **extra))
        assert status == 200, raw


async def check_four_turns(c, stream):
    for d in c.decoders:
        d.decoder_params = decoder_params(d.name)
    await run_turns(c, stream, conversation_id="conv-1")
    # sticky: every turn on the same D (round-robin alone would alternate)
    (d,) = [d for d in c.decoders if d.received]
    assert len(d.received) == 4
    p_bodies = [r.body for p in c.prefillers for r in p.received]
    assert len(p_bodies) == 4
    assert p_bodies[0]["kv_transfer_params"] == STATELESS
    returned = [d.decoder_params(turn) for turn in (1, 2, 3)]
    for turn in (2, 3, 4):
        got = p_bodies[turn - 1]["kv_transfer_params"]
        want = expected_prefill_params(returned[turn - 2])
        want["remote_blocks_expiry_time"] = got["remote_blocks_expiry_time"]  # time.time() per call
        assert got == want, turn
        assert got["remote_request_id"] == f"{d.name}-turn{turn - 1}"
    for rec in [r for p in c.prefillers for r in p.received] + d.received:
        assert "conversation_id" not in rec.body


async def test_four_turns_non_streaming(make_cluster):
    await check_four_turns(await make_cluster(n_prefill=2, n_decode=2, multi_turn=True), stream=False)


async def test_four_turns_streaming(make_cluster):
    await check_four_turns(await make_cluster(n_prefill=2, n_decode=2, multi_turn=True), stream=True)


async def test_without_conversation_id_no_params_are_attached(make_cluster):
    c = await make_cluster(n_decode=2, multi_turn=True)
    for d in c.decoders:
        d.decoder_params = decoder_params(d.name)
    await run_turns(c, stream=False)
    assert [r.body["kv_transfer_params"] for r in c.prefillers[0].received] == [STATELESS] * 4
    assert [len(d.received) for d in c.decoders] == [2, 2]


async def test_session_header_keys_the_conversation(make_cluster):
    c = await make_cluster(multi_turn=True)
    c.decoders[0].decoder_params = decoder_params("d0")
    for turn in (1, 2):
        status, _, _ = await c.post("/v1/chat/completions", chat(turn), {"X-Session-ID": "s-9"})
        assert status == 200
    second = c.prefillers[0].received[1].body["kv_transfer_params"]
    assert second["remote_request_id"] == "d0-turn1" and second["do_remote_decode"] is True


async def test_an_over_long_conversation_id_is_a_json_400_and_is_not_stored(make_cluster):
    """A conversation id over MAX_CONVERSATION_ID_CHARS, from the body field or the
    ``X-Session-ID`` header, gets the proxy's OpenAI-style 400 before any instance is asked or
    anything is stored: a 2 MB ``conversation_id`` was served and kept as a key of the
    conversation table, and a header over aiohttp's default field limit (8190 bytes) got
    aiohttp's plain-text 400. An id of exactly the limit is served and stored."""
    limit = MAX_CONVERSATION_ID_CHARS
    c = await make_cluster(multi_turn=True)
    cases = [
        (chat(1, conversation_id="c" * 2_000_000), {}, "conversation_id",
         f"'conversation_id' is 2000000 characters long; at most {limit} are allowed"),
        (chat(1, conversation_id=int("9" * (limit + 1))), {}, "conversation_id",
         f"'conversation_id' is {limit + 1} characters long; at most {limit} are allowed"),
        (chat(1), {"X-Session-ID": "s" * (limit + 1)}, None,
         f"the X-Session-ID header is {limit + 1} characters long; at most {limit} are allowed"),
        (chat(1), {"X-Session-ID": "s" * 9000}, None,
         f"the X-Session-ID header is 9000 characters long; at most {limit} are allowed"),
    ]
    for body, headers, param, message in cases:
        status, got_headers, raw = await c.post("/v1/chat/completions", body, headers)
        assert status == 400, raw[:200]
        assert got_headers["Content-Type"] == "application/json"
        assert json.loads(raw) == {"error": {"message": message, "type": "BadRequestError",
                                             "param": param, "code": 400}}
    assert c.prefillers[0].received == [] and c.decoders[0].received == []
    assert len(c.proxy.proxy.conversations) == 0
    for body, headers in ((chat(1, conversation_id="c" * limit), {}),
                          (chat(1), {"X-Session-ID": "s" * limit})):
        status, _, raw = await c.post("/v1/chat/completions", body, headers)
        assert status == 200, raw
    conversations = c.proxy.proxy.conversations
    assert len(conversations) == 2
    assert conversations.get("c" * limit) is not None and conversations.get("s" * limit) is not None
    # a header field longer than the server reads is still aiohttp's own (plain-text) 400
    status, got_headers, _ = await c.post("/v1/chat/completions", chat(1), {
        "X-Session-ID": "s" * (app_module.MAX_HEADER_FIELD_BYTES + 1)})
    assert status == 400 and got_headers["Content-Type"].startswith("text/plain")


async def test_stateless_mode_strips_conversation_id_and_attaches_nothing(make_cluster):
    c = await make_cluster()
    c.decoders[0].decoder_params = decoder_params("d0")
    await run_turns(c, stream=False, n=2, conversation_id="conv-1")
    assert [r.body["kv_transfer_params"] for r in c.prefillers[0].received] == [STATELESS] * 2
    assert all("conversation_id" not in r.body for r in c.decoders[0].received)


async def test_expired_decoder_blocks_are_not_offered(make_cluster):
    c = await make_cluster(multi_turn=True)
    c.decoders[0].decoder_params = lambda turn: {"remote_block_ids": [1],
                                                 "remote_blocks_expiry_time": time.time() - 1}
    await run_turns(c, stream=False, n=2, conversation_id="c")
    assert [r.body["kv_transfer_params"] for r in c.prefillers[0].received] == [STATELESS] * 2


async def test_lru_bound_forgets_least_recent_conversation(make_cluster):
    c = await make_cluster(multi_turn=True, max_conversations=1)
    c.decoders[0].decoder_params = decoder_params("d0")
    for conv in ("a", "b", "a", "a"):
        status, _, _ = await c.post("/v1/chat/completions", chat(1, conversation_id=conv))
        assert status == 200
    params = [r.body["kv_transfer_params"] for r in c.prefillers[0].received]
    assert params[:3] == [STATELESS] * 3  # "a" was evicted by "b" before its second turn
    assert params[3]["remote_request_id"] == "d0-turn3"
    assert len(c.proxy.proxy.conversations) == 1


async def test_a_failed_turn_used_the_params_and_the_next_turn_has_none(make_cluster):
    """The failed turn's prefill leg carried D's turn-1 params (its P may have pulled the
    blocks, which ends D's lease on them): the next turn's prefill leg carries none."""
    from aiohttp import web

    c = await make_cluster(multi_turn=True)
    c.decoders[0].decoder_params = decoder_params("d0")
    await run_turns(c, stream=False, n=1, conversation_id="c")

    async def broken(inst, request, rec):
        return web.json_response({"error": {"message": "bad", "type": "x", "code": 400}}, status=400)

    c.decoders[0].handler = broken
    status, _, _ = await c.post("/v1/chat/completions", chat(2, conversation_id="c"))
    assert status == 400
    c.decoders[0].handler = None
    await run_turns(c, stream=False, n=1, conversation_id="c")
    bodies = [r.body["kv_transfer_params"] for r in c.prefillers[0].received]
    assert bodies[1]["remote_request_id"] == "d0-turn1"
    assert bodies[2] == STATELESS


async def test_params_recorded_before_the_client_sees_the_end_of_the_turn(make_cluster):
    """A client that sends turn 2 as soon as it reads turn 1's final event (while D's response
    is still open) must find D's turn-1 params in P's request."""
    import asyncio

    from aiohttp import web

    from tests.support.router_fakes import sse

    c = await make_cluster(multi_turn=True)
    d = c.decoders[0]
    d.decoder_params = decoder_params("d0")
    turn2_at_p = asyncio.Event()
    seen_by_p = []

    async def prefill(inst, request, rec):
        seen_by_p.append(rec.body.get("kv_transfer_params"))
        if len(seen_by_p) == 2:
            turn2_at_p.set()
        return await inst._prefill(rec)

    async def decode_then_linger(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        event = {"id": "x", "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}],
                 "kv_transfer_params": inst._params()}
        await resp.write(sse(event) + b"data: [DONE]\n\n")
        if len(inst.received) == 1:
            try:  # keep turn 1's response open until turn 2 reached P (bounded)
                await asyncio.wait_for(turn2_at_p.wait(), 10)
            except asyncio.TimeoutError:
                pass
        await resp.write_eof()
        return resp

    c.prefillers[0].handler = prefill
    d.handler = decode_then_linger
    async with c.session.post(c.url + "/v1/chat/completions",
                              json=chat(1, stream=True, conversation_id="c")) as r1:
        buf = b""
        while b"[DONE]" not in buf:
            buf += await r1.content.readany()
        status, _, raw = await c.post("/v1/chat/completions",
                                      chat(2, stream=True, conversation_id="c"))
        assert status == 200, raw
        await r1.read()
    assert seen_by_p[0] == STATELESS
    assert seen_by_p[1]["remote_request_id"] == "d0-turn1"


def _answer_params(raw: bytes, stream: bool):
    """The client's view: the body's ``kv_transfer_params``, or every SSE event's."""
    if not stream:
        body = json.loads(raw)
        return body["choices"][0]["text"], [body["kv_transfer_params"]]
    events = [json.loads(line[5:]) for line in raw.split(b"\n")
              if line.startswith(b"data:") and line != b"data: [DONE]"]
    return ("".join(e["choices"][0]["text"] for e in events),
            [e["kv_transfer_params"] for e in events if "kv_transfer_params" in e])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_decoder_params_stay_with_the_multi_turn_proxy(make_cluster, stream):
    """In a conversation the proxy keeps D's params (for the next turn's P leg) and the client
    gets null in their place, as from a vLLM decoder; the rest of the answer is D's."""
    c = await make_cluster(multi_turn=True)
    c.decoders[0].decoder_params = decoder_params("d0")
    for turn in (1, 2):
        status, _, raw = await c.post("/v1/chat/completions",
                                      chat(turn, stream=stream, conversation_id="conv-x"))
        assert status == 200, raw
        text, seen = _answer_params(raw, stream)
        assert text == "".join(c.decoders[0].chunks)
        assert seen == [None], seen
    # ... yet they were kept: turn 2's P leg carries turn 1's D params
    got = c.prefillers[0].received[1].body["kv_transfer_params"]
    assert got["remote_request_id"] == "d0-turn1"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_decoder_params_pass_through_the_stateless_proxy(make_cluster, stream):
    """The stateless proxy keeps nothing and relays D's answer as it is, D's params included
    (as vLLM's proxy does): a client-side router may keep them itself."""
    c = await make_cluster(multi_turn=False)
    c.decoders[0].decoder_params = decoder_params("d0")
    status, _, raw = await c.post("/v1/chat/completions", chat(1, stream=stream))
    assert status == 200, raw
    _, seen = _answer_params(raw, stream)
    assert [p["remote_request_id"] for p in seen] == ["d0-turn1"]
    assert c.decoders[0].released == []


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_multi_turn_proxy_releases_what_d_keeps_for_a_request_without_conversation(
        make_cluster, stream):
    """In multi-turn mode D keeps every request's blocks for the next turn; without a
    conversation nobody will pull them through the proxy, so it releases them on D at once (D
    held them for decoder_kv_blocks_ttl and new requests waited for blocks) and the client gets
    null, as in a conversation."""
    c = await make_cluster(multi_turn=True)
    c.decoders[0].decoder_params = decoder_params("d0")
    status, _, raw = await c.post("/v1/chat/completions", chat(1, stream=stream))
    assert status == 200, raw
    text, seen = _answer_params(raw, stream)
    assert text == "".join(c.decoders[0].chunks)
    assert seen == [None], seen
    for _ in range(100):  # the release is sent in the background
        if c.decoders[0].released:
            break
        await asyncio.sleep(0.01)
    assert [p["remote_request_id"] for p in c.decoders[0].released] == ["d0-turn1"]
    assert c.prefillers[0].released == []  # P's blocks were read by D: nothing to release
