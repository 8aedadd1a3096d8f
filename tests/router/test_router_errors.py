"""Every error path of the proxy: exact status codes and OpenAI-style bodies."""

import asyncio
import logging
import json

from aiohttp import web

from pdserve.router import app as app_module
from pdserve.router import client_body

from .conftest import unused_port
from tests.support.router_fakes import sse, wait_until

BODY = {"model": "m", "prompt": "x", "max_tokens": 8}


def err(message, type_, code, param=None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def respond(status, body, content_type="application/json"):
    async def handler(inst, request, rec):
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return web.Response(status=status, body=data, content_type=content_type)
    return handler


async def test_prefill_client_error_passes_through_unchanged_and_is_not_retried(make_cluster):
    c = await make_cluster(n_prefill=2)
    upstream = {"error": {"message": "prompt too long: 5000 > 4096 tokens", "type": "BadRequestError",
                          "param": "prompt", "code": 400}}
    for p in c.prefillers:
        p.handler = respond(400, upstream)
    status, headers, raw = await c.post("/v1/completions", BODY)
    assert status == 400 and json.loads(raw) == upstream
    assert headers["Content-Type"] == "application/json"
    assert sum(len(p.received) for p in c.prefillers) == 1
    assert c.decoders[0].received == []


async def test_decode_client_error_passes_through(make_cluster):
    c = await make_cluster()
    upstream = err("'temperature' must be >= 0", "invalid_request_error", 400, "temperature")
    c.decoders[0].handler = respond(400, upstream)
    for stream in (False, True):  # a streaming request gets the JSON error too, not an empty 200
        status, headers, raw = await c.post("/v1/completions", dict(BODY, stream=stream))
        assert (status, json.loads(raw)) == (400, upstream)
        assert headers["Content-Type"] == "application/json"
    assert len(c.decoders[0].received) == 2


async def test_non_openai_upstream_errors_are_wrapped(make_cluster):
    c = await make_cluster(max_retries=0)
    c.prefillers[0].handler = respond(500, b"Internal Server Error", "text/plain")
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 500
    assert json.loads(raw) == err(f"prefill instance {c.prefillers[0].url} failed with HTTP 500: "
                                  "Internal Server Error", "upstream_error", 500)
    c.prefillers[0].handler = None
    c.decoders[0].handler = respond(422, {"detail": [{"loc": ["body", "max_tokens"], "msg": "bad"}]})
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 422
    assert json.loads(raw) == err('[{"loc": ["body", "max_tokens"], "msg": "bad"}]',
                                  "UnprocessableEntityError", 422)


async def test_unreachable_prefill_instance_is_503_naming_the_leg(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_prefill=0, prefill_urls=[dead], enforce_disagg=True)
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 503
    assert json.loads(raw) == err(f"no prefill instance is available (prefill instance {dead} "
                                  "unreachable (Connection refused)); decode-only fallback is off "
                                  "(--enforce-disagg)", "upstream_unavailable", 503)
    assert c.decoders[0].received == []


async def test_unreachable_decode_instance_is_503_naming_the_leg(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_decode=0, decode_urls=[dead])
    status, _, raw = await c.post("/v1/completions", dict(BODY, stream=True))
    assert status == 503
    assert json.loads(raw) == err(f"decode instance {dead} unreachable (Connection refused)",
                                  "upstream_unavailable", 503)


async def test_dead_instance_fails_over_and_is_counted(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(prefill_urls=[dead])
    for _ in range(4):
        assert (await c.post("/v1/completions", BODY))[0] == 200
    assert len(c.prefillers[0].received) == 4
    metrics = c.proxy.proxy.metrics
    # one refused connection; afterwards the dead instance is cooling down and tried last
    assert metrics.errors.labels(upstream=dead, leg="prefill")._value.get() == 1


async def test_invalid_prefill_answer_is_502(make_cluster):
    c = await make_cluster(max_retries=0)
    c.prefillers[0].handler = respond(200, b"<html>oops</html>", "text/html")
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 502
    assert json.loads(raw) == err(f"prefill instance {c.prefillers[0].url} returned an invalid "
                                  "response: body is not JSON", "upstream_error", 502)
    assert c.decoders[0].received == []


async def test_prefill_timeout_is_504(make_cluster):
    c = await make_cluster(timeout=0.3, max_retries=0)
    never = asyncio.Event()

    async def hang(inst, request, rec):
        await never.wait()

    c.prefillers[0].handler = hang
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 504
    assert json.loads(raw) == err(f"prefill instance {c.prefillers[0].url} timed out after 0.3 s",
                                  "upstream_timeout", 504)


async def test_decoder_dropping_the_stream_gives_sse_error_then_done(make_cluster):
    c = await make_cluster()
    first = sse({"choices": [{"index": 0, "text": "partial"}]})

    async def drop(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        request.transport.close()  # connection lost in the middle of the chunked body
        return resp

    c.decoders[0].handler = drop
    status, headers, raw = await c.post("/v1/completions", dict(BODY, stream=True))
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    assert raw.startswith(first)
    events = raw[len(first):].split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    error = json.loads(events[-3].removeprefix(b"data: "))
    assert error["error"]["code"] == 502 and error["error"]["type"] == "upstream_error"
    assert error["error"]["message"].startswith(f"decode instance {c.decoders[0].url} failed: ")
    assert c.proxy.proxy.metrics.errors.labels(upstream=c.decoders[0].url,
                                               leg="decode")._value.get() == 1


async def test_decoder_stalling_mid_stream_gives_sse_timeout_error(make_cluster):
    c = await make_cluster(timeout=0.3)
    never = asyncio.Event()

    async def stall(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "a"}]}')  # event cut before its end
        await never.wait()

    c.decoders[0].handler = stall
    status, _, raw = await c.post("/v1/completions", dict(BODY, stream=True))
    assert status == 200
    expected = err(f"decode instance {c.decoders[0].url} timed out after 0.3 s", "upstream_timeout", 504)
    assert raw == (b'data: {"choices": [{"text": "a"}]}\n\n'
                   + b"data: " + json.dumps(expected, separators=(",", ":")).encode() + b"\n\n"
                   + b"data: [DONE]\n\n")
    # the proxy closed the stalled upstream request, so D's server cancelled it
    await wait_until(lambda: c.decoders[0].cancelled == [c.decoders[0].received[0].request_id])


async def test_bad_client_bodies_are_400_and_reach_no_instance(make_cluster):
    c = await make_cluster()
    cases = [
        (b"{not json", "request body is not valid JSON: Expecting property name enclosed in double "
                       "quotes: line 1 column 2 (char 1)", None),
        (b"[1, 2]", "request body must be a JSON object", None),
        (json.dumps(dict(BODY, n=2)).encode(),
         "'n' > 1 is not supported by the disaggregated proxy (got 2); send 2 separate requests "
         "instead", "n"),
        (json.dumps(dict(BODY, stream="true")).encode(), "'stream' must be a boolean, got 'true'",
         "stream"),
        (json.dumps(dict(BODY, stream=True, return_token_ids="x")).encode(),
         "'return_token_ids' must be a boolean, got 'x'", "return_token_ids"),
        (json.dumps(dict(BODY, prompt=["Hi", "Bye"])).encode(),
         "a list of 2 prompts is not supported by the disaggregated proxy; send one request per "
         "prompt", "prompt"),
        (json.dumps(dict(BODY, prompt=[[1, 2], [3]])).encode(),
         "a list of 2 prompts is not supported by the disaggregated proxy; send one request per "
         "prompt", "prompt"),
        # nesting deeper than json's decoder recurses (a RecursionError, not a ValueError)
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
         "request body is not valid JSON: nested too deeply", None),
        # checked in the stateless mode too, which only drops the field
        (json.dumps(dict(BODY, conversation_id={"a": 1})).encode(),
         "'conversation_id' must be a string or an integer, got {'a': 1}", "conversation_id"),
        (json.dumps(dict(BODY, conversation_id="c" * 513)).encode(),
         "'conversation_id' is 513 characters long; at most 512 are allowed", "conversation_id"),
    ]
    for data, message, param in cases:
        status, headers, raw = await c.post("/v1/completions", data,
                                            {"Content-Type": "application/json", "X-Request-Id": "r1"})
        assert (status, json.loads(raw)) == (400, err(message, "BadRequestError", 400, param))
        assert headers["X-Request-Id"] == "r1"
    assert c.prefillers[0].received == [] and c.decoders[0].received == []


async def test_proxy_400s_have_the_engines_error_type(make_cluster):
    """A body the proxy refuses itself (not JSON) and one an instance refuses (its own
    validation) come back with the same ``type``, the one the engine server uses for a 400."""
    from pdserve.entrypoints.errors import bad_request

    c = await make_cluster()
    engine_400 = bad_request("'max_tokens' must be at least 1", param="max_tokens").body()
    c.prefillers[0].handler = respond(400, engine_400)
    status, _, raw = await c.post("/v1/completions", dict(BODY, max_tokens=0))
    assert (status, json.loads(raw)) == (400, engine_400)
    status, _, raw = await c.post("/v1/completions", b"{not json",
                                  {"Content-Type": "application/json"})
    assert status == 400
    assert json.loads(raw)["error"]["type"] == engine_400["error"]["type"] == "BadRequestError"
    # one shape (vLLM's ErrorResponse): the same fields, ``code`` the status as an integer
    proxy_400 = json.loads(raw)["error"]
    assert set(proxy_400) == set(engine_400["error"]) == {"message", "type", "param", "code"}
    assert proxy_400["code"] == engine_400["error"]["code"] == 400


async def test_too_large_body_is_413(make_cluster, monkeypatch):
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)
    c = await make_cluster()
    status, _, raw = await c.post("/v1/completions", dict(BODY, prompt="x" * 2000))
    assert (status, json.loads(raw)) == (413, err("request body larger than 1000 bytes",
                                                  "RequestTooLargeError", 413))


async def test_unknown_route_and_wrong_method(make_cluster):
    c = await make_cluster()
    async with c.session.get(c.url + "/v1/embeddings") as r:
        assert (r.status, await r.json()) == (404, err("no route GET /v1/embeddings", "NotFoundError", 404))
    async with c.session.get(c.url + "/v1/completions") as r:
        assert r.status == 405 and r.headers["Allow"] == "POST"
        assert await r.json() == err("method GET not allowed on /v1/completions (use POST)",
                                     "MethodNotAllowedError", 405)


def _releases(c, outcome):
    return c.proxy.proxy.metrics.kv_releases.labels(outcome=outcome)._value.get()


async def test_decoder_refusal_releases_the_prefill_lease_at_once(make_cluster):
    c = await make_cluster()
    c.decoders[0].handler = respond(400, err("bad", "invalid_request_error", 400))
    for stream in (False, True):
        status, headers, _ = await c.post("/v1/completions", dict(BODY, stream=stream))
        assert status == 400
    await wait_until(lambda: len(c.prefillers[0].released) == 2)
    ids = [p["remote_request_id"] for p in c.prefillers[0].released]
    assert ids == [f"p0-{r.request_id}" for r in c.prefillers[0].received]
    await wait_until(lambda: _releases(c, "released") == 2)
    # a decoder that answers keeps P's blocks for its read
    c.decoders[0].handler = None
    assert (await c.post("/v1/completions", BODY))[0] == 200
    assert len(c.prefillers[0].released) == 2


async def test_unreachable_decoder_releases_the_lease_then_skips_prefills(make_cluster):
    dead = f"http://127.0.0.1:{unused_port()}"
    c = await make_cluster(n_decode=0, decode_urls=[dead])
    status, _, _ = await c.post("/v1/completions", BODY)
    assert status == 503
    await wait_until(lambda: len(c.prefillers[0].released) == 1)
    # now known down and not answering a probe: refused before any prefill
    status, _, raw = await c.post("/v1/completions", BODY)
    assert status == 503 and "not prefilled" in json.loads(raw)["error"]["message"]
    assert len(c.prefillers[0].received) == 1
    assert c.proxy.proxy.metrics.prefills_skipped._value.get() == 1


async def test_decoder_back_after_a_failure_is_probed_and_used(make_cluster):
    c = await make_cluster()
    pool = c.proxy.proxy.decoders
    pool.mark_down(pool.upstreams[0])  # its last connection failed; it is up again
    assert (await c.post("/v1/completions", BODY))[0] == 200
    assert not pool.all_failed()
    assert len(c.decoders[0].received) == 1


async def test_client_gone_before_the_decoder_answers_releases_the_lease(make_cluster):
    from .test_router_disconnect import _send_and_leave

    c = await make_cluster()
    never = asyncio.Event()

    async def slow_decode(inst, request, rec):
        await never.wait()

    d = c.decoders[0]
    d.handler = slow_decode
    await _send_and_leave(c.url + "/v1/completions", BODY, lambda: len(d.received) == 1)
    await wait_until(lambda: len(c.prefillers[0].released) == 1)
    assert c.prefillers[0].released[0]["remote_request_id"] == f"p0-{d.received[0].request_id}"


async def test_declared_body_over_the_limit_is_413_before_reading_it(make_cluster, monkeypatch):
    """A Content-Length over the limit is refused from the header (the engines do the same), not
    after waiting for a body the client may never send."""
    monkeypatch.setattr(app_module, "MAX_BODY_BYTES", 1000)
    c = await make_cluster()
    host, port = c.url.split("//")[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000000000000\r\n\r\n{\"prompt\": \"hi\"}")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=5)
    writer.close()
    assert head.startswith(b"HTTP/1.1 413"), head
    assert c.prefillers[0].received == []


async def test_large_bodies_are_parsed_off_the_event_loop_and_served(make_cluster, monkeypatch):
    monkeypatch.setattr(client_body, "PARSE_INLINE_BYTES", 100)
    in_threads = []
    to_thread = asyncio.to_thread

    async def recording(fn, *args, **kwargs):
        in_threads.append(fn)
        return await to_thread(fn, *args, **kwargs)

    monkeypatch.setattr(asyncio, "to_thread", recording)
    c = await make_cluster()
    status, _, raw = await c.post("/v1/completions", dict(BODY, prompt="x" * 20))
    assert status == 200, raw
    assert in_threads == []  # a small body is parsed inline
    status, _, raw = await c.post("/v1/completions", dict(BODY, prompt="x" * 500))
    assert status == 200, raw
    assert in_threads == [json.loads]
    assert c.prefillers[0].received[-1].body["prompt"] == "x" * 500
    status, _, raw = await c.post("/v1/completions", b"{" + b" " * 200)
    assert status == 400 and b"not valid JSON" in raw


async def test_an_unexpected_proxy_error_is_counted_as_500(make_cluster, monkeypatch):
    from pdserve.router import app as app_module

    def broken(body):
        raise RuntimeError("a bug in the proxy")

    monkeypatch.setattr(app_module, "check_client_body", broken)
    c = await make_cluster()
    status, _, _ = await c.post("/v1/completions", BODY)
    assert status == 500
    requests = c.proxy.proxy.metrics.requests
    assert requests.labels(endpoint="completions", status="500")._value.get() == 1
    assert requests.labels(endpoint="completions", status="499")._value.get() == 0


async def test_a_malformed_http_request_is_a_400_and_a_one_line_warning(make_cluster, caplog):
    """aiohttp answers a request it cannot parse (here a duplicate Content-Type header) with a
    400 before any handler runs; the proxy logs it as the client's fault, without a
    traceback, and goes on serving."""
    c = await make_cluster()
    host, port = c.url.removeprefix("http://").split(":")
    body = json.dumps(BODY).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
    with caplog.at_level(logging.DEBUG, logger="aiohttp.server"):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(request)
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10)
        writer.close()
        await wait_until(lambda: any(r.name == "aiohttp.server" for r in caplog.records))
    assert status_line.split()[1] == b"400"
    [record] = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.WARNING and record.exc_info is None
    assert "Duplicate 'Content-Type' header" in record.getMessage()
    status, _, _ = await c.post("/v1/completions", BODY)
    assert status == 200
