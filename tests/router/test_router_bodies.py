"""Prefill-leg and decode-leg bodies (docs/architecture.md, "Request flow of one P/D turn") and the proxy's checks on client bodies."""

import copy

import pytest

from pdserve.types.openai_errors import MAX_QUOTED_CHARS, quoted
from pdserve.router.bodies import (MAX_CONVERSATION_ID_CHARS, PREFILL_KV_PARAMS,
                                   check_client_body, conversation_key, decode_leg_body,
                                   prefill_leg_body)
from pdserve.router.errors import ProxyError

CLIENT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 50,
          "max_completion_tokens": 50, "stream": True, "stream_options": {"include_usage": True},
          "min_tokens": 5, "n": 1, "temperature": 0.0, "conversation_id": "c1",
          "kv_transfer_params": {"client": "value"}}


def test_prefill_leg_body_is_one_token_non_streaming_with_stateless_params():
    before = copy.deepcopy(CLIENT)
    assert prefill_leg_body(CLIENT) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
        "max_completion_tokens": 1, "stream": False, "temperature": 0.0, "min_tokens": 1,
        "pdserve_decode_leg": {"max_tokens": 50, "max_completion_tokens": 50, "min_tokens": 5},
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None}}
    assert CLIENT == before


@pytest.mark.parametrize("min_tokens, leg", [(0, None), (1, 1), (7, 1), (None, None),
                                             ("5", None), (True, None), (-2, None)])
def test_prefill_leg_body_draws_its_token_under_min_tokens(min_tokens, leg):
    """P's one token is drawn as D's first one would be: with EOS and stop tokens masked when
    the client asked for at least one token; an invalid value is not sent as ``min_tokens``
    (P refuses it through the decode-leg field, as D would)."""
    body = {"model": "m", "prompt": "x", "max_tokens": 9}
    if min_tokens is not None:
        body["min_tokens"] = min_tokens
    out = prefill_leg_body(body)
    assert out.get("min_tokens") == leg
    assert out["pdserve_decode_leg"].get("min_tokens") == min_tokens


def test_prefill_leg_body_adds_max_completion_tokens_only_when_present():
    out = prefill_leg_body({"model": "m", "prompt": "x"})
    assert out["max_tokens"] == 1 and "max_completion_tokens" not in out and out["stream"] is False


def test_prefill_leg_body_merges_decoder_params_of_previous_turn():
    d_params = {"do_remote_decode": True, "do_remote_prefill": True, "remote_block_ids": [4, 5],
                "remote_num_tokens": 37, "remote_blocks_expiry_time": 1.7e9, "remote_host": "d",
                "remote_port": 5601, "remote_engine_id": "engine-d", "remote_request_id": "r1"}
    out = prefill_leg_body({"model": "m", "prompt": "x"}, d_params)
    assert out["kv_transfer_params"] == {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_block_ids": [4, 5],
        "remote_num_tokens": 37, "remote_blocks_expiry_time": 1.7e9, "remote_host": "d",
        "remote_port": 5601, "remote_engine_id": "engine-d", "remote_request_id": "r1"}
    assert PREFILL_KV_PARAMS["remote_block_ids"] is None  # the template is not modified


def test_decode_leg_body_is_client_body_plus_prefill_params():
    p_params = {"do_remote_prefill": True, "remote_block_ids": [1]}
    expected = dict(CLIENT, kv_transfer_params=p_params)
    del expected["conversation_id"]
    assert decode_leg_body(CLIENT, p_params) == expected
    no_params = decode_leg_body(CLIENT, None)
    assert "kv_transfer_params" not in no_params and "conversation_id" not in no_params


@pytest.mark.parametrize("body,status,param", [
    ([1, 2], 400, None), ({"n": 2}, 400, "n"), ({"best_of": 3}, 400, "best_of"),
    ({"n": 0}, 400, "n"), ({"n": "2"}, 400, "n"), ({"stream": "yes"}, 400, "stream"),
    ({"kv_transfer_params": [1]}, 400, "kv_transfer_params"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": False, "stream_options": {}}, 400, "stream_options"),
])
def test_check_client_body_refuses(body, status, param):
    with pytest.raises(ProxyError) as e:
        check_client_body(body)
    assert (e.value.status, e.value.param) == (status, param)


def test_check_client_body_accepts_stream_options_of_a_stream():
    check_client_body({"stream": True, "stream_options": {"include_usage": True}})


def test_check_client_body_accepts_n_1():
    check_client_body({"n": 1, "best_of": 1, "stream": False})


def test_conversation_key_body_then_header():
    assert conversation_key({"conversation_id": "a"}, "h") == "a"
    assert conversation_key({"conversation_id": 7}, None) == "7"
    assert conversation_key({}, "h") == "h"
    assert conversation_key({}, None) is None
    with pytest.raises(ProxyError) as e:
        conversation_key({"conversation_id": {"x": 1}}, None)
    assert e.value.status == 400 and e.value.param == "conversation_id"


def test_conversation_key_is_at_most_max_conversation_id_chars_long():
    n = MAX_CONVERSATION_ID_CHARS
    assert conversation_key({"conversation_id": "a" * n}, None) == "a" * n
    assert conversation_key({}, "h" * n) == "h" * n
    # the header is not the key when the body names one
    assert conversation_key({"conversation_id": "a"}, "h" * (n + 1)) == "a"
    for body, header, param in (({"conversation_id": "a" * (n + 1)}, None, "conversation_id"),
                                ({"conversation_id": 10 ** n}, None, "conversation_id"),
                                ({}, "h" * (n + 1), None)):
        with pytest.raises(ProxyError) as e:
            conversation_key(body, header)
        assert (e.value.status, e.value.param) == (400, param)
        assert f"{n + 1} characters long; at most {n} are allowed" in e.value.message


def test_an_empty_conversation_id_is_refused_and_an_empty_header_is_no_id():
    with pytest.raises(ProxyError) as e:
        conversation_key({"conversation_id": ""}, "h")
    assert (e.value.status, e.value.param) == (400, "conversation_id")
    assert e.value.message == "'conversation_id' must not be empty"
    assert conversation_key({}, "") is None
    assert conversation_key({"conversation_id": 123}, None) == conversation_key(
        {"conversation_id": "123"}, None) == "123"


def test_a_refused_value_is_quoted_short_in_the_message():
    """An error message quotes at most MAX_QUOTED_CHARS of the client's value and says its
    length: a megabyte-long field was sent back whole."""
    for body, param in (({"conversation_id": ["a" * 2_000_000]}, "conversation_id"),
                        ({"stream": "s" * 5_000_000}, "stream"),
                        ({"n": "n" * 1_000_000}, "n")):
        with pytest.raises(ProxyError) as e:
            check_client_body(body) if param != "conversation_id" else conversation_key(body, None)
        assert e.value.param == param
        assert len(e.value.message) < 200, e.value.message[:300]
        assert " characters)" in e.value.message
    assert quoted("short") == "'short'"
    long = quoted("x" * 1000)
    assert long == repr("x" * MAX_QUOTED_CHARS)[:MAX_QUOTED_CHARS] + "... (1,002 characters)"


def test_only_lists_of_prompts_are_refused_as_several_prompts():
    """A list of strings or of token lists is several prompts (refused); a malformed list is
    left to the engine, whose message says what a prompt may be."""
    for several in (["a", "b"], [[1, 2], [3]]):
        with pytest.raises(ProxyError) as err:
            check_client_body({"prompt": several})
        assert err.value.param == "prompt"
    for other in ([1.5, 2], ["a", 5], [1, 2, 3]):
        check_client_body({"prompt": other})
