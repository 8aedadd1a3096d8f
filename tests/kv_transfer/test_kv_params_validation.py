"""Front-end validation of ``kv_transfer_params``: a transfer this instance would perform with a
missing or mistyped field is a client error (ValueError -> HTTP 400 naming the field), while the
valid shapes of every P/D leg and unknown extra fields are accepted."""

from __future__ import annotations


import pytest

from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.kv_transfer.factory import validate_kv_transfer_params
from pdserve.types.remote_ref import KVTransferParamsError
from pdserve.types.kv_params import KVTransferParams, prefill_done_params
from pdserve.router.bodies import PREFILL_KV_PARAMS

CONSUMER = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_consumer"})
PRODUCER = KVTransferConfig.from_dict({"kv_connector": "NixlConnector", "kv_role": "kv_producer"})
PRODUCER_BIDI = KVTransferConfig.from_dict({
    "kv_connector": "NixlConnector", "kv_role": "kv_producer",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True},
})


def p_returned_params() -> dict:
    """What P returns for the D leg (the shape the NIXL scheduler side builds)."""
    return {
        "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p-engine",
        "remote_block_ids": [3, 4, 5], "remote_host": "127.0.0.1", "remote_port": 5600,
        "remote_request_id": "cmpl-1", "tp_size": 1,
    }


def d_returned_params() -> dict:
    """What a bidirectional D returns at the end of a turn (sent back to P by the router)."""
    return {
        "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": "d-engine",
        "remote_block_ids": [7, 8], "remote_num_tokens": 20,
        "remote_block_hashes": ["00000000000000ff", "0000000000000a0b"],
        "remote_blocks_expiry_time": 1_700_000_000.5, "remote_host": "127.0.0.1",
        "remote_port": 5601, "remote_request_id": "d-req", "tp_size": 1,
    }


# ------------------------------------------------------------------------------ valid shapes
@pytest.mark.parametrize("config", [CONSUMER, PRODUCER, PRODUCER_BIDI])
@pytest.mark.parametrize("params", [
    None,
    {},
    dict(PREFILL_KV_PARAMS),  # the router's stateless P leg: remote fields are null
    {"do_remote_decode": True, "do_remote_prefill": False},
    p_returned_params(),
    dict(p_returned_params(), unknown_extra=[1, {"a": 2}], remote_num_tokens=None),
    {"unknown_extra": "x", "remote_engine_id": 5},  # asks for no transfer: nothing to check
], ids=["none", "empty", "router-p-leg", "plain-p-leg", "d-leg", "d-leg-extra", "no-transfer"])
def test_valid_params_are_accepted(config, params):
    validate_kv_transfer_params(config, params)


def test_p_leg_with_decoder_fields_is_accepted():
    params = dict(PREFILL_KV_PARAMS)
    params.update(d_returned_params())
    params["another_unknown_field"] = {"nested": True}
    validate_kv_transfer_params(PRODUCER_BIDI, params)


def test_decoder_fields_are_not_checked_without_bidirectional():
    # this P never pulls, so it ignores D's fields however they look
    params = dict(d_returned_params(), remote_port="x", remote_request_id=None)
    validate_kv_transfer_params(PRODUCER, params)


# ------------------------------------------------------------------------- decoder leg (D)
REQUIRED = ["remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
            "remote_request_id"]


@pytest.mark.parametrize("field", REQUIRED)
@pytest.mark.parametrize("how", ["missing", "null"])
def test_d_leg_missing_field_names_it(field, how):
    params = p_returned_params()
    if how == "missing":
        del params[field]
    else:
        params[field] = None
    with pytest.raises(ValueError, match=field):
        validate_kv_transfer_params(CONSUMER, params)


@pytest.mark.parametrize("field,value", [
    ("remote_engine_id", 5),
    ("remote_host", ["127.0.0.1"]),
    ("remote_port", "x"),
    ("remote_port", True),
    ("remote_port", 5600.0),
    ("remote_port", 0),
    ("remote_port", 65536),
    ("remote_request_id", 17),
    ("remote_block_ids", "3,4,5"),
    ("remote_block_ids", [3, -1]),
    ("remote_block_ids", [3, "4"]),
    ("remote_block_ids", [3, 4.0]),
    ("remote_num_tokens", "20"),
    ("remote_block_hashes", "ff"),
    ("remote_blocks_expiry_time", "soon"),
    ("tp_size", 0),
    ("tp_size", "x"),
    ("tp_size", True),
])
def test_d_leg_wrong_type_names_it(field, value):
    params = dict(p_returned_params(), **{field: value})
    with pytest.raises(KVTransferParamsError, match=field):
        validate_kv_transfer_params(CONSUMER, params)


@pytest.mark.parametrize("block_ids", [[3, 4, 5], [[3, 4, 5]], [], [[]]],
                         ids=["flat", "per-group", "flat-empty", "per-group-empty"])
def test_block_ids_are_accepted_flat_and_per_kv_cache_group(block_ids):
    """vLLM's NixlConnector sends ``remote_block_ids`` per KV-cache group (a list of lists);
    the flat list of one group is accepted too, and both parse to the same blocks."""
    for config in (CONSUMER, PRODUCER_BIDI):
        validate_kv_transfer_params(config, dict(p_returned_params(), remote_block_ids=block_ids))
    parsed = KVTransferParams.parse(dict(p_returned_params(), remote_block_ids=block_ids))
    assert parsed.remote.block_ids == ([3, 4, 5] if block_ids in ([3, 4, 5], [[3, 4, 5]]) else [])


@pytest.mark.parametrize("block_ids", [[[3, -1]], [[3, "4"]], [[3], 4], [[3, True]], [[3.0]],
                                       [[[3]]]])
def test_bad_per_group_block_ids_name_the_field(block_ids):
    with pytest.raises(KVTransferParamsError, match="remote_block_ids"):
        validate_kv_transfer_params(CONSUMER, dict(p_returned_params(), remote_block_ids=block_ids))


@pytest.mark.parametrize("config", [CONSUMER, PRODUCER_BIDI])
@pytest.mark.parametrize("block_id", [2**31, 2**40, 10**30])
def test_block_ids_beyond_any_cache_are_refused_at_the_edge(config, block_id):
    """No cache has 2**31 blocks (block tables are int32): such an id is a 400 naming the field,
    not a failed load (or, beyond 64 bits, a crash while handing the request to the engine)."""
    params = p_returned_params() if config is CONSUMER else dict(PREFILL_KV_PARAMS,
                                                                 **d_returned_params())
    params["remote_block_ids"] = [[3, block_id]]
    with pytest.raises(KVTransferParamsError, match="remote_block_ids: block id .* out of range"):
        validate_kv_transfer_params(config, params)
    params["remote_block_ids"] = [[3, 2**31 - 1]]  # the largest id an int32 table holds
    validate_kv_transfer_params(config, params)


@pytest.mark.parametrize("leg", ["decode", "bidirectional-prefill"])
def test_params_naming_this_instance_itself_are_refused(leg):
    """Params that name this instance's own KV (its own returned params sent back to it) are a
    client error, not a failed transfer."""
    from pdserve.types.kv_params import parse_request_params
    config, params = ((CONSUMER, p_returned_params()) if leg == "decode"
                      else (PRODUCER_BIDI, dict(PREFILL_KV_PARAMS, **d_returned_params())))
    parse_request_params(params, config, None)  # another instance's KV: fine
    params["remote_engine_id"] = config.engine_id
    with pytest.raises(KVTransferParamsError, match="remote_engine_id .* this instance itself"):
        parse_request_params(params, config, None)
    # a prefill leg without bidirectional pulls ignores the decoder fields, its own id included
    parse_request_params({**PREFILL_KV_PARAMS, **d_returned_params(),
                          "remote_engine_id": PRODUCER.engine_id}, PRODUCER, None)


def test_integers_beyond_64_bits_are_refused_without_a_connector_too():
    from pdserve.types.kv_params import parse_request_params

    for raw in ({"unknown_extra": 10**30}, dict(p_returned_params(), remote_num_tokens=2**70)):
        with pytest.raises(KVTransferParamsError, match="out"):
            parse_request_params(raw, CONSUMER, None)
    with pytest.raises(KVTransferParamsError, match="64-bit"):
        parse_request_params({"unknown_extra": [10**30]}, None, None)


@pytest.mark.parametrize("bad", [
    {"do_remote_prefill": "yes"},
    dict(p_returned_params(), remote_port="5600"),
    dict(p_returned_params(), remote_block_ids=[[3, -1]]),
    {k: v for k, v in p_returned_params().items() if k != "remote_request_id"},
    dict(p_returned_params(), first_token_id=-1),
    dict(p_returned_params(), first_token_id=500),  # outside the vocabulary below
    # hosts ZMQ refuses (the engine thread connects to them): a 400, not a dead engine core
    *(dict(p_returned_params(), remote_host=host)
      for host in ("not a host!!", " ", "a b", "*", "127.0.0.1\n", "::1", "-a.b", "a..b",
                   "x" * 254, "")),
])
def test_malformed_params_are_refused_without_a_connector_too(bad):
    """The edge parses the params the same way whether or not a connector is configured."""
    from pdserve.types.kv_params import parse_request_params

    with pytest.raises(KVTransferParamsError, match="kv_transfer_params"):
        parse_request_params(bad, CONSUMER, 100)
    with pytest.raises(KVTransferParamsError, match="kv_transfer_params"):
        parse_request_params(bad, None, 100)


def test_well_formed_params_without_a_connector_are_accepted():
    """vLLM ignores kv_transfer_params without a connector; so does pdserve (no transfer)."""
    from pdserve.types.kv_params import KVRole, parse_request_params

    for raw in (p_returned_params(), PREFILL_KV_PARAMS, dict(PREFILL_KV_PARAMS,
                                                             **d_returned_params())):
        assert parse_request_params(raw, None, 100) is not None
    for host in ("localhost", "10.0.0.1", "p-0.pd.example.com", "a" * 63):
        assert parse_request_params(dict(p_returned_params(), remote_host=host), None, 100)
    assert parse_request_params(p_returned_params(), None, 100).role is KVRole.DECODE


def test_several_kv_cache_groups_are_refused_clearly():
    with pytest.raises(KVTransferParamsError, match="2 KV-cache groups"):
        validate_kv_transfer_params(CONSUMER, dict(p_returned_params(),
                                                   remote_block_ids=[[3, 4], [5, 6]]))


def test_returned_block_ids_are_per_kv_cache_group():
    returned = prefill_done_params("p", [7, 3, 9], "h", 1, "r", 5)
    assert returned["remote_block_ids"] == [[7, 3, 9]]
    assert KVTransferParams.parse(returned).remote.block_ids == [7, 3, 9]


def test_user_reported_request_is_rejected():
    params = {"do_remote_prefill": True, "remote_block_ids": [999999], "remote_engine_id": "x",
              "remote_host": "127.0.0.1", "remote_port": 1}
    with pytest.raises(ValueError, match="remote_request_id"):
        validate_kv_transfer_params(CONSUMER, params)


@pytest.mark.parametrize("flag", ["do_remote_prefill", "do_remote_decode"])
@pytest.mark.parametrize("value", ["true", 1, "false"])
def test_non_boolean_flags_are_rejected(flag, value):
    with pytest.raises(KVTransferParamsError, match=flag):
        validate_kv_transfer_params(CONSUMER, {flag: value})


# ----------------------------------------------------------- bidirectional pull on P (P leg)
@pytest.mark.parametrize("field", REQUIRED)
def test_p_leg_partial_decoder_fields_name_the_missing_one(field):
    params = dict(PREFILL_KV_PARAMS)
    params.update(d_returned_params())
    params[field] = None
    with pytest.raises(ValueError, match=field):
        validate_kv_transfer_params(PRODUCER_BIDI, params)


@pytest.mark.parametrize("field,value", [
    ("remote_engine_id", 5), ("remote_port", "x"), ("remote_block_ids", [-2]),
    ("remote_block_hashes", ["not-hex"]), ("remote_blocks_expiry_time", "later"),
])
def test_p_leg_mistyped_decoder_field_names_it(field, value):
    params = dict(d_returned_params(), **{field: value})
    with pytest.raises(ValueError, match=field):
        validate_kv_transfer_params(PRODUCER_BIDI, params)


# ------------------------------------------------------------------- through a real server
@pytest.fixture(scope="module")
def decoder(server_pool):
    """The session's shared NIXL decoder ``d_fail``."""
    return server_pool.get("d_fail")["d_fail"]


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("bad,field", [
    ({}, "remote_request_id"),  # the user-reported request
    ({"remote_request_id": "r", "remote_engine_id": 5}, "remote_engine_id"),
    ({"remote_request_id": "r", "remote_port": "x"}, "remote_port"),
    ({"remote_request_id": "r", "remote_block_ids": [[2**40]]}, "remote_block_ids"),
    ({"remote_request_id": "r", "remote_block_ids": [[10**30]]}, "remote_block_ids"),
])
def test_server_answers_400_naming_the_field(decoder, endpoint, stream, bad, field):
    params = {"do_remote_prefill": True, "remote_block_ids": [999999], "remote_engine_id": "x",
              "remote_host": "127.0.0.1", "remote_port": 1, **bad}
    body = {"model": decoder_model(decoder), "max_tokens": 4, "stream": stream,
            "kv_transfer_params": params}
    if endpoint == "completions":
        body["prompt"] = "hello there"
    else:
        body["messages"] = [{"role": "user", "content": "hello there"}]
    failed_before = decoder.metrics().get("pdserve:nixl_num_failed_transfers", 0.0)
    r = decoder.client.post(f"/v1/{endpoint}", json=body)
    # streaming too: the server checks the params before it starts the event stream
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and err["type"] == "BadRequestError", err
    # nothing reached the core: no failed KV load, and a valid request still works
    assert decoder.metrics().get("pdserve:nixl_num_failed_transfers", 0.0) == failed_before
    ok = decoder.client.post(f"/v1/{endpoint}", json=dict(
        body, stream=False, kv_transfer_params={"unknown_extra": {"a": [1]}}))
    assert ok.status_code == 200, ok.text


def decoder_model(server) -> str:
    return server.client.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("sampling, usable", [
    ({}, True),
    ({"min_tokens": 3, "temperature": 0.0}, True),  # greedy: the unmasked argmax, if allowed
    ({"min_tokens": 3, "temperature": 0.7}, True),  # unseeded, untruncated: rejection sampling
    ({"min_tokens": 3, "temperature": 0.7, "seed": 1}, False),  # other noise than D's draw
    ({"min_tokens": 3, "temperature": 0.7, "top_p": 0.9}, False),  # another nucleus
    ({"min_tokens": 3, "temperature": 0.7, "top_k": 5}, False),
    ({"min_tokens": 3, "temperature": 0.7, "min_p": 0.1}, False),
    ({"temperature": 0.7, "seed": 1, "top_p": 0.9}, True),  # no min_tokens: P drew as D would
    ({"logprobs": 1}, False),
    ({"n": 2}, False),
])
def test_a_decoder_starts_from_the_prefillers_token_when_its_draw_is_d_s_own(sampling, usable):
    from pdserve.types.kv_params import may_use_first_token
    from pdserve.types.request import Request
    from pdserve.types.sampling_params import SamplingParams

    params = KVTransferParams.parse(dict(p_returned_params(), first_token_id=5))
    req = Request(request_id="r", prompt_token_ids=[1, 2, 3],
                  sampling_params=SamplingParams(**sampling), eos_token_id=2,
                  kv_transfer_params=params)
    assert may_use_first_token(req) is usable
