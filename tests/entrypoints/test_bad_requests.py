"""Bad input gets an OpenAI-style 4xx body (never a 500) and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest
from tests.support.fake_engine_for_server import FakeEngine

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]


def assert_openai_error(r: httpx.Response, status: int, type_: str, param: str | None = None,
                        message_has: str | None = None) -> None:
    """vLLM's ``ErrorResponse`` shape: ``code`` is the HTTP status, an integer."""
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == type_
    assert err["param"] == param
    assert err["code"] == status and type(err["code"]) is int
    if message_has is not None:
        assert message_has in err["message"], err["message"]


# (endpoint, JSON body, expected param, substring of the message)
BAD_BODIES = [
    (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature", "number"),
    (COMPLETIONS, {"prompt": "x", "temperature": -0.5}, "temperature", None),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p", None),
    (COMPLETIONS, {"prompt": "x", "top_k": -2}, "top_k", None),
    # beyond int64: the engine core's sampler failed on it (and the core with it)
    (COMPLETIONS, {"prompt": "x", "top_k": 2**63, "temperature": 0.5}, "top_k", None),
    (CHAT, {"messages": USER_HI, "top_k": 2**64, "temperature": 0.5}, "top_k", None),
    (COMPLETIONS, {"prompt": "x", "min_p": 1.5}, "min_p", None),
    (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, "max_tokens", None),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens", None),
    (COMPLETIONS, {"prompt": "x", "max_tokens": "ten"}, "max_tokens", None),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, "max_tokens", None),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n", None),
    (COMPLETIONS, {"prompt": "x", "n": True}, "n", None),
    (COMPLETIONS, {"prompt": "x", "seed": "abc"}, "seed", None),
    (COMPLETIONS, {"prompt": "x", "seed": 2**70}, "seed", None),  # beyond int64 (500 before)
    (COMPLETIONS, {"prompt": "x", "seed": -(2**63) - 1}, "seed", None),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty", None),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty", None),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", None),
    (COMPLETIONS, {"prompt": "x", "logprobs": -1}, "logprobs", None),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs", None),
    (COMPLETIONS, {"prompt": "x", "stop": 5}, "stop", None),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids", None),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [2**64]}, "stop_token_ids", None),
    (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream", None),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options",
     None),
    (COMPLETIONS, {"prompt": "x", "stream_options": {"include_usage": True}}, None,
     "Stream options can only be defined when `stream=True`"),
    (CHAT, {"messages": USER_HI, "stream": False, "stream_options": {"include_usage": False}},
     None, "Stream options can only be defined when `stream=True`"),
    (COMPLETIONS, {"prompt": "x", "kv_transfer_params": [1, 2]}, "kv_transfer_params", None),
    (COMPLETIONS, {"prompt": "x", "echo": True}, "echo", "echo"),
    (CHAT, {"messages": USER_HI, "echo": True}, "echo", "echo"),
    (CHAT, {"messages": USER_HI, "echo": "x"}, "echo", None),
    (COMPLETIONS, {"prompt": "x", "skip_special_tokens": False}, "skip_special_tokens",
     "skip_special_tokens"),
    (CHAT, {"messages": USER_HI, "skip_special_tokens": "x"}, "skip_special_tokens", None),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 100}, "truncate_prompt_tokens",
     "truncate_prompt_tokens"),
    (COMPLETIONS, {"prompt": 5}, "prompt", "prompt must be"),
    (COMPLETIONS, {"prompt": [1, "a"]}, "prompt", "prompt must be"),
    (COMPLETIONS, {"prompt": [True]}, "prompt", "prompt must be"),
    (COMPLETIONS, {}, "prompt", "required"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 5, "min_tokens": 6}, "min_tokens", "min_tokens"),
    (CHAT, {"messages": []}, "messages", "empty"),
    (CHAT, {"messages": "hi"}, "messages", None),
    (CHAT, {}, "messages", "required"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", None),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages",
     "text"),
    (CHAT, {"messages": USER_HI, "logprobs": 3}, "logprobs", None),
    (CHAT, {"messages": USER_HI, "top_logprobs": 2}, None, "logprobs"),
    (CHAT, {"messages": USER_HI, "max_completion_tokens": 0}, "max_completion_tokens", None),
]


@pytest.mark.parametrize("path,body,param,message_has", BAD_BODIES,
                         ids=[f"{p.rsplit('/', 1)[-1]}:{b}" for p, b, _, _ in BAD_BODIES])
async def test_bad_field_is_400(client: httpx.AsyncClient, fake_engine: FakeEngine, path: str,
                                body: dict, param: str | None, message_has: str | None) -> None:
    r = await client.post(path, json=body)
    assert_openai_error(r, 400, "BadRequestError", param=param, message_has=message_has)
    assert fake_engine.calls == {}, "an invalid request must not reach the engine"
    # The server keeps serving.
    ok = await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("raw", [b'{"prompt": ', b"not json", b'{"prompt": "x",}'])
async def test_malformed_json_is_400(client: httpx.AsyncClient, raw: bytes) -> None:
    r = await client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "BadRequestError", message_has="JSON")


async def test_json_nested_too_deeply_is_400_saying_so(client: httpx.AsyncClient) -> None:
    """json's decoder recurses once per level: a body nested past the interpreter's limit is a
    400 that says why, in the proxy's words (tests/router/test_router_errors.py), and the
    server keeps serving."""
    raw = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for path in (COMPLETIONS, CHAT):
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        assert_openai_error(r, 400, "BadRequestError", message_has="nested too deeply")
    ok = await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/json"])
async def test_non_json_body_is_the_same_400_as_any_other(client: httpx.AsyncClient,
                                                          content_type: str | None) -> None:
    """A body that is not JSON, whatever its content type, is a 400 ``BadRequestError`` of the
    one error shape (the proxy answers it alike: tests/router/test_router_errors.py)."""
    headers = {"content-type": content_type} if content_type else {}
    for path in (COMPLETIONS, CHAT):
        r = await client.post(path, content=b"not json", headers=headers)
        assert_openai_error(r, 400, "BadRequestError", message_has="JSON")


@pytest.mark.parametrize("params", [
    {"do_remote_prefill": 1},
    {"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h",
     "remote_port": 5600, "remote_request_id": "r", "remote_block_ids": ["3"]},
    {"do_remote_prefill": True, "remote_engine_id": "p"},
])
async def test_malformed_kv_transfer_params_are_400_without_a_connector(
        client: httpx.AsyncClient, fake_engine: FakeEngine, params: dict) -> None:
    """The fake engine has no KV connector: malformed params are still refused at the edge."""
    assert fake_engine.config.kv_transfer_config is None
    r = await client.post(COMPLETIONS, json={"prompt": "x", "kv_transfer_params": params})
    assert_openai_error(r, 400, "BadRequestError", param="kv_transfer_params",
                        message_has="kv_transfer_params")
    assert fake_engine.calls == {}


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"a string"', b"17"])
async def test_body_not_an_object_is_400(client: httpx.AsyncClient, raw: bytes) -> None:
    r = await client.post(CHAT, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "BadRequestError", message_has="JSON object")


@pytest.mark.parametrize("raw,param", [(b'{"prompt": "x", "temperature": NaN}', "temperature"),
                                       (b'{"prompt": "x", "repetition_penalty": Infinity}',
                                        "repetition_penalty")])
async def test_non_finite_floats_are_400(client: httpx.AsyncClient, fake_engine: FakeEngine,
                                         raw: bytes, param: str) -> None:
    """Python's JSON reader accepts NaN and Infinity: such a sampling value is refused as not
    finite (not, e.g., as above a bound it is not above)."""
    r = await client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400, "BadRequestError", param=param, message_has="finite")
    assert fake_engine.calls == {}


async def test_whole_request_check_is_400_with_its_own_message(client: httpx.AsyncClient) -> None:
    """A check across fields (a model validator, no field location) says what is wrong, not
    that the body is not a JSON object."""
    r = await client.post(CHAT, json={"messages": USER_HI, "top_logprobs": 2})
    assert_openai_error(r, 400, "BadRequestError")
    assert r.json()["error"]["message"] == "top_logprobs requires logprobs=true"


async def test_unknown_model_is_404(client: httpx.AsyncClient) -> None:
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": USER_HI})):
        r = await client.post(path, json={**body, "model": "gpt-17"})
        assert_openai_error(r, 404, "NotFoundError", param="model", message_has="gpt-17")
    # a megabyte-long name is not sent back whole
    r = await client.post(CHAT, json={"messages": USER_HI, "model": "m" * 1_000_000})
    assert_openai_error(r, 404, "NotFoundError", param="model", message_has="characters)")
    assert len(r.content) < 1000


async def test_served_model_name_is_accepted(client: httpx.AsyncClient) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": "x", "model": "fake-model",
                                            "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("prompt", ["", [], [[]], ["a", ""]])
async def test_empty_prompt_is_400(client: httpx.AsyncClient, prompt: object) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": prompt})
    assert_openai_error(r, 400, "BadRequestError", param="prompt", message_has="empty")


async def test_prompt_longer_than_max_model_len_is_400(client: httpx.AsyncClient,
                                                      fake_engine: FakeEngine) -> None:
    too_long = "x" * fake_engine.max_model_len
    r = await client.post(COMPLETIONS, json={"prompt": too_long, "max_tokens": 1})
    assert_openai_error(r, 400, "BadRequestError", param="prompt",
                        message_has=str(fake_engine.max_model_len))
    r = await client.post(COMPLETIONS, json={"prompt": [5] * (fake_engine.max_model_len + 3)})
    assert_openai_error(r, 400, "BadRequestError", param="prompt")
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": too_long}]})
    assert_openai_error(r, 400, "BadRequestError", param="messages")


async def test_text_no_tokenization_fits_is_refused_before_tokenizing(
        client: httpx.AsyncClient, fake_engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """A text longer than any tokenization that fits in max_model_len is a 400 before the one
    tokenizer thread spends time on it (a 60 MB prompt held every other request for a minute)."""
    from pdserve.model_files.tokenizer import max_prompt_chars

    calls = []
    encode = fake_engine.tokenizer.encode
    monkeypatch.setattr(fake_engine.tokenizer, "encode",
                        lambda *a, **kw: calls.append(1) or encode(*a, **kw))
    bound = max_prompt_chars(fake_engine.tokenizer, fake_engine.max_model_len)
    assert bound >= fake_engine.max_model_len
    r = await client.post(COMPLETIONS, json={"prompt": "x" * (bound + 1), "max_tokens": 1})
    assert_openai_error(r, 400, "BadRequestError", param="prompt", message_has="characters")
    assert calls == []
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "x" * bound},
                                                   {"role": "assistant", "content": "y"},
                                                   {"role": "user", "content": "z"}]})
    assert_openai_error(r, 400, "BadRequestError", param="messages", message_has="characters")
    r = await client.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert calls == [1]


async def test_prompt_plus_max_tokens_too_long_is_400(client: httpx.AsyncClient,
                                                     fake_engine: FakeEngine) -> None:
    prompt = "x" * 10
    room = fake_engine.max_model_len - 10
    r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": room + 1})
    assert_openai_error(r, 400, "BadRequestError", param="max_tokens")
    r = await client.post(COMPLETIONS, json={"prompt": prompt, "max_tokens": room})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == room


async def test_token_id_outside_vocabulary_is_400(client: httpx.AsyncClient,
                                                 fake_engine: FakeEngine) -> None:
    vocab = fake_engine.model_info.vocab_size
    for bad in ([1, vocab], [-1, 2]):
        r = await client.post(COMPLETIONS, json={"prompt": bad})
        assert_openai_error(r, 400, "BadRequestError", param="prompt")


async def test_chat_template_failure_is_400(client: httpx.AsyncClient,
                                            fake_engine: FakeEngine) -> None:
    fake_engine.tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    r = await client.post(CHAT, json={"messages": USER_HI})
    assert_openai_error(r, 400, "BadRequestError", param="messages",
                        message_has="roles must alternate")
    fake_engine.tokenizer.chat_template = None
    r = await client.post(CHAT, json={"messages": USER_HI})
    assert_openai_error(r, 400, "BadRequestError", param="messages",
                        message_has="no chat template")


async def test_unknown_route_and_method_use_openai_body(client: httpx.AsyncClient) -> None:
    assert_openai_error(await client.get("/v1/nothing"), 404, "NotFoundError")
    assert_openai_error(await client.get(COMPLETIONS), 405, "MethodNotAllowedError")


async def test_unknown_fields_are_ignored(client: httpx.AsyncClient,
                                          fake_engine: FakeEngine) -> None:
    r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "user": "me",
                                            "frobnicate": {"a": 1}, "suffix": None})
    assert r.status_code == 200, r.text
    r = await client.post(CHAT, json={"messages": [{"role": "user", "content": "hi",
                                                    "name": "bob"}],
                                      "max_tokens": 2, "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    assert len(fake_engine.calls) == 2


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,extra,param", [
    (CHAT, {"tools": [TOOL]}, "tools"),
    (CHAT, {"tools": [TOOL], "tool_choice": "auto"}, "tools"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"),
    (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"function_call": "auto"}, "function_call"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    (COMPLETIONS, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"logit_bias": {"50": -100}}, "logit_bias"),
    (COMPLETIONS, {"logit_bias": {"50": 5}}, "logit_bias"),
    (COMPLETIONS, {"suffix": "x"}, "suffix"),
    (COMPLETIONS, {"prompt_logprobs": 5}, "prompt_logprobs"),
    (CHAT, {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    (CHAT, {"guided_choice": ["yes", "no"]}, "guided_choice"),
    (CHAT, {"guided_json": {"type": "object"}}, "guided_json"),
    (COMPLETIONS, {"guided_regex": "[0-9]+"}, "guided_regex"),
    (COMPLETIONS, {"guided_grammar": "root ::= 'a'"}, "guided_grammar"),
    (CHAT, {"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
    (CHAT, {"allowed_token_ids": [5]}, "allowed_token_ids"),
    (COMPLETIONS, {"allowed_token_ids": []}, "allowed_token_ids"),
    (CHAT, {"bad_words": ["the"]}, "bad_words"),
    (COMPLETIONS, {"logits_processors": ["x"]}, "logits_processors"),
    (COMPLETIONS, {"use_beam_search": True}, "use_beam_search"),
    (CHAT, {"chat_template": "{% for %}"}, "chat_template"),
    (CHAT, {"messages": [{"role": "user"}]}, "messages"),
    (CHAT, {"messages": [{"role": "system", "content": None}, *USER_HI]}, "messages"),
])
async def test_unsupported_fields_are_400_not_ignored(client: httpx.AsyncClient,
                                                      fake_engine: FakeEngine, path: str,
                                                      extra: dict, param: str) -> None:
    """Fields pdserve does not implement would change the answer if honoured: a 400 naming
    the field, before the engine sees the request."""
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": USER_HI}
    r = await client.post(path, json={**base, "max_tokens": 2, **extra})
    assert_openai_error(r, 400, "BadRequestError", param=param)
    assert "not supported" in r.json()["error"]["message"] or "needs 'content'" in \
        r.json()["error"]["message"]
    assert fake_engine.calls == {}


@pytest.mark.parametrize("path,body,param", [
    (COMPLETIONS, '{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "x\\udfff"], "max_tokens": 2}', "prompt"),
    (CHAT, '{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}', "messages"),
    (CHAT, '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
     "messages"),
])
async def test_lone_surrogates_are_400(client: httpx.AsyncClient, fake_engine: FakeEngine,
                                       path: str, body: str, param: str) -> None:
    """A JSON escape of half a UTF-16 pair decodes to text the tokenizer refuses (a 500 before):
    a 400 naming the field, before the engine sees the request."""
    r = await client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400, "BadRequestError", param=param, message_has="not valid Unicode")
    assert fake_engine.calls == {}


async def test_unsupported_fields_in_the_forms_that_ask_nothing_are_accepted(
        client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    none = {"tools": [], "tool_choice": "none", "function_call": "none", "logit_bias": {},
            "response_format": {"type": "text"}, "functions": None, "echo": False,
            "skip_special_tokens": True, "truncate_prompt_tokens": None, "bad_words": [],
            "logits_processors": None, "use_beam_search": False, "guided_json": None,
            "chat_template": None}
    r = await client.post(CHAT, json={"messages": [*USER_HI, {"role": "assistant"}],
                                      "max_tokens": 2, **none})
    assert r.status_code == 200, r.text
    r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "logit_bias": None,
                                             "response_format": {"type": "text"}, "suffix": "",
                                             "include_stop_str_in_output": False})
    assert r.status_code == 200, r.text


async def test_null_means_the_default(client: httpx.AsyncClient, fake_engine: FakeEngine) -> None:
    """OpenAI's and vLLM's servers take ``"n": null`` and ``"stream": null`` as their defaults."""
    r = await client.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 2, "n": None,
                                             "stream": None, "min_tokens": None,
                                             "ignore_eos": None, "echo": None,
                                             "skip_special_tokens": None})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1
    r = await client.post(CHAT, json={"messages": USER_HI, "max_tokens": 2, "n": None,
                                      "stream": None, "add_generation_prompt": None})
    assert r.status_code == 200, r.text


async def test_a_json_object_sent_as_text_is_told_the_content_type(client: httpx.AsyncClient,
                                                                  fake_engine: FakeEngine) -> None:
    """A JSON object under ``Content-Type: text/plain`` is not read as JSON: the 400 says
    which content type to send instead of calling the object no object."""
    r = await client.post(COMPLETIONS, content=json.dumps({"prompt": "x", "max_tokens": 2}),
                          headers={"content-type": "text/plain; charset=utf-8"})
    assert_openai_error(r, 400, "BadRequestError", message_has="Content-Type: application/json")
    assert "'text/plain'" in r.json()["error"]["message"]
    assert fake_engine.calls == {}


# A proxied prefill leg: max_tokens 1 and no min_tokens, the client's limits beside them.
P_LEG = {"kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
         "max_tokens": 1}


@pytest.mark.parametrize("endpoint,limits,param", [
    (COMPLETIONS, {"max_tokens": 60}, "max_tokens"),
    (CHAT, {"max_completion_tokens": 60}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
    (CHAT, {"max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    (COMPLETIONS, {"min_tokens": 17}, "min_tokens"),  # completions' default max_tokens is 16
])
async def test_prefill_leg_is_refused_as_its_decode_leg_would_be(
        client: httpx.AsyncClient, fake_engine: FakeEngine, endpoint: str, limits: dict,
        param: str | None) -> None:
    prompt = {"prompt": "x" * 10} if endpoint == COMPLETIONS else \
        {"messages": [{"role": "user", "content": "x" * 10}]}
    decode_leg = {**prompt, **limits}
    d = await client.post(endpoint, json=decode_leg)  # what D answers
    assert d.status_code == 400, d.text
    r = await client.post(endpoint, json={**prompt, **P_LEG, "pdserve_decode_leg": limits})
    assert_openai_error(r, 400, "BadRequestError", param=param)
    assert r.json() == d.json()  # the same 400 as D
    assert fake_engine.calls == {}  # nothing was prefilled


@pytest.mark.parametrize("min_tokens", [3, None])
async def test_prefill_leg_within_the_decode_limits_runs(client: httpx.AsyncClient,
                                                         fake_engine: FakeEngine,
                                                         min_tokens: int | None) -> None:
    """Limits D accepts pass P's check: ``min_tokens: null`` is the default there as in the
    request models."""
    r = await client.post(COMPLETIONS, json={"prompt": "x" * 10, **P_LEG,
                                             "pdserve_decode_leg": {"max_tokens": 20,
                                                                    "min_tokens": min_tokens}})
    assert r.status_code == 200, r.text
    assert len(fake_engine.calls) == 1


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_over_the_limit_is_413_before_parsing(fake_engine: FakeEngine,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         chunked: bool) -> None:
    """The engine server refuses a body over the limit (64 MiB, as the proxy) with a 413, whether
    it declares its length or arrives chunked; bodies within the limit are served as before."""
    import pdserve.entrypoints.server as server_module
    from pdserve.entrypoints.server import build_app

    monkeypatch.setattr(server_module, "MAX_BODY_BYTES", 2000)
    app = build_app(fake_engine)

    def body(prompt: str):
        data = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
        if not chunked:
            return {"content": data}

        async def pieces():
            for i in range(0, len(data), 300):
                yield data[i:i + 300]
        return {"content": pieces()}

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://testserver") as c:
        r = await c.post(COMPLETIONS, headers={"content-type": "application/json"},
                         **body("x" * 2500))
        assert_openai_error(r, 413, "RequestTooLargeError", message_has="2000 bytes")
        r = await c.post(COMPLETIONS, headers={"content-type": "application/json"},
                         **body("hello"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 1
