"""Mid-stream migration of the decode leg (``--migration-limit``) through the in-process proxy,
against fake decoders that generate autoregressively (each token a function of every token
before it, as greedy decoding is) and fail after some chunks: the client's stream must be the
uninterrupted answer, token by token, with one response id and right usage."""

from __future__ import annotations

import asyncio
import json
from aiohttp import web

from tests.support.router_fakes import prefill_params, sse_data, wait_until

PROMPT = [11, 12, 13]


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq)) % 90 + 10


def greedy(prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(next_token(seq))
    return seq[len(prompt):]


def text_of(tokens: list[int]) -> str:
    return "".join(f"t{t} " for t in tokens)


def held(pending: list[int], tok: int, last: bool) -> tuple[str, list[int]]:
    """Every token divisible by 3 has its text held back until the next token (as a multi-byte
    character is): ``(text to send, tokens still held)``."""
    if tok % 3 == 0 and not last:
        return "", pending + [tok]
    return text_of(pending + [tok]), []


def token_decoder(fail_after: int | None = None, how: str = "drop"):
    """A streaming decode handler honouring ``return_token_ids`` and ``pdserve_resume``; after
    ``fail_after`` token chunks it fails: ``drop`` (connection cut), ``eof`` (clean end without
    [DONE]), ``error`` (an in-band 503 event), ``stall`` (silence)."""

    async def handler(inst, request, rec):
        body = rec.body
        chat = request.path.endswith("chat/completions")
        resume = body.get("pdserve_resume")
        prompt = resume["prompt_token_ids"] if resume else list(PROMPT)
        done = list(resume["output_token_ids"]) if resume else []
        max_tokens = body.get("max_tokens", 16)
        ids = body.get("return_token_ids") is True
        usage = (body.get("stream_options") or {}).get("include_usage")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = f"cmpl-{inst.name}"

        async def send(choice, **extra):
            event = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": hash(inst.name) % 1000, "model": "m", "choices": [choice], **extra}
            if usage:
                event.setdefault("usage", None)
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")

        if chat and not resume:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None, **({"token_ids": []} if ids else {})},
                       **({"prompt_token_ids": prompt} if ids else {}))
        seq = prompt + done
        sent = 0
        pending: list[int] = []
        for tok in done:  # the text the first decoder held back at the seam (the engine's replay)
            _, pending = held(pending, tok, False)
        for i in range(max_tokens - len(done)):
            if fail_after is not None and sent == fail_after:
                if how == "drop":
                    request.transport.abort()
                    return resp
                if how == "error":
                    await resp.write(b'data: {"error": {"message": "engine died", "type": '
                                     b'"ServiceUnavailable", "param": null, "code": 503}}\n\n')
                    await resp.write(b"data: [DONE]\n\n")
                elif how == "stall":
                    await asyncio.sleep(30)
                await resp.write_eof()
                return resp
            tok = next_token(seq)
            seq.append(tok)
            last = i == max_tokens - len(done) - 1
            piece, pending = held(pending, tok, last)
            if ids or piece or last:  # the engine skips chunks that carry nothing
                choice = ({"index": 0, "delta": {"content": piece} if piece else {}}
                          if chat else {"index": 0, "text": piece})
                choice["logprobs"] = None
                choice["finish_reason"] = "length" if last else None
                if ids:
                    choice["token_ids"] = [tok]
                    if not chat and not resume and i == 0:
                        choice["prompt_token_ids"] = prompt
                extra = {"kv_transfer_params": inst.decoder_params(0)} if (
                    last and inst.decoder_params and not usage) else {}
                await send(choice, **extra)
                sent += 1
        if usage:
            event = {"id": rid, "object": "x", "created": 0, "model": "m", "choices": [],
                     "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens,
                               "total_tokens": len(prompt) + max_tokens}}
            await resp.write(b"data: " + json.dumps(event).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


def answer_text(events: list, chat: bool) -> str:
    parts = []
    for e in events:
        if isinstance(e, dict) and e.get("choices"):
            c = e["choices"][0]
            parts.append(c["delta"].get("content", "") if chat else c["text"])
    return "".join(parts)


async def stream(c, path: str, body: dict) -> list:
    async with c.session.post(c.url + path, json=body) as r:
        assert r.status == 200
        return sse_data(await r.read())


def migrations(c) -> dict[str, float]:
    m = c.proxy.proxy.metrics.migrations
    return {s.labels["reason"]: s.value for s in m.collect()[0].samples
            if s.name.endswith("_total")}


async def _migrated_once(make_cluster, path: str, how: str, **config):
    c = await make_cluster(n_decode=2, migration_limit=3, **config)
    c.decoders[0].handler = token_decoder(fail_after=4, how=how)
    c.decoders[1].handler = token_decoder()
    chat = "chat" in path
    body = {"model": "m", "max_tokens": 12, "stream": True, "temperature": 0,
            "stream_options": {"include_usage": True},
            **({"messages": [{"role": "user", "content": "x"}]} if chat else {"prompt": "x"})}
    events = await stream(c, path, body)
    return c, chat, events


async def test_completion_stream_survives_a_dropped_decoder(make_cluster):
    c, chat, events = await _migrated_once(make_cluster, "/v1/completions", "drop")
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1])
    assert answer_text(events, chat) == text_of(greedy(PROMPT, 12))
    assert {e["id"] for e in events[:-1]} == {"cmpl-d0"}  # one response
    assert all("token_ids" not in e["choices"][0] and "prompt_token_ids" not in e["choices"][0]
               for e in events[:-1] if e["choices"])
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 12, "total_tokens": 15}
    assert migrations(c)["connection"] == 1
    # the resumed legs: P prefilled prompt + the streamed tokens, D2 continued them
    (d1_req,) = c.decoders[1].received
    resume = d1_req.body["pdserve_resume"]
    assert resume["prompt_token_ids"] == PROMPT
    assert resume["output_token_ids"] == greedy(PROMPT, 12)[:len(resume["output_token_ids"])]
    assert len(resume["output_token_ids"]) >= 4
    p_resumed = c.prefillers[0].received[1].body
    assert p_resumed["pdserve_resume"] == resume and p_resumed["max_tokens"] == 1
    assert d1_req.body["kv_transfer_params"] == prefill_params("p0", d1_req.request_id)
    assert c.decoders[0].received[0].body["return_token_ids"] is True


async def test_chat_stream_survives_an_eof_and_sends_one_role_chunk(make_cluster):
    c, chat, events = await _migrated_once(make_cluster, "/v1/chat/completions", "eof")
    assert answer_text(events, chat) == text_of(greedy(PROMPT, 12))
    roles = [e for e in events[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert len(roles) == 1 and "prompt_token_ids" not in roles[0]
    assert migrations(c)["eof"] == 1


async def test_in_band_5xx_and_stall_migrate(make_cluster):
    c, chat, events = await _migrated_once(make_cluster, "/v1/completions", "error")
    assert answer_text(events, chat) == text_of(greedy(PROMPT, 12))
    assert migrations(c)["upstream_error"] == 1
    c, chat, events = await _migrated_once(make_cluster, "/v1/completions", "stall",
                                           stall_timeout=0.3)
    assert answer_text(events, chat) == text_of(greedy(PROMPT, 12))
    assert migrations(c)["stall"] == 1
    assert c.decoders[0].cancelled  # the stalled decoder's request was closed (D aborts it)


async def test_client_asking_for_token_ids_gets_every_id_once(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=1)
    c.decoders[0].handler = token_decoder(fail_after=5)
    c.decoders[1].handler = token_decoder()
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 10, "stream": True,
                                                 "return_token_ids": True})
    choices = [e["choices"][0] for e in events[:-1]]
    assert [t for ch in choices for t in ch["token_ids"]] == greedy(PROMPT, 10)
    assert [ch["prompt_token_ids"] for ch in choices if "prompt_token_ids" in ch] == [PROMPT]


async def test_limit_respected_then_the_error_event(make_cluster):
    c = await make_cluster(n_decode=3, migration_limit=1)
    for d in c.decoders:
        d.handler = token_decoder(fail_after=2)
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stream": True})
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["code"] == 502
    assert migrations(c)["connection"] == 1
    assert sum(len(d.received) for d in c.decoders) == 2  # the first leg and one migration
    # the text before the error is a prefix of the answer, nothing repeated
    assert text_of(greedy(PROMPT, 12)).startswith(answer_text(events, False))


async def test_failed_decoder_is_never_used_again(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=3)
    for d in c.decoders:
        d.handler = token_decoder(fail_after=2)
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stream": True})
    assert "error" in events[-2]
    assert [len(d.received) for d in c.decoders] == [1, 1]
    assert migrations(c)["connection"] == 1


async def test_seeded_request_is_not_migrated(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=3)
    c.decoders[0].handler = token_decoder(fail_after=2)
    c.decoders[1].handler = token_decoder()
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stream": True,
                                                 "seed": 7})
    assert "error" in events[-2] and events[-1] == "[DONE]"
    assert "return_token_ids" not in c.decoders[0].received[0].body
    assert not c.decoders[1].received and sum(migrations(c).values()) == 0


async def test_off_by_default(make_cluster):
    c = await make_cluster(n_decode=2)
    c.decoders[0].handler = token_decoder(fail_after=2)
    await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 12, "stream": True})
    assert "return_token_ids" not in c.decoders[0].received[0].body
    assert not c.decoders[1].received


async def test_multi_turn_next_turn_pulls_from_the_new_decoder(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=2, multi_turn=True)
    c.decoders[0].handler = token_decoder(fail_after=3)
    c.decoders[1].handler = token_decoder()
    c.decoders[1].decoder_params = lambda turn: {"remote_engine_id": "engine-d1",
                                                 "remote_request_id": "d1-turn",
                                                 "remote_block_ids": [7]}
    body = {"prompt": "x", "max_tokens": 8, "stream": True, "conversation_id": "conv"}
    events = await stream(c, "/v1/completions", body)
    assert answer_text(events, False) == text_of(greedy(PROMPT, 8))
    assert all(e.get("kv_transfer_params") is None for e in events[:-1])  # kept by the proxy
    c.decoders[0].handler = c.decoders[1].handler
    await stream(c, "/v1/completions", body)
    next_prefill = c.prefillers[0].received[-1].body["kv_transfer_params"]
    assert next_prefill["remote_engine_id"] == "engine-d1"
    assert next_prefill["remote_request_id"] == "d1-turn"


async def test_lost_end_after_the_finish_is_completed_by_the_proxy(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=3)

    async def finish_then_drop(inst, request, rec):
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, tok in enumerate(greedy(PROMPT, 3)):
            choice = {"index": 0, "text": text_of([tok]), "logprobs": None,
                      "finish_reason": "length" if i == 2 else None, "token_ids": [tok]}
            if i == 0:
                choice["prompt_token_ids"] = PROMPT
            await resp.write(b"data: " + json.dumps({"id": "cmpl-x", "object": "text_completion",
                                                     "created": 1, "model": "m", "usage": None,
                                                     "choices": [choice]}).encode() + b"\n\n")
        request.transport.abort()  # the usage chunk and [DONE] are lost
        return resp

    c.decoders[0].handler = finish_then_drop
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 3, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    assert answer_text(events, False) == text_of(greedy(PROMPT, 3))
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
    assert not c.decoders[1].received and sum(migrations(c).values()) == 0


async def test_client_going_away_closes_the_decode_leg(make_cluster):
    c = await make_cluster(n_decode=2, migration_limit=3)
    c.decoders[0].handler = token_decoder(fail_after=2, how="stall")
    async with c.session.post(c.url + "/v1/completions",
                              json={"prompt": "x", "max_tokens": 12, "stream": True}) as r:
        await asyncio.wait_for(r.content.readany(), 5)
    await asyncio.sleep(0.2)
    await wait_until(lambda: bool(c.decoders[0].cancelled))  # D sees the disconnect: aborts
    assert not c.decoders[1].received
    await wait_until(lambda: all(u.in_flight == 0 for u in c.proxy.proxy.decoders.upstreams))


async def test_decoder_answering_5xx_to_the_resumed_request_is_skipped(make_cluster):
    c = await make_cluster(n_decode=3, migration_limit=3)
    c.decoders[0].handler = token_decoder(fail_after=3)

    async def unavailable(inst, request, rec):
        return web.json_response({"error": {"message": "overloaded", "type": "x", "param": None,
                                            "code": 503}}, status=503)

    c.decoders[1].handler = unavailable
    c.decoders[2].handler = token_decoder()
    events = await stream(c, "/v1/completions", {"prompt": "x", "max_tokens": 9, "stream": True})
    assert answer_text(events, False) == text_of(greedy(PROMPT, 9))
    assert [len(d.received) for d in c.decoders] == [1, 1, 1]
    assert migrations(c) == {"connection": 1, "eof": 0, "upstream_error": 1, "stall": 0}
    # P's lease of the refused decode leg was released
    await wait_until(lambda: len(c.prefillers[0].released) >= 1)
