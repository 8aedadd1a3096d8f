"""Retries before D's first token once the client has D's opening chunk (the concurrent hand-off
sends it as it comes: pdserve/router/client_stream.py, docs/proxy.md): the client gets one
opening chunk, every later chunk with its ``id`` and ``created``, and the answer a direct
request to the decoder that served gives; a retried decoder that tokenized the prompt otherwise
ends the stream with an error event."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from tests.support.handoff_fakes import SideChannels, info_for
from tests.support.router_fakes import sse, sse_data, wait_until

from .test_router_concurrent_failover import after_decoder_arrived, assert_slots_free
from .test_router_failover import drop_before_answering, fallbacks, retries

PROMPT = [11, 12, 13]
CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
        "max_tokens": 6, "temperature": 0}


def next_token(seq: list[int]) -> int:
    return (sum(seq) * 31 + len(seq)) % 90 + 10


class Plan:
    """How the cluster's successive decode legs go (each popped by the leg, in arrival order).

    Attributes:
        fails: how a leg fails right after its opening chunk, before any token: ``drop`` (the
            connection closes), ``error`` (an in-band 503, as a failed KV read) or None; legs
            past the list do not fail.
        prompts: the prompt token ids a leg's decoder computed (PROMPT past the list).
        legs: the decoder of each leg so far, in order.
        closed: the legs (their number) the proxy closed while the decoder wrote to them.
    """

    def __init__(self, fails=(), prompts=()):
        self.fails = list(fails)
        self.prompts = list(prompts)
        self.legs: list = []
        self.closed: list[int] = []


def decoder(channels: SideChannels, plan: Plan):
    """A streaming decode handler (chat or completions) that honours ``return_token_ids``: a
    chat stream opens with its role chunk (with ``prompt_token_ids`` when asked); a pending leg
    then waits at P's side channel; the tokens follow (greedy: each a function of all before).
    Each chunk has this request's own ``id`` and ``created``; ``plan`` says how the leg goes."""

    async def handler(inst, request, rec):
        plan.legs.append(inst)
        try:
            return await leg(inst, request, rec)
        except ConnectionResetError:
            plan.closed.append(len(plan.legs) - 1)
            raise web.HTTPServiceUnavailable() from None  # the proxy is gone: nobody reads it

    async def leg(inst, request, rec):
        fail = plan.fails.pop(0) if plan.fails else None
        prompt = plan.prompts.pop(0) if plan.prompts else PROMPT
        body = rec.body
        chat = request.path.endswith("chat/completions")
        ids = body.get("return_token_ids") is True
        n = len(inst.received)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{inst.name}-{n}"
        created = 1000 * (int(inst.name[1:]) + 1) + n
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        async def send(choice, **extra):
            await resp.write(sse({"id": rid, "object": "chat.completion.chunk" if chat
                                  else "text_completion", "created": created, "model": "m",
                                  "choices": [choice], **extra}))

        if chat:
            await send({"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None,
                        **({"token_ids": []} if ids else {})},
                       **({"prompt_token_ids": prompt} if ids else {}))
        if fail == "drop":
            request.transport.close()
            return resp
        if fail == "error":
            await resp.write(sse({"error": {"message": "KV load failed", "type": "x",
                                            "param": None, "code": 503}}) + b"data: [DONE]\n\n")
            return resp
        kv = body.get("kv_transfer_params") or {}
        if kv.get("remote_transfer_id"):
            assert await channels.claim(kv["remote_transfer_id"]) is not None
        seq = list(prompt)
        max_tokens = body["max_tokens"]
        for i in range(max_tokens):
            tok = next_token(seq)
            seq.append(tok)
            choice = ({"index": 0, "delta": {"content": f"t{tok} "}} if chat
                      else {"index": 0, "text": f"t{tok} "})
            choice.update(logprobs=None, finish_reason="length" if i == max_tokens - 1 else None)
            if ids:
                choice["token_ids"] = [tok]
                if not chat and i == 0:
                    choice["prompt_token_ids"] = prompt
            await send(choice)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


def text(events: list) -> str:
    return "".join(c["delta"].get("content", "") if "delta" in c else c["text"]
                   for e in events if isinstance(e, dict) for c in e.get("choices") or [])


def token_ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) for c in e.get("choices") or []
            for t in c.get("token_ids", [])]


def openings(events: list) -> list[dict]:
    return [e for e in events if isinstance(e, dict) and e.get("choices")
            and "role" in e["choices"][0].get("delta", {})]


async def direct(inst, path: str, body: dict) -> list:
    """The decoder's answer to the client's body sent to it directly (no proxy, no hand-off)."""
    async with aiohttp.ClientSession() as s, s.post(inst.url + path, json=body) as r:
        return sse_data(await r.read())


async def cluster(make_cluster, plan: Plan, **kwargs):
    c = await make_cluster(instance_info=info_for(), **kwargs)
    channels = SideChannels()
    channels.install(c.prefillers, c.decoders)
    for d in c.decoders:
        d.handler = decoder(channels, plan)
    return c


def assert_one_response(events: list, ids: bool) -> dict:
    """One opening chunk, first; every chunk with its ``id`` and ``created``; token id fields
    only when the client asked for them. Returns the opening chunk."""
    assert events[-1] == "[DONE]" and not any("error" in e for e in events[:-1]), events
    chunks = events[:-1]
    (opening,) = openings(chunks)
    assert chunks[0] is opening
    assert {e["id"] for e in chunks} == {opening["id"]}
    assert {e["created"] for e in chunks} == {opening["created"]}
    if ids:
        assert [e["prompt_token_ids"] for e in chunks if "prompt_token_ids" in e] == [PROMPT]
    else:
        assert not any("prompt_token_ids" in e or "token_ids" in e["choices"][0]
                       for e in chunks if e["choices"])
    return opening


@pytest.mark.parametrize("fail,ids,migration_limit", [
    ("drop", False, 0), ("error", True, 0), ("drop", True, 3), ("error", False, 3)])
async def test_a_retry_before_the_first_token_keeps_the_clients_opening(
        make_cluster, fail, ids, migration_limit):
    """The first decoder fails after its opening chunk reached the client: the retried pair's
    opening is dropped and its chunks carry the first opening's id and created, relayed
    without migration (migration off) or by the migrating relay."""
    plan = Plan([fail])
    c = await cluster(make_cluster, plan, n_decode=2, migration_limit=migration_limit)
    body = dict(CHAT, return_token_ids=True) if ids else CHAT
    status, _, raw = await c.post("/v1/chat/completions", body)
    assert status == 200
    events = sse_data(raw)
    opening = assert_one_response(events, ids)
    failed, served = plan.legs
    assert failed is not served
    assert opening["id"] == f"chatcmpl-{failed.name}-1"  # the failed leg's, sent at once
    assert retries(c, "decode") == 1
    expected = await direct(served, "/v1/chat/completions", body)
    assert text(events) == text(expected) and text(events)
    assert token_ids(events) == token_ids(expected)
    await assert_slots_free(c)


async def test_a_completions_stream_retried_before_its_first_token_is_the_second_one(
        make_cluster):
    """No opening chunk: nothing of the failed leg reached the client, whose chunks are the
    retried decoder's own."""
    plan = Plan(["drop"])
    c = await cluster(make_cluster, plan, n_decode=2)
    body = {"model": "m", "prompt": "x", "max_tokens": 5, "stream": True,
            "return_token_ids": True}
    status, _, raw = await c.post("/v1/completions", body)
    events = sse_data(raw)
    assert status == 200 and events[-1] == "[DONE]"
    _, served = plan.legs
    assert {e["id"] for e in events[:-1]} == {f"cmpl-{served.name}-1"}
    expected = await direct(served, "/v1/completions", body)
    assert text(events) == text(expected) and token_ids(events) == token_ids(expected)
    assert retries(c, "decode") == 1


async def test_a_retry_served_sequentially_drops_its_opening_too(make_cluster):
    """P fails once the client has D's opening chunk; no prefiller is left, so the decoder
    serves the request alone (the sequential flow's decode-only fallback): its own opening is
    dropped and its chunks get the first opening's id."""
    c = await cluster(make_cluster, Plan())
    p, d = c.prefillers[0], c.decoders[0]
    opened = asyncio.Event()

    async def fails_once_the_client_has_the_opening(inst, request, rec):
        await asyncio.wait_for(opened.wait(), 5)
        return await drop_before_answering(inst, request, rec)

    p.handler = after_decoder_arrived(d, fails_once_the_client_has_the_opening)
    body = dict(CHAT, return_token_ids=True)
    async with c.session.post(c.url + "/v1/chat/completions", json=body) as r:
        # D's opening chunk comes while P still prefills (held until D's first token, it
        # would not)
        first = await asyncio.wait_for(r.content.readuntil(b"\n\n"), 2)
        opened.set()
        raw = first + await r.read()
    events = sse_data(raw)
    opening = assert_one_response(events, ids=True)
    assert opening["id"] == f"chatcmpl-{d.name}-1" and len(d.received) == 2
    assert "kv_transfer_params" not in d.received[1].body and fallbacks(c) == 1
    expected = await direct(d, "/v1/chat/completions", body)
    assert text(events) == text(expected) and token_ids(events) == token_ids(expected)
    await assert_slots_free(c)


async def test_a_retried_decoder_with_other_prompt_ids_ends_the_stream(make_cluster):
    """The retried leg's opening chunk names other prompt token ids than the one the client
    has: nothing of its stream is sent; the client gets a 502 error event (not retried again)
    after the first opening chunk, and no block stays held."""
    plan = Plan(["drop"], [PROMPT, PROMPT + [99]])
    c = await cluster(make_cluster, plan, n_decode=2)
    status, _, raw = await c.post("/v1/chat/completions", dict(CHAT, return_token_ids=True))
    assert status == 200
    events = sse_data(raw)
    assert len(events) == 3 and events[-1] == "[DONE]"
    assert openings(events) == [events[0]] and events[0]["prompt_token_ids"] == PROMPT
    error = events[1]["error"]
    assert error["code"] == 502 and "tokenized the prompt otherwise" in error["message"]
    assert len(plan.legs) == 2 and retries(c, "decode") == 1
    # the retried leg was closed (its decoder aborts the request)
    await wait_until(lambda: plan.closed == [1] or plan.legs[1].cancelled)
    await wait_until(lambda: c.proxy.proxy.metrics.requests.labels(
        endpoint="chat_completions", status="502")._value.get() == 1)
    await assert_slots_free(c)
