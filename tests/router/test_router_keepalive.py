"""A decoder's SSE keep-alive comments (``: keep-alive``, sent while a busy decoder has nothing to
send) through the proxy: a decode leg that sends only comments for longer than
``--stall-timeout`` is alive (not migrated, not cut off), the comments reach the client, and
none is taken for D's first token; the proxy's SSE parsers ignore them."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from pdserve.router.first_token import FirstEventKind, FirstTokenWatch
from pdserve.router.stream_ledger import SSEEvents
from tests.support.handoff_fakes import SideChannels, info_for
from tests.support.router_fakes import sse

KEEPALIVE = b": keep-alive\n\n"
COMMENT_EVERY_S = 0.05
STALL_TIMEOUT_S = 0.2
SILENT_S = 0.6  # how long the decoder sends only comments: three stall timeouts
PIECES = ("Hel", "lo", " wor", "ld")


def busy_decoder(comments_after: int, claim=None):
    """A streaming decode handler (chat or completions; ``token_ids`` when asked for) that sends
    only keep-alive comments for ``SILENT_S`` after ``comments_after`` token chunks (0: before
    the first token, after a chat stream's opening chunk). ``claim``: a concurrent hand-off's
    pending leg waits for P's params there first (after the opening chunk and comments)."""

    async def handler(inst, request, rec):
        chat = request.path.endswith("chat/completions")
        ids = rec.body.get("return_token_ids") is True
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        rid = f"cmpl-{inst.name}"
        if chat:
            await resp.write(sse({"id": rid, "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None, **({"token_ids": []} if ids else {})}],
                **({"prompt_token_ids": [1, 2]} if ids else {})}))
        for i, piece in enumerate(PIECES):
            if i == comments_after:
                for _ in range(round(SILENT_S / COMMENT_EVERY_S)):
                    await asyncio.sleep(COMMENT_EVERY_S)
                    await resp.write(KEEPALIVE)
            if i == 0 and claim is not None:
                assert await claim(rec.body["kv_transfer_params"]["remote_transfer_id"])
            last = i == len(PIECES) - 1
            choice = {"index": 0, "finish_reason": "length" if last else None,
                      **({"delta": {"content": piece}} if chat else {"text": piece})}
            if ids:
                choice["token_ids"] = [10 + i]
                if i == 0 and not chat:
                    choice["prompt_token_ids"] = [1, 2]
            await resp.write(sse({"id": rid, "choices": [choice]}))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return handler


def answer(raw: bytes, chat: bool) -> str:
    events = [json.loads(e[6:]) for e in raw.decode().split("\n\n") if e.startswith("data: {")]
    assert not any("error" in e for e in events), events
    return "".join(e["choices"][0]["delta"].get("content", "") if chat
                   else e["choices"][0]["text"] for e in events)


def decode_handoff(c) -> tuple[float, float]:
    """(count, sum in s) of ``pdserve:proxy_handoff_seconds{leg="decode"}``."""
    get = c.proxy.proxy.metrics.registry.get_sample_value
    return (get("pdserve:proxy_handoff_seconds_count", {"leg": "decode"}),
            get("pdserve:proxy_handoff_seconds_sum", {"leg": "decode"}))


def migrated(c) -> float:
    m = c.proxy.proxy.metrics.migrations
    return sum(s.value for s in m.collect()[0].samples if s.name.endswith("_total"))


def body(path: str) -> dict:
    prompt = ({"messages": [{"role": "user", "content": "x"}]} if "chat" in path
              else {"prompt": "x"})
    return {"model": "m", "max_tokens": 4, "stream": True, "temperature": 0, **prompt}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("comments_after", [0, 2])
async def test_busy_decoder_outlives_the_stall_timeout(make_cluster, path, comments_after):
    c = await make_cluster(n_decode=2, migration_limit=3, stall_timeout=STALL_TIMEOUT_S)
    c.decoders[0].handler = busy_decoder(comments_after)
    c.decoders[1].handler = busy_decoder(99)
    status, _, raw = await c.post(path, body(path))
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")
    assert answer(raw, "chat" in path) == "".join(PIECES)
    assert migrated(c) == 0 and not c.decoders[1].received and not c.decoders[0].cancelled
    assert raw.count(KEEPALIVE) >= 5  # passed on: the client's own idle timer sees them too
    count, seconds = decode_handoff(c)
    assert count == 1
    if comments_after == 0:  # D's first token came after the comments, not with the first
        assert seconds >= SILENT_S * 0.9


async def test_plain_relay_passes_comments_on(make_cluster):
    c = await make_cluster()  # no migration: the byte relay
    c.decoders[0].handler = busy_decoder(1)
    status, _, raw = await c.post("/v1/completions", body("/v1/completions"))
    assert status == 200 and answer(raw, False) == "".join(PIECES)
    assert raw.count(KEEPALIVE) >= 5 and raw.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("migration_limit", [0, 3])
async def test_comments_before_the_first_token_of_a_concurrent_handoff(make_cluster,
                                                                       migration_limit):
    """Sent on as they come, as the opening chunk is (not taken for D's first token)."""
    c = await make_cluster(instance_info=info_for(1, tp_size=2), migration_limit=migration_limit,
                           stall_timeout=STALL_TIMEOUT_S)
    channels = SideChannels()
    channels.install(c.prefillers, c.decoders)
    c.decoders[0].handler = busy_decoder(0, claim=channels.claim)
    path = "/v1/chat/completions"
    status, _, raw = await c.post(path, body(path))
    assert status == 200 and answer(raw, True) == "".join(PIECES)
    assert raw.count(b'"role"') == 1 and raw.index(b'"role"') < raw.index(b'"Hel"')
    assert raw.count(KEEPALIVE) >= 5  # one per chunk read: D sent them apart
    (d_req,) = c.decoders[0].received
    assert d_req.body["kv_transfer_params"].get("remote_transfer_id")  # the concurrent form
    count, seconds = decode_handoff(c)
    assert count == 1 and seconds >= SILENT_S * 0.9
    assert migrated(c) == 0


def test_sse_events_ignore_comments_at_every_split():
    data = (b": keep-alive\n\ndata: {\"a\": 1}\n\n: keep-alive\r\n\r\n: x\ndata: [DONE]\n\n"
            b": keep-alive\n\n")
    for cut in range(len(data) + 1):
        events = SSEEvents()
        first = events.feed(data[:cut])
        comments = events.comments
        payloads = first + events.feed(data[cut:])
        assert payloads == [b'{"a": 1}', b"[DONE]"], cut
        assert comments + events.comments == 3, cut  # ": x" is in an event with data


def test_a_comment_is_no_first_token():
    watch = FirstTokenWatch()
    assert watch.feed(KEEPALIVE) is None
    assert watch.feed(sse({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                "content": ""}}]})) is None
    assert watch.feed(KEEPALIVE + KEEPALIVE) is None
    event = watch.feed(KEEPALIVE + sse({"choices": [{"index": 0, "text": "a"}]}))
    assert event is not None and event.kind is FirstEventKind.TOKEN
