"""End to end: ``pdserve serve`` prefiller (P) and decoder (D) processes with NIXL between them.

The test plays the proxy: it sends the P leg (``max_tokens=1``, ``do_remote_decode``) and then
the D leg with P's ``kv_transfer_params``, and compares D's greedy output with a single instance
given the same request. Metrics prove that the KV really moved (transfers > 0, at most one prompt
token computed on D) and that P's blocks are all free again afterwards.
"""

from __future__ import annotations

import concurrent.futures
import random
import threading

import pytest

from tests.support.servers import BLOCK_SIZE as B
from tests.support.servers import POOL_COMMON as COMMON
from tests.support.servers import SHORT_LEASE_S
from tests.support.servers import EngineServer as Server
from tests.support.ports import free_port
from tests.support.servers import decode_leg, generate, nixl_config, prefill_leg, start_all

from pdserve.types import prompt_handoff

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(server_pool):
    """The session's shared instances: ``single`` (the oracle), ``p``, ``p_short`` (a short
    lease), ``d_fail`` and ``d_rec`` (``recompute`` policy, one sequence at a time)."""
    servers = server_pool.get("single", "p", "p_short", "d_fail", "d_rec")
    return {**servers, "model": server_pool.model}


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def completion_body(cluster, prompt, stream: bool, max_tokens: int = 8) -> dict:
    return {"model": cluster["model"], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}


def chat_body(cluster, text: str, stream: bool, max_tokens: int = 8) -> dict:
    return {"model": cluster["model"], "messages": [{"role": "user", "content": text}],
            "max_tokens": max_tokens, "temperature": 0, "stream": stream}


def reference(cluster, endpoint: str, body: dict) -> str:
    out = generate(cluster["single"], endpoint, dict(body, stream=False))
    assert out["status"] == 200, out
    return out["text"]


def counters(m: dict[str, float]) -> dict[str, float]:
    return {
        "xfers": m.get("pdserve:nixl_xfer_time_seconds_count", 0.0),
        "computed": m.get("pdserve:prompt_tokens_computed_total", 0.0),
        "transferred": m.get("pdserve:prompt_tokens_transferred_total", 0.0),
        "failed": m.get("pdserve:nixl_num_failed_transfers", 0.0),
        "expired": m.get("pdserve:nixl_num_kv_expired_reqs", 0.0),
        "requests": m.get("pdserve:request_success_total", 0.0),
    }


# --------------------------------------------------------------------------------- correctness
@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("length", [1, B - 1, B, B + 1, 2 * B + 1, 300])
def test_completions_equal_single_instance(cluster, length, stream):
    p, d = cluster["p"], cluster["d_fail"]
    body = completion_body(cluster, token_prompt(length, seed=length * 10 + stream), stream)
    expected = reference(cluster, "completions", body)
    before = counters(d.metrics())
    params = prefill_leg(p, "completions", body)
    assert params["remote_host"] == "127.0.0.1" and params["remote_port"] == p.side_channel_port
    assert len(params["remote_block_ids"][0]) == -(-length // B)  # one KV-cache group
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200, out
    assert out["text"] == expected
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    # P's first token comes with its params: D reads the whole prompt and computes none of it
    assert isinstance(params["first_token_id"], int)
    assert after["computed"] - before["computed"] == 0
    assert after["transferred"] - before["transferred"] == length
    assert after["xfers"] > before["xfers"]
    p.wait_all_blocks_free(timeout_s=10)  # read done (or released) -> P's lease ends at once


@pytest.mark.parametrize("extra", [{"logprobs": 2},
                                   {"min_tokens": 2, "temperature": 1.0, "seed": 5},
                                   {"n": 2, "temperature": 1.0, "seed": 11}],
                         ids=["logprobs", "min_tokens-seeded", "n"])
def test_requests_the_first_token_cannot_serve_recompute_the_last_prompt_token(cluster, extra):
    """Logprobs, and min_tokens with a seeded draw, are not reproduced by the prefill leg: D
    reads all but the last prompt token and computes that one. With n > 1 (sampled, seeded)
    choice 0 alone reads P's lease and takes P's token; the other choice starts from what it
    read. The outputs still equal one instance's."""
    p, d = cluster["p"], cluster["d_fail"]
    length = 2 * B + 3
    seed = 4242 + sum(map(ord, next(iter(extra))))  # a new prompt each case: no prefix-cache hit
    body = dict(completion_body(cluster, token_prompt(length, seed=seed), False), **extra)
    expected = generate(cluster["single"], "completions", body)
    assert expected["status"] == 200, expected
    before = counters(d.metrics())
    leg = {k: v for k, v in body.items() if k != "n"}  # as the proxy sends it
    params = prefill_leg(p, "completions", leg)
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200, out
    assert [c["text"] for c in out["body"]["choices"]] == [c["text"] for c in expected["body"]["choices"]]
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    if "n" in extra:
        assert len({c["text"] for c in out["body"]["choices"]}) == 2  # really sampled apart
        # one read of P's lease, by choice 0 (which starts with P's token); choice 1 starts
        # from D's prefix cache (the full blocks choice 0 read) and computes the rest
        assert after["transferred"] - before["transferred"] == length
        assert after["computed"] - before["computed"] == length % B
    else:
        assert after["computed"] - before["computed"] == 1
        assert after["transferred"] - before["transferred"] == length - 1
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("leg_min_tokens", [True, False], ids=["proxy-leg", "leg-without-it"])
def test_min_tokens_starts_from_the_prefillers_token_unless_its_mask_forbids_it(cluster,
                                                                             leg_min_tokens):
    """Greedy with ``min_tokens`` and a stop token that is the prompt's unmasked argmax: the
    proxy's leg (``min_tokens: 1``) draws P's token under the mask, and D starts from it,
    computing no prompt token; a leg without ``min_tokens`` draws the stop token, which D
    drops: it computes the last prompt token and draws the first token under the mask. Both
    answer as one instance."""
    p, d = cluster["p"], cluster["d_fail"]
    length = 2 * B + 5
    body = completion_body(cluster, token_prompt(length, seed=7070 + leg_min_tokens), False)
    free = generate(cluster["single"], "completions", dict(body, return_token_ids=True))
    body.update(min_tokens=2, stop_token_ids=[free["body"]["choices"][0]["token_ids"][0]])
    expected = generate(cluster["single"], "completions", dict(body, return_token_ids=True))
    assert expected["status"] == 200, expected
    assert expected["body"]["choices"][0]["token_ids"][0] not in body["stop_token_ids"]
    before = counters(d.metrics())
    params = prefill_leg(p, "completions", body, leg_min_tokens=leg_min_tokens)
    assert (params["first_token_id"] in body["stop_token_ids"]) is not leg_min_tokens
    out = decode_leg(d, "completions", dict(body, return_token_ids=True), params)
    assert out["status"] == 200, out
    assert out["body"]["choices"][0]["token_ids"] == expected["body"]["choices"][0]["token_ids"]
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["computed"] - before["computed"] == (0 if leg_min_tokens else 1)
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_stop_string_waits_for_min_tokens_on_the_decoder(cluster, stream):
    """A stop string that the first token's text matches is ignored until ``min_tokens``
    tokens exist, through P/D as on one instance (P's leg has ``min_tokens`` 1 at most)."""
    p, d = cluster["p"], cluster["d_fail"]
    body = completion_body(cluster, token_prompt(B + 5, seed=5150 + stream), stream, max_tokens=10)
    free = reference(cluster, "completions", body)
    assert free, "the prompt must produce text"
    body.update(stop=[free[0]], min_tokens=5)
    single = generate(cluster["single"], "completions", dict(body, stream=False))
    assert single["status"] == 200, single
    assert single["body"]["usage"]["completion_tokens"] > 5  # the stop string waited
    params = prefill_leg(p, "completions", body)
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200, out
    assert out["text"] and out["text"] == single["text"]
    if not stream:
        assert out["body"]["usage"]["completion_tokens"] == single["body"]["usage"]["completion_tokens"]
        assert out["body"]["choices"][0]["finish_reason"] == single["body"]["choices"][0]["finish_reason"]
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("index, stream", [(0, False), (2, True)],
                         ids=["first-plain", "third-stream"])
def test_stop_token_text_is_left_out_on_the_decoder(cluster, index, stream):
    """A ``stop_token_ids`` token ends D's request as one instance's: counted, its text left
    out; also when it is P's first token (D finishes on it before any decode step)."""
    p, d = cluster["p"], cluster["d_fail"]
    body = completion_body(cluster, token_prompt(B + 7, seed=6160 + index), stream)
    free = generate(cluster["single"], "completions",
                    dict(body, stream=False, return_token_ids=True))
    ids = free["body"]["choices"][0]["token_ids"]
    assert ids[index] not in ids[:index], "pick a prompt whose stop token is new there"
    body["stop_token_ids"] = [ids[index]]
    single = generate(cluster["single"], "completions", dict(body, stream=False))
    assert single["body"]["usage"]["completion_tokens"] == index + 1
    assert single["body"]["choices"][0]["finish_reason"] == "stop"
    head = cluster["single"].client.post("/detokenize", json={"tokens": ids[:index]}).json()
    assert single["text"] == head["prompt"]
    params = prefill_leg(p, "completions", body)
    assert params["first_token_id"] == ids[0]
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200, out
    assert out["text"] == single["text"]
    if not stream:
        assert out["body"]["usage"]["completion_tokens"] == index + 1
        assert out["body"]["choices"][0]["finish_reason"] == "stop"
    p.wait_all_blocks_free(timeout_s=10)


def test_forged_first_token_id_is_a_400(cluster):
    p, d = cluster["p"], cluster["d_fail"]
    body = completion_body(cluster, token_prompt(B + 1, seed=99), False)
    params = prefill_leg(p, "completions", body)
    for bad in (-1, "7", 10**9):
        out = decode_leg(d, "completions", body, dict(params, first_token_id=bad))
        assert out["status"] == 400, out
        assert "first_token_id" in out["body"]["error"]["message"]
    out = decode_leg(d, "completions", body, params)  # the lease is still good after the 400s
    assert out["status"] == 200, out
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_equals_single_instance(cluster, stream):
    p, d = cluster["p"], cluster["d_fail"]
    body = chat_body(cluster, f"Tell me about the number {41 + stream} and rivers.", stream)
    expected = reference(cluster, "chat/completions", body)
    before = counters(d.metrics())
    params = prefill_leg(p, "chat/completions", body)
    assert prompt_handoff.KEY in params  # P's connector hands its prompt ids on
    out = decode_leg(d, "chat/completions", body, params)
    assert out["status"] == 200, out
    assert out["text"] == expected
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["xfers"] > before["xfers"]
    assert after["computed"] - before["computed"] == 0
    p.wait_all_blocks_free(timeout_s=10)


def test_decoder_prefix_cache_hit_reads_only_the_rest(cluster):
    p, d = cluster["p"], cluster["d_fail"]
    prefix = token_prompt(3 * B, seed=777)
    warm = generate(d, "completions", completion_body(cluster, prefix + [5000], False, 2))
    assert warm["status"] == 200
    prompt = prefix + token_prompt(2 * B + 3, seed=778)
    body = completion_body(cluster, prompt, False)
    expected = reference(cluster, "completions", body)
    before = counters(d.metrics())
    params = prefill_leg(p, "completions", body)
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200 and out["text"] == expected
    assert out["body"]["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * B
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["transferred"] - before["transferred"] == len(prompt) - 3 * B
    assert after["computed"] - before["computed"] == 0
    assert after["xfers"] > before["xfers"]
    p.wait_all_blocks_free(timeout_s=10)


# ----------------------------------------------------------------------------- lease handling
def test_lease_expiry_frees_producer_blocks_and_is_counted(cluster):
    p = cluster["p_short"]
    before = counters(p.metrics())
    body = completion_body(cluster, token_prompt(40, seed=9001), False)
    prefill_leg(p, "completions", body)  # D never comes
    m = p.metrics()
    assert m["pdserve:kv_cache_free_blocks"] < m["pdserve:kv_cache_total_blocks"]
    # the expiry is counted in the connector's stats, which may reach /metrics after the
    # freed blocks do: wait for both
    m = p.wait_metrics(lambda m: m["pdserve:kv_cache_free_blocks"]
                       == m["pdserve:kv_cache_total_blocks"]
                       and counters(m)["expired"] > before["expired"], timeout_s=SHORT_LEASE_S + 10)
    assert counters(m)["expired"] == before["expired"] + 1


def test_abort_before_read_frees_producer_blocks(cluster):
    p, d = cluster["p"], cluster["d_rec"]
    # occupy D's only sequence slot so that the P/D request waits in D's queue
    long_body = completion_body(cluster, token_prompt(8, seed=4242), False, max_tokens=400)
    long_body["ignore_eos"] = True
    busy = threading.Thread(target=generate, args=(d, "completions", long_body), daemon=True)
    busy.start()
    d.wait_metrics(lambda m: m.get("pdserve:num_requests_running", 0) >= 1)
    body = completion_body(cluster, token_prompt(50, seed=4243), True)
    params = prefill_leg(p, "completions", body)
    before_p = counters(p.metrics())
    with d.client.stream("POST", "/v1/completions", json=dict(body, kv_transfer_params=params)):
        d.wait_metrics(lambda m: m.get("pdserve:num_requests_waiting", 0) >= 1)
    # the client went away: D aborts the queued request and tells P, long before P's 30 s lease
    m = p.wait_all_blocks_free(timeout_s=10)
    assert counters(m)["expired"] == before_p["expired"]
    busy.join(timeout=120)


# --------------------------------------------------------------------------- failure injection
def _expect_failure_or_recompute(cluster, d: Server, endpoint: str, body: dict, params: dict,
                                 expected: str, status: int | None = None) -> None:
    """``fail``: the request fails with ``status`` (400: the relayed params are at fault; 502 /
    503: the prefiller or the transport; None: any 5xx). ``recompute``: the right answer."""
    before = counters(d.metrics())
    out = decode_leg(d, endpoint, body, params)
    if d is cluster["d_fail"]:
        if status is None:
            assert out["status"] >= 500, out
        else:
            assert out["status"] == status, out
        if status == 400:
            error = out["error"]["error"]
            assert error["param"] == "kv_transfer_params" and error["code"] == 400, error
            assert "kv_transfer_params" in error["message"], error
        assert out["text"] is None
    else:
        assert out["status"] == 200, out
        assert out["text"] == expected
    d.wait_metrics(lambda m: counters(m)["failed"] > before["failed"])


@pytest.mark.parametrize("decoder", ["d_fail", "d_rec"])
def test_unreachable_side_channel(cluster, decoder):
    p, d = cluster["p_short"], cluster[decoder]
    body = completion_body(cluster, token_prompt(37, seed=hash(decoder) % 1000), False)
    expected = reference(cluster, "completions", body)
    params = prefill_leg(p, "completions", body)
    params = dict(params, remote_port=free_port())  # nobody listens there
    _expect_failure_or_recompute(cluster, d, "completions", body, params, expected, 503)
    p.wait_all_blocks_free(timeout_s=SHORT_LEASE_S + 10)  # P never heard from D: lease expiry


@pytest.mark.parametrize("decoder", ["d_fail", "d_rec"])
@pytest.mark.parametrize("forge", ["shifted", "out_of_range"])
def test_forged_block_ids(cluster, decoder, forge):
    p, d = cluster["p"], cluster[decoder]
    body = completion_body(cluster, token_prompt(45, seed=len(forge) * 7 + len(decoder)), False)
    expected = reference(cluster, "completions", body)
    params = prefill_leg(p, "completions", body)
    (ids,) = params["remote_block_ids"]
    forged = [(b + 100) % 1024 for b in ids] if forge == "shifted" else [10**6 + b for b in ids]
    _expect_failure_or_recompute(cluster, d, "completions", body,
                                 dict(params, remote_block_ids=forged), expected, 400)
    # The forged params named the real request: P refused the claim and ignored the abort
    # notice naming the forged blocks, so the honest decode still reads the real lease.
    before = counters(d.metrics())
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200 and out["text"] == expected, out
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["failed"] == before["failed"]  # the claim was granted: the lease was intact
    # (recompute put the prompt's full blocks into D's prefix cache: only the rest moves)
    assert after["transferred"] > before["transferred"]
    p.wait_all_blocks_free(timeout_s=10)  # the honest read's "done" ended the lease


@pytest.mark.parametrize("decoder", ["d_fail", "d_rec"])
def test_relayed_first_token_is_checked_against_the_prefillers(cluster, decoder):
    """P's params relayed with ``first_token_id`` replaced by another valid vocabulary id: D
    never answers with the forged token. P's claim answer carries its own first token, the
    mismatch is a load failure: ``recompute`` answers the model's own text, ``fail`` an error."""
    p, d = cluster["p"], cluster[decoder]
    body = completion_body(cluster, token_prompt(2 * B + 7, seed=515 + len(decoder)), False)
    expected = reference(cluster, "completions", body)
    params = prefill_leg(p, "completions", body)
    first = params["first_token_id"]
    forged = first - 1 if first > 0 else first + 1  # another id inside the vocabulary
    _expect_failure_or_recompute(cluster, d, "completions", body,
                                 dict(params, first_token_id=forged), expected, 400)
    # the forged params left P's lease alone: the honest decode reads it, and its "done" ends it
    out = decode_leg(d, "completions", body, params)
    assert out["status"] == 200 and out["text"] == expected, out
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("decoder", ["d_fail", "d_rec"])
def test_params_of_another_prompt_never_load_its_kv(cluster, decoder):
    """P's params for prompt X sent with prompt Y (same length): the lease claim carries the
    digest of D's tokens, P refuses it, and X's KV never enters D's prefix cache under Y's
    hashes. A later honest request for Y gets Y's answer."""
    p, d = cluster["p"], cluster[decoder]
    x = token_prompt(3 * B + 5, seed=900 + len(decoder))
    y = token_prompt(3 * B + 5, seed=950 + len(decoder))
    body_x, body_y = completion_body(cluster, x, False), completion_body(cluster, y, False)
    expected_y = reference(cluster, "completions", body_y)
    params_x = prefill_leg(p, "completions", body_x)
    _expect_failure_or_recompute(cluster, d, "completions", body_y, params_x, expected_y, 400)
    # P refused the claim and kept X's lease: X's honest decode still reads it
    out_x = decode_leg(d, "completions", body_x, params_x)
    assert out_x["status"] == 200 and out_x["text"] == reference(cluster, "completions", body_x)
    p.wait_all_blocks_free(timeout_s=10)
    again = decode_leg(d, "completions", body_y, prefill_leg(p, "completions", body_y))
    assert again["status"] == 200 and again["text"] == expected_y, again
    plain = generate(d, "completions", body_y)  # served from D's prefix cache
    assert plain["status"] == 200 and plain["text"] == expected_y, plain
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize("decoder", ["d_fail", "d_rec"])
def test_failed_handshake_frees_producer_blocks(cluster, decoder):
    p, d = cluster["p"], cluster[decoder]
    body = completion_body(cluster, token_prompt(21, seed=31 + len(decoder)), False)
    expected = reference(cluster, "completions", body)
    params = prefill_leg(p, "completions", body)
    wrong = dict(params, remote_engine_id="some-other-engine")
    # params naming another engine than the one at their side channel are at fault: 400
    _expect_failure_or_recompute(cluster, d, "completions", body, wrong, expected, 400)
    p.wait_all_blocks_free(timeout_s=10)  # abort sent over the side channel


def test_producer_killed_after_answering(cluster, tmp_path):
    model = cluster["model"]
    victim = Server(model, tmp_path / "victim.log", nixl_config("kv_producer"), COMMON)
    try:
        start_all([victim])
        legs = {}
        for name in ("d_fail", "d_rec"):
            # a first full round trip, so the decoder has the producer's handshake cached
            warm = completion_body(cluster, token_prompt(20, seed=len(name)), False)
            out = decode_leg(cluster[name], "completions", warm, prefill_leg(victim, "completions", warm))
            assert out["status"] == 200
            body = completion_body(cluster, token_prompt(52, seed=len(name) + 100), False)
            legs[name] = (body, prefill_leg(victim, "completions", body),
                          reference(cluster, "completions", body))
        victim.kill()
        # both decoders at once: each waits out its own handshake timeout with the dead peer
        with concurrent.futures.ThreadPoolExecutor(len(legs)) as pool:
            for done in [pool.submit(_expect_failure_or_recompute, cluster, cluster[name],
                                     "completions", body, params, expected)
                         for name, (body, params, expected) in legs.items()]:
                done.result()
    finally:
        victim.stop()


def test_all_producer_blocks_free_at_the_end(cluster):
    for name in ("p", "p_short"):
        cluster[name].wait_all_blocks_free(timeout_s=SHORT_LEASE_S + 10)


# --------------------------------------------------------------------------------- KV cache tiers
def test_multi_turn_histories_come_back_from_the_tiers_of_p_and_d(server_pool):
    """P (host tier) and D (a tiny host tier over a disk tier), each with a KV cache of
    ``TIER_BLOCKS`` blocks: three turns of five conversations, interleaved, so each turn's
    history was evicted from both caches by the others' (5 x 150 tokens > the cache's 640).
    D's answers equal the single instance's; on both instances the tier counters show every
    history coming back from the tiers (P: its host tier; D: mostly its disk tier)."""
    from tests.support.servers import TIER_BLOCKS

    servers = server_pool.get("single", "p_tier", "d_tier")
    cluster = {**servers, "model": server_pool.model}
    p, d = servers["p_tier"], servers["d_tier"]
    convs = [token_prompt(150, seed=700 + c) for c in range(5)]
    key = "pdserve:kv_offload_prompt_tokens_loaded_total"
    loaded0 = {s: s.metrics().get(key, 0.0) for s in (p, d)}
    history = 0  # full blocks of every turn's previous prompt, in tokens
    for turn in range(3):
        for c, prompt in enumerate(convs):
            body = completion_body(cluster, prompt, stream=False)
            expected = reference(cluster, "completions", body)
            params = prefill_leg(p, "completions", body)
            out = decode_leg(d, "completions", body, params)
            assert out["status"] == 200 and out["text"] == expected, (turn, c)
            convs[c] = prompt + token_prompt(40, seed=800 + 10 * c + turn)
            if turn < 2:
                history += len(prompt) // B * B
    assert sum(len(c) for c in convs) > TIER_BLOCKS * B  # the histories do not fit
    for s in (p, d):
        m = s.wait_metrics(lambda m: m.get("pdserve:kv_cache_free_blocks")
                           == m.get("pdserve:kv_cache_total_blocks"))
        assert m[key] - loaded0[s] >= history * 0.9, (s.log_path, m[key] - loaded0[s], history)
        assert m.get("pdserve:kv_offload_failed_loads_total", 0.0) == 0
