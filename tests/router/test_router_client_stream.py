"""The concurrent hand-off sends a stream's headers when the decoder accepts the decode leg and
D's opening chunk as it comes, the rest of its body from D's first token on
(pdserve/router/client_stream.py, docs/proxy.md): the client has both while D still waits for
P's KV; a turn that cannot be served then ends in the stream with an error event. Retries after
the opening chunk went out: tests/router/test_router_opening_retry.py."""

import asyncio
import json

from aiohttp import web

from tests.support.handoff_fakes import SideChannels, info_for
from tests.support.router_fakes import sse, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
OPENING = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
#: A chat stream's opening chunk when ``return_token_ids`` is asked for: the prompt's ids.
OPENING_IDS = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
               "prompt_token_ids": list(range(4096)),
               "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                            "logprobs": None, "finish_reason": None, "token_ids": []}]}


async def concurrent_cluster(make_cluster, **kwargs):
    c = await make_cluster(instance_info=info_for(), **kwargs)
    SideChannels().install(c.prefillers, c.decoders)
    return c


async def test_headers_and_the_opening_chunk_reach_the_client_before_the_first_token(
        make_cluster):
    c = await concurrent_cluster(make_cluster)
    go = asyncio.Event()
    opening = sse(OPENING_IDS)

    async def waits_for_the_kv(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(opening)
        await go.wait()  # D's read of P's KV
        await resp.write(sse({"id": "chatcmpl-1", "choices": [
            {"index": 0, "delta": {"content": "hi"}, "token_ids": [5]}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    c.decoders[0].handler = waits_for_the_kv
    # the headers come while D still waits (without them: a timeout here)
    r = await asyncio.wait_for(c.session.post(c.url + "/v1/chat/completions",
                                              json=dict(CHAT, return_token_ids=True),
                                              headers={"X-Request-Id": "early"}), 5)
    async with r:
        assert r.status == 200 and not go.is_set()
        assert r.headers["Content-Type"] == "text/event-stream"
        assert r.headers["X-Request-Id"] == "early"
        # so does D's opening chunk, with the prompt's ids, as D sent it (held until D's
        # first token: a timeout here)
        early = b""
        while len(early) < len(opening):
            early += await asyncio.wait_for(r.content.readany(), 2)
        assert early == opening and not go.is_set()
        go.set()
        raw = early + await r.read()
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n")
              if line.startswith("data: {")]
    assert events[0] == OPENING_IDS
    assert events[1]["choices"][0]["delta"] == {"content": "hi"} and len(events) == 2
    assert raw.endswith(b"data: [DONE]\n\n")


async def test_a_failure_after_the_headers_ends_the_stream_with_an_error_event(make_cluster):
    c = await concurrent_cluster(make_cluster)

    async def fails_before_any_token(inst, request, rec):  # D's own failure: not retried
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(OPENING))
        await resp.write(sse({"error": {"message": "engine exploded", "type": "internal_error",
                                        "param": None, "code": 500}}) + b"data: [DONE]\n\n")
        return resp

    c.decoders[0].handler = fails_before_any_token
    status, _, raw = await c.post("/v1/chat/completions", CHAT)
    assert status == 200  # the headers went out when D accepted the leg
    chunks = raw.split(b"\n\n")
    assert chunks[0] == sse(OPENING)[:-2]  # sent as it came
    assert chunks[1].startswith(b"data: {\"error\"") and b"engine exploded" in chunks[1]
    assert json.loads(chunks[1][6:])["error"]["code"] == 500
    assert raw.endswith(b"data: [DONE]\n\n") and raw.count(b"assistant") == 1
    metrics = c.proxy.proxy.metrics
    await wait_until(lambda: metrics.requests.labels(endpoint="chat_completions",
                                                     status="500")._value.get() == 1)


async def test_a_non_streamed_turn_still_answers_with_the_status(make_cluster):
    c = await concurrent_cluster(make_cluster)

    async def refuses(inst, request, rec):
        return web.json_response({"error": {"message": "no", "type": "invalid_request_error",
                                            "param": "max_tokens", "code": 400}}, status=400)

    c.decoders[0].handler = refuses
    status, _, raw = await c.post("/v1/chat/completions", dict(CHAT, stream=False))
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"
    # a stream that D refuses with a status (not a 200 stream) opens nothing either
    status, _, raw = await c.post("/v1/chat/completions", CHAT)
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


async def test_an_indented_upstream_error_becomes_one_event(make_cluster):
    """A prefiller's error body on several lines (indented JSON) reaches a stream whose headers
    went out as one event of compact JSON (its data would end at the first line's end)."""
    c = await concurrent_cluster(make_cluster, max_retries=0)
    go = asyncio.Event()

    async def waits_for_the_kv(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse(OPENING))
        await go.wait()

    async def indented_400(inst, request, rec):
        await asyncio.sleep(0.2)  # after D accepted the decode leg
        body = {"error": {"message": "prompt too long\nfor this prefiller", "type":
                          "invalid_request_error", "param": "messages", "code": 400}}
        return web.Response(status=400, text=json.dumps(body, indent=2),
                            content_type="application/json")

    c.prefillers[0].handler, c.decoders[0].handler = indented_400, waits_for_the_kv
    try:
        status, _, raw = await c.post("/v1/chat/completions", CHAT)
    finally:
        go.set()
    assert status == 200
    opening, event, done = raw.split(b"\n\n")[:3]
    assert opening == sse(OPENING)[:-2]
    assert event.count(b"\n") == 0 and done == b"data: [DONE]"
    error = json.loads(event[len(b"data: "):])["error"]
    assert error["message"] == "prompt too long\nfor this prefiller" and error["code"] == 400


def test_sse_event_keeps_a_payload_that_is_no_json_as_data_lines():
    from pdserve.router.client_stream import sse_event

    assert sse_event(b'{"a":1}') == b'data: {"a":1}\n\n'
    assert sse_event(b'{\n "a": 1\n}') == b'data: {"a":1}\n\n'
    assert sse_event(b"bad\r\ngateway") == b"data: bad\ndata: gateway\n\n"


async def test_a_body_sent_as_another_content_type_is_refused_as_the_engines_do(make_cluster):
    c = await concurrent_cluster(make_cluster)
    status, _, raw = await c.post("/v1/chat/completions", json.dumps(CHAT),
                                  {"Content-Type": "text/plain"})
    error = json.loads(raw)["error"]
    assert status == 400 and "application/json" in error["message"] and "text/plain" in \
        error["message"]
    assert c.prefillers[0].received == [] and c.decoders[0].received == []
    for ok in ("application/json; charset=utf-8", "application/vnd.api+json"):
        status, _, _ = await c.post("/v1/chat/completions", json.dumps(CHAT),
                                    {"Content-Type": ok})
        assert status == 200


async def test_a_stream_that_fails_after_its_first_token_counts_the_error(make_cluster):
    """The request metric counts what the client got: a stream that ends with an error event
    after tokens (the decoder's connection dropped, no migration) counts that error's status."""
    c = await concurrent_cluster(make_cluster)

    async def drops_after_a_token(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(sse({"choices": [{"index": 0, "delta": {"content": "hi"}}]}))
        request.transport.close()  # the connection drops mid-stream
        return resp

    c.decoders[0].handler = drops_after_a_token
    status, _, raw = await c.post("/v1/chat/completions", CHAT)
    assert status == 200 and b'"hi"' in raw and b'{"error"' in raw
    assert raw.endswith(b"data: [DONE]\n\n")
    metrics = c.proxy.proxy.metrics
    code = json.loads(raw.split(b"\n\n")[-3][len(b"data: "):])["error"]["code"]
    assert code >= 500
    await wait_until(lambda: metrics.requests.labels(endpoint="chat_completions",
                                                     status=str(code))._value.get() == 1)
    assert metrics.requests.labels(endpoint="chat_completions", status="200")._value.get() == 0
