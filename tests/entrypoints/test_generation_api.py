"""Completions and chat over the fake engine: bodies, SSE framing, usage, n > 1, logprobs,
sampling-parameter mapping and ``kv_transfer_params``."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from tests.support.live_server import parse_sse, wait_until
from tests.support.fake_engine_for_server import FakeEngine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]


def chat_prompt_ids(engine: FakeEngine, messages: list[dict]) -> list[int]:
    text = engine.tokenizer.apply_chat_template(messages, tokenize=False,
                                                add_generation_prompt=True)
    return engine.tokenizer.encode(text, add_special_tokens=False)


async def test_completion_text_and_usage(client: httpx.AsyncClient,
                                         fake_engine: FakeEngine) -> None:
    fake_engine.cached_tokens = 2
    r = await client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 5,
                                            "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    prompt_ids = fake_engine.tokenizer.encode("Hello")
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"] == [{"index": 0, "text": fake_engine.expected_text(prompt_ids, None, 5),
                                "logprobs": None, "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": len(prompt_ids), "completion_tokens": 5,
                             "total_tokens": len(prompt_ids) + 5,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    assert body["kv_transfer_params"] is None
    (call,) = fake_engine.calls.values()
    assert call["prompt"] == prompt_ids


async def test_completion_prompt_forms_and_n(client: httpx.AsyncClient,
                                             fake_engine: FakeEngine) -> None:
    tok = fake_engine.tokenizer
    ids_a, ids_b = tok.encode("ab"), tok.encode("xyz")
    for prompt in (["ab", "xyz"], [ids_a, ids_b]):
        fake_engine.calls.clear()
        r = await client.post(COMPLETIONS, json={"prompt": prompt, "n": 2, "max_tokens": 3,
                                                "seed": 7})
        assert r.status_code == 200, r.text
        body = r.json()
        expected = [fake_engine.expected_text(p, 7 + i, 3) for p in (ids_a, ids_b)
                    for i in range(2)]
        assert [c["index"] for c in body["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in body["choices"]] == expected
        # One engine request per choice, ids {id}-{index}, seed + i per choice of a prompt.
        assert sorted(fake_engine.calls) == [f"{body['id']}-{k}" for k in range(4)]
        seeds = [fake_engine.calls[f"{body['id']}-{k}"]["params"].seed for k in range(4)]
        assert seeds == [7, 8, 7, 8]
        # Each prompt counted once in usage; every choice's tokens counted.
        assert body["usage"]["prompt_tokens"] == len(ids_a) + len(ids_b)
        assert body["usage"]["completion_tokens"] == 12
    r = await client.post(COMPLETIONS, json={"prompt": ids_b, "max_tokens": 2})
    assert r.json()["choices"][0]["text"] == fake_engine.expected_text(ids_b, None, 2)


async def test_chat_uses_template_with_generation_prompt(client: httpx.AsyncClient,
                                                        fake_engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "hel"},
                                             {"type": "text", "text": "lo"}]}]
    r = await client.post(CHAT, json={"messages": messages, "max_tokens": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    flat = [messages[0], {"role": "user", "content": "hello"}]
    prompt_ids = chat_prompt_ids(fake_engine, flat)
    assert fake_engine.tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    (call,) = fake_engine.calls.values()
    assert call["prompt"] == prompt_ids
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [{
        "index": 0, "logprobs": None, "finish_reason": "length",
        "message": {"role": "assistant",
                    "content": fake_engine.expected_text(prompt_ids, None, 4)}}]
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)


async def test_chat_without_max_tokens_may_fill_the_context(client: httpx.AsyncClient,
                                                           fake_engine: FakeEngine) -> None:
    r = await client.post(CHAT, json={"messages": USER_HI})
    assert r.status_code == 200
    prompt_len = len(chat_prompt_ids(fake_engine, USER_HI))
    (call,) = fake_engine.calls.values()
    assert call["params"].max_tokens == fake_engine.max_model_len - prompt_len
    # max_completion_tokens wins over max_tokens.
    fake_engine.calls.clear()
    r = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 9,
                                      "max_completion_tokens": 3})
    (call,) = fake_engine.calls.values()
    assert call["params"].max_tokens == 3
    assert r.json()["usage"]["completion_tokens"] == 3


async def test_sampling_fields_reach_the_engine(client: httpx.AsyncClient,
                                                fake_engine: FakeEngine) -> None:
    r = await client.post(COMPLETIONS, json={
        "prompt": "x", "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
        "min_p": 0.05, "seed": 3, "min_tokens": 2, "stop": "END", "stop_token_ids": [7],
        "ignore_eos": True, "repetition_penalty": 1.1, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "logprobs": 1, "user": "ignored"})
    assert r.status_code == 200, r.text
    (call,) = fake_engine.calls.values()
    p = call["params"]
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.7, 0.9, 5, 0.05, 3)
    assert (p.max_tokens, p.min_tokens, p.stop, p.stop_token_ids) == (8, 2, ["END"], [7])
    assert (p.ignore_eos, p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (
        True, 1.1, 0.5, -0.5)
    assert p.logprobs == 1 and p.n == 1
    fake_engine.calls.clear()
    await client.post(COMPLETIONS, json={"prompt": "x", "stop": ["a", "b"]})
    (call,) = fake_engine.calls.values()
    assert call["params"].stop == ["a", "b"]
    assert call["params"].temperature == 1.0 and call["params"].max_tokens == 16


@pytest.mark.parametrize("temperature,expected", [(1e-38, 0.0), (1e-300, 0.0), (9e-6, 0.0),
                                                  (1e-5, 1e-5), (0.5, 0.5)])
async def test_a_temperature_too_small_to_divide_by_samples_greedily(
        client: httpx.AsyncClient, fake_engine: FakeEngine, temperature: float,
        expected: float) -> None:
    """Below vLLM's sampling epsilon (1e-5) the logits divided by the temperature overflow
    float32 (a 1e-38 temperature gave token 0 every step); such a request is greedy."""
    r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2,
                                             "temperature": temperature})
    assert r.status_code == 200, r.text
    (call,) = fake_engine.calls.values()
    assert call["params"].temperature == expected


async def test_choice_seeds_wrap_within_int64(client: httpx.AsyncClient,
                                              fake_engine: FakeEngine) -> None:
    """Choice i's seed is ``seed + i``, kept in the engine core's 64-bit signed range."""
    r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "n": 3,
                                             "temperature": 0.5, "seed": 2**63 - 2})
    assert r.status_code == 200, r.text
    seeds = sorted(c["params"].seed for c in fake_engine.calls.values())
    assert seeds == [-(2**63), 2**63 - 2, 2**63 - 1]


async def test_stop_token_finish_reason(client: httpx.AsyncClient,
                                        fake_engine: FakeEngine) -> None:
    ids = fake_engine.tokenizer.encode("ab")
    third = fake_engine.expected_tokens(ids, None, 3)[2]
    r = await client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 10,
                                            "stop_token_ids": [third]})
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    # the stop token's text is left out; the token is counted
    assert choice["text"] == fake_engine.expected_text(ids, None, 2)
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("include_usage", [False, True])
async def test_completion_stream_sse(client: httpx.AsyncClient, fake_engine: FakeEngine,
                                     include_usage: bool) -> None:
    req = {"prompt": "Hello", "max_tokens": 4, "stream": True}
    if include_usage:
        req["stream_options"] = {"include_usage": True}
    r = await client.post(COMPLETIONS, json=req)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    ids = fake_engine.tokenizer.encode("Hello")
    text_chunks = [c for c in chunks if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in text_chunks) == \
        fake_engine.expected_text(ids, None, 4)
    assert len(text_chunks) == 4
    assert [c["choices"][0]["finish_reason"] for c in text_chunks] == [None] * 3 + ["length"]
    assert len({c["id"] for c in chunks}) == 1
    assert all(c["object"] == "text_completion" for c in chunks)
    if include_usage:
        assert all(c["usage"] is None for c in text_chunks)
        final = chunks[-1]
        assert final["choices"] == []
        assert final["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 4,
                                  "total_tokens": len(ids) + 4,
                                  "prompt_tokens_details": {"cached_tokens": 0}}
    else:
        assert all("usage" not in c for c in chunks)


async def test_chat_stream_sse(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    r = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 3, "stream": True,
                                      "n": 2, "seed": 1})
    events = parse_sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    prompt_ids = chat_prompt_ids(fake_engine, USER_HI)
    for index in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert "".join(c["delta"].get("content", "") for c in mine) == \
            fake_engine.expected_text(prompt_ids, 1 + index, 3)
        assert [c["finish_reason"] for c in mine][-1] == "length"
        assert all(c["finish_reason"] is None for c in mine[:-1])


async def test_stream_matches_non_stream(client: httpx.AsyncClient) -> None:
    req = {"messages": USER_HI, "max_tokens": 6, "seed": 5, "temperature": 0.8}
    full = (await client.post(CHAT, json=req)).json()["choices"][0]["message"]["content"]
    events = parse_sse((await client.post(CHAT, json={**req, "stream": True})).text)
    streamed = "".join(e["choices"][0]["delta"].get("content", "")
                       for e in events[:-1] if e["choices"])
    assert streamed == full


async def test_completion_logprobs(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 3, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    ids = fake_engine.tokenizer.encode("ab")
    toks = [fake_engine.tokenizer.decode([t]) for t in fake_engine.expected_tokens(ids, None, 3)]
    assert lp["tokens"] == toks
    assert lp["token_logprobs"] == [-0.25] * 3
    assert lp["text_offset"] == [0, 1, 2]
    assert all(len(t) == 2 and t[tok] == -0.25 for t, tok in zip(lp["top_logprobs"], toks))
    events = parse_sse((await client.post(COMPLETIONS, json={
        "prompt": "ab", "max_tokens": 3, "logprobs": 2, "stream": True})).text)
    streamed = [e["choices"][0]["logprobs"] for e in events[:-1]]
    assert [s["tokens"][0] for s in streamed] == toks
    assert [s["text_offset"][0] for s in streamed] == [0, 1, 2]


async def test_chat_logprobs(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    r = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 2, "logprobs": True,
                                      "top_logprobs": 2})
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    for entry in content:
        assert entry["logprob"] == -0.25
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["token"] == entry["token"]
    (call,) = fake_engine.calls.values()
    assert call["params"].logprobs == 2
    r = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 1})
    assert r.json()["choices"][0]["logprobs"] is None


async def test_kv_transfer_params_round_trip(client: httpx.AsyncClient,
                                             fake_engine: FakeEngine) -> None:
    sent = {"do_remote_decode": True, "do_remote_prefill": False, "unknown_extra": [1, {"a": 2}]}
    returned = {"received": sent, "remote_engine_id": "fake-engine"}
    for path, base in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER_HI})):
        fake_engine.calls.clear()
        r = await client.post(path, json={**base, "max_tokens": 2, "kv_transfer_params": sent})
        assert r.json()["kv_transfer_params"] == returned
        (call,) = fake_engine.calls.values()
        assert call["kv"] == sent
        for stream_options in (None, {"include_usage": True}):
            req = {**base, "max_tokens": 2, "kv_transfer_params": sent, "stream": True}
            if stream_options:
                req["stream_options"] = stream_options
            events = parse_sse((await client.post(path, json=req)).text)
            assert events[-1] == "[DONE]"
            assert events[-2]["kv_transfer_params"] == returned
            assert all("kv_transfer_params" not in e for e in events[:-2])


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_choices_after_the_first_wait_for_its_remote_kv_read(
        client: httpx.AsyncClient, fake_engine: FakeEngine, stream: bool) -> None:
    """A decode leg with n > 1: only choice 0 names the prefiller's lease (one reader per
    lease); the other choices go to the engine without params once choice 0 has its first
    output (its read put the prompt's KV in the prefix cache)."""
    sent = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
            "remote_block_ids": [3, 4, 5], "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_request_id": "cmpl-1", "tp_size": 1, "first_token_id": 7}
    fake_engine.gate = asyncio.Event()  # choice 0 "loads" until the gate opens
    body = {"prompt": "hi", "max_tokens": 2, "n": 3, "temperature": 1.0, "seed": 5,
            "stream": stream, "kv_transfer_params": sent}
    answer = asyncio.create_task(client.post(COMPLETIONS, json=body))
    await wait_until(lambda: fake_engine.calls)  # choice 0 reached the engine
    await asyncio.sleep(0.05)  # time for the others, which must wait for its first output
    (only,) = fake_engine.calls.values()
    assert only["kv"] == sent
    fake_engine.gate.set()
    r = await answer
    assert r.status_code == 200
    calls = list(fake_engine.calls.values())
    assert [c["kv"] for c in calls] == [sent, None, None]
    assert [c["params"].seed for c in calls] == [5, 6, 7]
    choices = (parse_sse(r.text)[:-1] if stream else r.json()["choices"])
    assert choices


async def test_engine_error_non_streaming(client: httpx.AsyncClient,
                                          fake_engine: FakeEngine) -> None:
    fake_engine.fail_reason = "KV transfer from the prefiller failed: handshake timed out"
    for path, base in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER_HI})):
        r = await client.post(path, json={**base, "max_tokens": 4})
        assert 500 <= r.status_code < 600
        err = r.json()["error"]
        assert err["message"] == fake_engine.fail_reason
        assert set(err) == {"message", "type", "param", "code"}


async def test_engine_error_streaming(client: httpx.AsyncClient,
                                      fake_engine: FakeEngine) -> None:
    fake_engine.fail_reason = "remote KV blocks are gone"
    fake_engine.fail_after = 2
    for path, base in ((COMPLETIONS, {"prompt": "hi"}), (CHAT, {"messages": USER_HI})):
        r = await client.post(path, json={**base, "max_tokens": 4, "stream": True})
        events = parse_sse(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["message"] == "remote KV blocks are gone"
        assert set(events[-2]) == {"error"}
        assert not any(e.get("choices") and e["choices"][0].get("finish_reason")
                       for e in events[:-2])


@pytest.mark.parametrize(("failure", "status", "type_"), [
    ("LEASE_REFUSED", 400, "BadRequestError"),
    ("INVALID_REFERENCE", 400, "BadRequestError"),
    ("TRANSPORT", 502, "upstream_error"),
    ("ENGINE_MISMATCH", 502, "upstream_error"),
    ("TIMEOUT", 503, "upstream_unavailable"),
])
async def test_failed_kv_load_status_names_who_failed(client: httpx.AsyncClient,
                                                      fake_engine: FakeEngine, failure: str,
                                                      status: int, type_: str) -> None:
    """A KV load that failed because of the relayed ``kv_transfer_params`` is the client's 400
    (naming the field and the reason); one the prefiller or the transport failed is a 502/503,
    as the proxy reports a failed upstream. The same body comes in-band when streaming."""
    from pdserve.types.outputs import KVLoadFailure

    kind = KVLoadFailure[failure]
    fake_engine.fail_reason = (f"KV cache load from the remote instance failed: {kind.value}: "
                               f"no (request x); kv_load_failure_policy is 'fail'")
    fake_engine.fail_kv_load = kind
    fake_engine.fail_after = 0
    body = {"prompt": "hi", "max_tokens": 4}
    r = await client.post(COMPLETIONS, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (type_, status)
    assert kind.value in err["message"]
    if status == 400:
        assert err["param"] == "kv_transfer_params" and "kv_transfer_params" in err["message"]
    events = parse_sse((await client.post(COMPLETIONS, json=dict(body, stream=True))).text)
    assert events[-1] == "[DONE]" and events[-2] == r.json()


async def test_engine_dead_is_503(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    fake_engine.dead = True
    r = await client.post(COMPLETIONS, json={"prompt": "hi"})
    assert r.status_code == 503
    assert r.json()["error"]["code"] == 503
    r = await client.post(COMPLETIONS, json={"prompt": "hi", "stream": True})
    events = parse_sse(r.text)
    assert events[-2]["error"]["code"] == 503 and events[-1] == "[DONE]"


async def test_models_endpoint(fake_engine: FakeEngine) -> None:
    from pdserve.entrypoints.server import build_app

    engine = FakeEngine(served_model_name="my-model")
    app = build_app(engine)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as c:
        body = (await c.get("/v1/models")).json()
        assert body["object"] == "list"
        assert [(m["id"], m["object"], m["max_model_len"]) for m in body["data"]] == [
            ("my-model", "model", engine.max_model_len)]
        r = await c.post(COMPLETIONS, json={"prompt": "x", "model": "fake-model"})
        assert r.status_code == 404
        r = await c.post(COMPLETIONS, json={"prompt": "x", "model": "my-model", "max_tokens": 1})
        assert r.status_code == 200
