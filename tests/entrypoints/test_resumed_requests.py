"""The engine side of mid-stream migration: vLLM's ``return_token_ids`` and pdserve's
``pdserve_resume`` on both endpoints (in-process fake engine), and the seam of a resumed
request's text (detokenizer and stop strings continued: :class:`RequestState`)."""

from __future__ import annotations


import pytest

from pdserve.engine.output_processor import RequestState, process_output
from pdserve.types.outputs import EngineCoreOutput
from pdserve.types.sampling_params import SamplingParams
from tests.support.fake_engine_for_server import make_char_tokenizer
from tests.support.router_fakes import sse_data

CHAT = [{"role": "user", "content": "hi"}]


def chat_prompt_ids(fake_engine) -> list[int]:
    text = fake_engine.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return fake_engine.tokenizer.encode(text, add_special_tokens=False)


async def test_stream_return_token_ids_chat(client, fake_engine):
    r = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 5, "stream": True, "return_token_ids": True})
    evs = sse_data(r.content)
    prompt = chat_prompt_ids(fake_engine)
    assert evs[0]["prompt_token_ids"] == prompt
    assert evs[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("prompt_token_ids" not in e for e in evs[1:-1])
    ids = [t for e in evs[:-1] for t in e["choices"][0]["token_ids"]]
    assert ids == fake_engine.expected_tokens(prompt, None, 5)


async def test_resumed_chat_stream_continues_without_role_chunk(client, fake_engine):
    prompt = chat_prompt_ids(fake_engine)
    full = fake_engine.expected_tokens(prompt, None, 6)
    r = await client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 6, "min_tokens": 4, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "pdserve_resume": {"prompt_token_ids": prompt, "output_token_ids": full[:2]}})
    assert r.status_code == 200
    evs = sse_data(r.content)
    assert evs[-1] == "[DONE]"
    chunks = [e for e in evs[:-1] if e["choices"]]
    assert all("role" not in c["choices"][0]["delta"] for c in chunks)
    assert all("prompt_token_ids" not in e for e in evs[:-1])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == full[2:]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        fake_engine.tokenizer.decode(full[2:])
    assert evs[-2]["usage"]["prompt_tokens"] == len(prompt)
    assert evs[-2]["usage"]["completion_tokens"] == 6
    (call,) = fake_engine.calls.values()
    assert call["prompt"] == prompt and call["resumed"] == full[:2]
    assert call["params"].max_tokens == 4 and call["params"].min_tokens == 2


async def test_resumed_completion_non_stream(client, fake_engine):
    prompt = [5, 6, 7]
    full = fake_engine.expected_tokens(prompt, None, 5)
    r = await client.post("/v1/completions", json={
        "prompt": "ignored", "max_tokens": 5, "return_token_ids": True,
        "pdserve_resume": {"prompt_token_ids": prompt, "output_token_ids": full[:3]}})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    assert choice["token_ids"] == full[3:] and choice["prompt_token_ids"] == prompt
    assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("extra,param", [
    ({"seed": 3}, "seed"),
    ({"logprobs": 0}, "logprobs"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"max_tokens": 2}, "pdserve_resume"),  # two output tokens leave nothing to generate
])
async def test_resume_refused_where_it_cannot_be_identical(client, fake_engine, extra, param):
    body = {"prompt": "ab", "max_tokens": 5,
            "pdserve_resume": {"prompt_token_ids": [5, 6], "output_token_ids": [7, 8]}, **extra}
    r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert not fake_engine.calls


async def test_resume_ids_checked_at_the_edge(client, fake_engine):
    for resume in ({"prompt_token_ids": [], "output_token_ids": []},
                   {"prompt_token_ids": [1], "output_token_ids": [-1]},
                   {"prompt_token_ids": [1], "output_token_ids": [10**6]},
                   {"prompt_token_ids": [True], "output_token_ids": []}):
        r = await client.post("/v1/completions", json={"prompt": "a", "pdserve_resume": resume})
        assert r.status_code == 400, (resume, r.text)
        assert r.json()["error"]["code"] == 400
    assert not fake_engine.calls


def _out(tokens: list[int], finish: str | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id="r", new_token_ids=tokens, finish_reason=finish)


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_stop_string_spanning_the_seam_is_found():
    tok = make_char_tokenizer()
    prompt = _ids(tok, "Q:")
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["xyz"])
    # the first instance streamed "ab " and held back "xy" (a possible start of the stop string)
    st = RequestState(tok, prompt, params, _ids(tok, "ab xy"))
    out = process_output(_out(_ids(tok, "z")), st)
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == "xyz"
    assert out.new_text == ""
    assert out.num_output_tokens == 6 and out.num_prompt_tokens == len(prompt)


def test_held_back_text_comes_out_after_the_seam():
    tok = make_char_tokenizer()
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["xyz"])
    st = RequestState(tok, _ids(tok, "Q:"), params, _ids(tok, "ab xy"))
    out = process_output(_out(_ids(tok, "q")), st)
    assert out.new_text == "xyq" and not out.finished


def test_min_tokens_count_the_resumed_tokens():
    tok = make_char_tokenizer()
    # min_tokens 4 of which 3 are done: the core gets 1; "xyz" may not end within 4 tokens
    params = SamplingParams(temperature=0.0, max_tokens=20, stop=["b"], min_tokens=1)
    st = RequestState(tok, _ids(tok, "Q:"), params, _ids(tok, "aaa"))
    assert process_output(_out(_ids(tok, "b")), st).new_text == "b"
    assert process_output(_out(_ids(tok, "b")), st).finish_reason == "stop"
