"""The migratable relay's first chunks in the concurrent hand-off: the events the proxy parsed
while waiting for D's first token are not parsed again, and a chunk forwarded unchanged keeps
D's bytes (no re-encoding after the first token)."""

from __future__ import annotations

import json

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
