"""The first chunks of a stream in the concurrent hand-off: the events the proxy parsed while
waiting for D's first token are not parsed again, a chunk forwarded unchanged keeps D's bytes
(no re-encoding after the first token), the opening chunks are told apart from the rest, and
each choice's opening goes to the client once per turn."""

from __future__ import annotations

import json

import pytest

from pdserve.router.first_token import FirstEventKind, FirstTokenWatch
from pdserve.router.stream_ledger import StreamLedger

OPENING = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
           "prompt_token_ids": [1, 2, 3],
           "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None}]}
TOKEN = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hi"}, "token_ids": [42],
                      "logprobs": None, "finish_reason": None}]}


def _sse(event) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


def test_the_watch_keeps_what_it_parsed_in_stream_order():
    watch = FirstTokenWatch()
    assert watch.feed(_sse(OPENING)) is None
    first = watch.feed(_sse(TOKEN) + b"data: {\"partial")
    assert first is not None and first.kind is FirstEventKind.TOKEN
    assert [value for _, value in watch.parsed] == [OPENING, TOKEN]
    assert [payload for payload, _ in watch.parsed] == [json.dumps(OPENING).encode(),
                                                        json.dumps(TOKEN).encode()]
    assert watch.feed(b"data: [DONE]\n\n").kind is FirstEventKind.TOKEN


def test_an_unchanged_chunk_keeps_ds_bytes_and_a_changed_one_is_encoded_again():
    raw = json.dumps(OPENING).encode()  # D's spacing, not the proxy's
    ledger = StreamLedger(client_wants_ids=True, include_usage=False)
    assert ledger.forward(json.loads(raw), raw) == b"data: " + raw + b"\n\n"
    assert ledger.prompt_token_ids == [1, 2, 3]
    # a resumed leg's chunk gets the first leg's id: encoded again
    resumed = dict(TOKEN, id="chatcmpl-2")
    out = ledger.forward(json.loads(json.dumps(resumed)), json.dumps(resumed).encode())
    assert json.loads(out[6:])["id"] == "chatcmpl-1" and b", " not in out
    assert ledger.output_token_ids == [42]
    # the client did not ask for token ids: they are stripped, whatever raw says
    plain = StreamLedger(client_wants_ids=False, include_usage=False)
    out = plain.forward(json.loads(raw), raw)
    assert b"prompt_token_ids" not in out and plain.prompt_token_ids == [1, 2, 3]


def test_the_watch_tells_the_opening_chunks_and_the_rest_apart():
    watch = FirstTokenWatch()
    assert watch.feed(_sse(OPENING) + b": keep-alive\n\n") is None
    assert [v for _, v in watch.openings] == [OPENING] and watch.comments == 1
    first = watch.feed(_sse(OPENING) + _sse(TOKEN) + b"data: {\"partial")
    assert first.kind is FirstEventKind.TOKEN and [v for _, v in watch.openings] == [OPENING]
    # from the first token on, as read so far: its event and the start of the next one
    assert watch.rest() == b"data: " + json.dumps(TOKEN).encode() + b"\n\ndata: {\"partial"


def test_each_choice_opens_once_and_a_retried_leg_continues_the_first_response():
    ledger = StreamLedger(client_wants_ids=False, include_usage=False)
    two = dict(OPENING, choices=[OPENING["choices"][0], dict(OPENING["choices"][0], index=1)])
    raw = json.dumps(OPENING).encode()
    out = ledger.opening(json.loads(raw), raw)  # the ids only the proxy asked for: stripped
    assert json.loads(out[6:]) == {k: v for k, v in OPENING.items() if k != "prompt_token_ids"}
    assert ledger.opened == {0} and ledger.prompt_token_ids == [1, 2, 3]
    # a retried leg: choice 0 opened already, choice 1 not; its id and created become the first's
    retried = dict(two, id="chatcmpl-2", created=8)
    out = ledger.opening(json.loads(json.dumps(retried)))
    event = json.loads(out[6:])
    assert [c["index"] for c in event["choices"]] == [1]
    assert (event["id"], event["created"]) == ("chatcmpl-1", 7) and ledger.opened == {0, 1}
    assert ledger.opening(json.loads(json.dumps(retried))) is None  # both had: dropped
    # the same prompt's ids, or none, pass; other ones are refused
    assert ledger.opening(dict(retried, prompt_token_ids=None)) is None
    with pytest.raises(ValueError, match="prompt_token_ids"):
        ledger.opening(dict(retried, prompt_token_ids=[1, 2, 4]))
