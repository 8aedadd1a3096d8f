"""Watching an SSE stream for the decoder's kv_transfer_params, whatever the chunking."""

import json

from pdserve.router.sse import KVParamsWatcher


def stream(final_params):
    events = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}], "kv_transfer_params": None},
              {"choices": [{"text": "c"}], "kv_transfer_params": final_params}]
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


def test_every_split_point_finds_the_final_params():
    params = {"remote_block_ids": [7, 8], "remote_host": "h"}
    data = stream(params)
    for cut in range(len(data) + 1):
        w = KVParamsWatcher()
        w.feed(data[:cut])
        w.feed(data[cut:])
        assert w.kv_transfer_params == params, cut


def test_byte_by_byte_and_crlf():
    params = {"remote_block_ids": [1]}
    w = KVParamsWatcher()
    for b in stream(params).replace(b"\n", b"\r\n"):
        w.feed(bytes([b]))
    assert w.kv_transfer_params == params


def test_no_params_and_garbage_lines():
    w = KVParamsWatcher()
    w.feed(b': comment "kv_transfer_params"\n\ndata: {"kv_transfer_params": \n\n')
    w.feed(stream(None))
    assert w.kv_transfer_params is None


def test_strip_forwards_everything_but_the_params_at_every_split_point():
    params = {"remote_block_ids": [7, 8], "remote_host": "h"}
    data = stream(params)
    for cut in range(len(data) + 1):
        w = KVParamsWatcher(strip=True)
        out = w.feed(data[:cut]) + w.feed(data[cut:]) + w.flush()
        assert w.kv_transfer_params == params, cut
        events = [json.loads(line[5:]) for line in out.split(b"\n")
                  if line.startswith(b"data:") and line != b"data: [DONE]"]
        assert [e["choices"][0]["text"] for e in events] == ["a", "b", "c"], cut
        assert [e["kv_transfer_params"] for e in events[1:]] == [None, None], cut
        assert out.endswith(b"data: [DONE]\n\n") and b"remote_host" not in out, cut
