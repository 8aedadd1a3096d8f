"""End to end: bidirectional KV transfer (docs/architecture.md, "Multi-turn: bidirectional transfer") through ``pdserve proxy --multi-turn``.

Processes: a single instance (the oracle), a prefiller P and a decoder D (both with
``bidirectional_kv_xfer``) and the multi-turn proxy. P runs without its own prefix cache, so every
history token it does not compute must have been pulled from D (its
``pdserve:prompt_tokens_transferred_total``). The tiny random model's answers do not survive a
detokenize/retokenize round trip, so D's reusable prefix ends inside the previous answer: P
pulls at least every full block of the previous prompt and computes the rest. The tests of a D
with KV cache tiers use the pool's small tiered D, and a TP 2 one (CPU, gloo) of their own.
"""

from __future__ import annotations

import pytest

from tests.support.servers import BIDIR_TTL_S as TTL_S, BLOCK_SIZE as B, LOAD_FACTOR, POOL_COMMON
from tests.support.servers import POOL_SPECS, TIER_BLOCKS
from tests.support.servers import (EngineServer, ProxyServer, greedy_chat_body, nixl_config,
                                   start_all, stop_together)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THRESHOLD = 64  # kv_recompute_threshold (the default)
MAX_TOKENS = 12
#: ``decoder_kv_blocks_ttl`` of the expiry test's own decoder (s): nothing is pulled from it, so
#: it need not outlast P's pull safety margin like the pooled decoder's :data:`TTL_S`.
SHORT_TTL_S = 1.0 * LOAD_FACTOR

SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")


@pytest.fixture(scope="module")
def cluster(server_pool):
    """The session's shared oracle ``single``, the bidirectional pair ``p`` / ``d`` and the
    multi-turn proxy in front of them."""
    servers = server_pool.get("single", "p_bidir", "d_bidir")
    proxy = server_pool.proxy("multi-turn", ["p_bidir"], ["d_bidir"], ["--multi-turn"])
    return {"model": server_pool.model, "proxy": proxy, "single": servers["single"],
            "p": servers["p_bidir"], "d": servers["d_bidir"]}


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from pdserve.model_files.client_tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_path)


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The prompt tokens the server builds for ``messages`` (template, then encode)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def body(cluster, messages: list[dict], conversation_id: str | None = None) -> dict:
    return greedy_chat_body(cluster["model"], messages, MAX_TOKENS, conversation_id)


def single_answer(cluster, messages: list[dict]) -> str:
    r = cluster["single"].client.post("/v1/chat/completions", json=body(cluster, messages))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


PROMPT_KEYS = ("pdserve:prompt_tokens_total", "pdserve:prompt_tokens_computed_total",
               "pdserve:prompt_tokens_transferred_total", "pdserve:nixl_num_kv_expired_reqs",
               "pdserve:nixl_num_failed_transfers")


def p_counters(cluster) -> dict[str, float]:
    m = cluster["p"].metrics()
    return {k: m.get(k, 0.0) for k in PROMPT_KEYS}


def turn(cluster, messages: list[dict], conversation_id: str) -> tuple[str, dict[str, float]]:
    """One turn through the proxy; returns D's answer and the change of P's counters."""
    before = p_counters(cluster)
    r = cluster["proxy"].client.post("/v1/chat/completions",
                                     json=body(cluster, messages, conversation_id))
    assert r.status_code == 200, r.text
    data = r.json()
    n_prompt = data["usage"]["prompt_tokens"]
    # P's counters are published with its last output; wait until the prompt is counted
    after = cluster["p"].wait_metrics(
        lambda m: m.get("pdserve:prompt_tokens_total", 0.0) >= before["pdserve:prompt_tokens_total"]
        + n_prompt)
    delta = {k: after.get(k, 0.0) - before[k] for k in PROMPT_KEYS}
    assert delta["pdserve:prompt_tokens_total"] == n_prompt
    return data["choices"][0]["message"]["content"], delta


def user_message(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}: what happened in the harbour in year "
                                       f"{1800 + 7 * i}, and who kept the lighthouse then?"}


class VllmContractRouter:
    """A minimal multi-turn P/D router written against vLLM's NixlConnector contract, as
    third-party routers are: it sizes every ``kv_transfer_params`` it gets by
    ``remote_block_ids[0]`` (the blocks of the first KV-cache group), and sends D's params of
    the previous turn with the next P leg."""

    def __init__(self, cluster):
        self.p, self.d = cluster["p"], cluster["d"]
        self.decoder_params: dict | None = None
        self.block_counts: list[tuple[int, int]] = []  # (P's, D's) first-group block counts

    def chat(self, request: dict) -> str:
        p_kv = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
        if self.decoder_params:
            p_kv.update(self.decoder_params, do_remote_decode=True, do_remote_prefill=False)
        r = self.p.client.post("/v1/chat/completions", json=dict(
            request, max_tokens=1, stream=False, kv_transfer_params=p_kv))
        assert r.status_code == 200, r.text
        p_params = r.json()["kv_transfer_params"]
        p_blocks = len(p_params["remote_block_ids"][0])
        r = self.d.client.post("/v1/chat/completions",
                               json=dict(request, kv_transfer_params=p_params))
        assert r.status_code == 200, r.text
        self.decoder_params = r.json()["kv_transfer_params"]
        self.block_counts.append((p_blocks, len(self.decoder_params["remote_block_ids"][0])))
        return r.json()["choices"][0]["message"]["content"]


def test_router_on_vllms_per_group_block_ids(cluster, tokenizer):
    """Every ``remote_block_ids`` pdserve returns is per KV-cache group (``[[...]]``): a router
    that reads ``remote_block_ids[0]`` works through a three-turn bidirectional chat, and P
    pulls the history from D on turns 2 and 3."""
    router = VllmContractRouter(cluster)
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(1, 4):
        messages.append(user_message(100 + k))
        n_prompt = len(prompt_ids(tokenizer, messages))
        before = p_counters(cluster)
        answer = router.chat(body(cluster, messages))
        after = cluster["p"].wait_metrics(
            lambda m: m.get("pdserve:prompt_tokens_total", 0.0)
            >= before["pdserve:prompt_tokens_total"] + n_prompt)
        pulled = (after.get("pdserve:prompt_tokens_transferred_total", 0.0)
                  - before["pdserve:prompt_tokens_transferred_total"])
        assert answer == single_answer(cluster, messages), f"turn {k}"
        p_blocks, d_blocks = router.block_counts[-1]
        assert p_blocks == -(-n_prompt // B)
        assert d_blocks >= p_blocks
        if k == 1:
            assert pulled == 0
        else:
            assert pulled >= THRESHOLD, f"turn {k}: P pulled {pulled} tokens from D"
        messages.append({"role": "assistant", "content": answer})


def test_six_turn_chat_pulls_history_from_decoder(cluster, tokenizer):
    messages = [{"role": "system", "content": SYSTEM}]
    prev_prompt: list[int] | None = None
    for k in range(1, 7):
        messages.append(user_message(k))
        ids = prompt_ids(tokenizer, messages)
        answer, delta = turn(cluster, messages, "six-turns")
        assert len(ids) == delta["pdserve:prompt_tokens_total"]
        assert answer == single_answer(cluster, messages), f"turn {k}"
        pulled = delta["pdserve:prompt_tokens_transferred_total"]
        computed = delta["pdserve:prompt_tokens_computed_total"]
        assert pulled + computed == len(ids)
        if k == 1:
            assert pulled == 0
        else:
            # D holds the previous prompt and answer; at least the previous prompt's full
            # blocks match, and P computes only the new tokens (plus < 1 block)
            reusable = common_prefix(prev_prompt, ids) // B * B
            assert reusable >= THRESHOLD
            assert pulled >= reusable, f"turn {k}: pulled {pulled} < {reusable}"
            assert computed < len(ids) - len(prev_prompt) + B, f"turn {k}"
        assert delta["pdserve:nixl_num_failed_transfers"] == 0
        messages.append({"role": "assistant", "content": answer})
        prev_prompt = ids


def test_rewritten_history_reuses_only_the_matching_prefix(cluster, tokenizer):
    messages = [{"role": "system", "content": SYSTEM}, user_message(1)]
    answers = []
    for k in (1, 2):
        answer, _ = turn(cluster, messages, "rewritten")
        answers.append(answer)
        messages += [{"role": "assistant", "content": answer}, user_message(k + 1)]
    turn2_prompt = prompt_ids(tokenizer, messages[:4])
    # the client rewrites the middle user message (turn 2's question) before turn 3
    messages[3] = {"role": "user", "content": messages[3]["content"].replace("lighthouse", "mill")}
    ids = prompt_ids(tokenizer, messages)
    first_diff = common_prefix(turn2_prompt, ids)
    assert 0 < first_diff < len(turn2_prompt)
    answer, delta = turn(cluster, messages, "rewritten")
    assert answer == single_answer(cluster, messages)
    expected = first_diff // B * B  # every block up to the first changed one, none after it
    if expected < THRESHOLD:
        expected = 0
    assert delta["pdserve:prompt_tokens_transferred_total"] == expected
    assert delta["pdserve:prompt_tokens_computed_total"] == len(ids) - expected


def test_short_history_below_threshold_is_recomputed(cluster, tokenizer):
    messages = [{"role": "user", "content": "Hi there."}]
    answer, _ = turn(cluster, messages, "short")
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    assert common_prefix(prompt_ids(tokenizer, messages[:1]),
                         prompt_ids(tokenizer, messages)) < THRESHOLD
    answer, delta = turn(cluster, messages, "short")
    assert answer == single_answer(cluster, messages)
    assert delta["pdserve:prompt_tokens_transferred_total"] == 0
    assert delta["pdserve:prompt_tokens_computed_total"] == delta["pdserve:prompt_tokens_total"]


@pytest.fixture
def short_ttl_cluster(cluster, tmp_path):
    """``cluster`` with its own decoder whose ``decoder_kv_blocks_ttl`` is short (and a
    multi-turn proxy in front of the pooled P and it): a turn's blocks expire after about a
    second instead of the pooled decoder's :data:`TTL_S`."""
    d = EngineServer(cluster["model"], tmp_path / "d_short_ttl.log",
                     nixl_config("kv_consumer", decoder_kv_blocks_ttl=SHORT_TTL_S,
                                 bidirectional_kv_xfer=True), POOL_COMMON)
    proxy = None
    try:
        start_all([d])
        proxy = ProxyServer([cluster["p"]], [d], tmp_path / "proxy-short-ttl.log",
                            ["--multi-turn"])
        proxy.wait_ready()
        yield {**cluster, "proxy": proxy, "d": d}
    finally:
        stop_together([*([proxy] if proxy is not None else []), d])


def test_expired_decoder_blocks_are_recomputed(short_ttl_cluster, tokenizer):
    cluster = short_ttl_cluster
    messages = [{"role": "system", "content": SYSTEM}, user_message(40)]
    expired0 = cluster["d"].metrics().get("pdserve:nixl_num_kv_expired_reqs", 0.0)
    answer, _ = turn(cluster, messages, "expiring")
    # wait until D's TTL freed this turn's blocks (and counted it): nobody pulls them, only
    # their TTL frees them
    cluster["d"].wait_metrics(
        lambda m: m.get("pdserve:nixl_num_kv_expired_reqs", 0.0) > expired0
        and m.get("pdserve:kv_cache_free_blocks") == m.get("pdserve:kv_cache_total_blocks"),
        SHORT_TTL_S + 60)
    messages += [{"role": "assistant", "content": answer}, user_message(41)]
    answer, delta = turn(cluster, messages, "expiring")
    assert answer == single_answer(cluster, messages)
    assert delta["pdserve:prompt_tokens_transferred_total"] == 0
    assert delta["pdserve:prompt_tokens_computed_total"] == delta["pdserve:prompt_tokens_total"]


def test_three_turn_chats_come_back_from_the_prefillers_host_tier(server_pool, tokenizer):
    """A bidirectional P with prefix caching, a KV cache of ``TIER_BLOCKS`` blocks and a host
    tier, behind the multi-turn proxy with the pooled D: four three-turn chats with long
    system prompts, interleaved, so each conversation's history (part of it at least) left P's
    KV cache before its next turn. Answers equal the single instance's; on turns 2 and 3 the
    previous prompt is never recomputed: it comes back from P's KV cache and host tier (the
    tier's counter grows on every such turn), or from D."""
    servers = server_pool.get("single", "p_tier_bidir", "d_bidir")
    proxy = server_pool.proxy("multi-turn-tier", ["p_tier_bidir"], ["d_bidir"], ["--multi-turn"])
    cluster = {"model": server_pool.model, "proxy": proxy, "single": servers["single"],
               "p": servers["p_tier_bidir"], "d": servers["d_bidir"]}
    key = "pdserve:kv_offload_prompt_tokens_loaded_total"
    chats = [[{"role": "system", "content": f"Conversation {c}. " + SYSTEM * 6}] for c in range(4)]
    previous = [0] * len(chats)  # tokens of each chat's previous prompt
    assert len(prompt_ids(tokenizer, chats[0])) * len(chats) > TIER_BLOCKS * B
    for k in range(1, 4):
        for c, messages in enumerate(chats):
            messages.append(user_message(200 + 10 * c + k))
            ids = prompt_ids(tokenizer, messages)
            loaded0 = cluster["p"].metrics().get(key, 0.0)
            answer, delta = turn(cluster, messages, f"tiered-{c}")
            assert answer == single_answer(cluster, messages), (k, c)
            loaded = cluster["p"].metrics()[key] - loaded0
            if k > 1:
                assert loaded > 0, (k, c)  # evicted history came back from the host tier
                # none of the previous prompt's full blocks was recomputed
                reused = previous[c] // B * B
                assert delta["pdserve:prompt_tokens_computed_total"] <= len(ids) - reused, (k, c)
            previous[c] = len(ids)
            messages.append({"role": "assistant", "content": answer})
    cluster["p"].wait_all_blocks_free(timeout_s=60)


def pull_chats_through_a_small_decoder(cluster, tokenizer, seed: int, tag: str) -> None:
    """Four interleaved three-turn chats through ``cluster`` whose D has a KV cache of
    ``TIER_BLOCKS`` blocks and a host tier, too small for the chats' held last turns: D demotes
    them and restores them when P claims them. Answers equal the single instance's; on turns 2
    and 3 no full block of the previous prompt is recomputed on P (it was pulled from D); D
    counts demoted turns, restored turns and blocks read back from its host tier, none lost;
    no block stays held on either side."""
    d = cluster["d"]
    chats = [[{"role": "system", "content": f"Conversation {c}. " + SYSTEM * 6}] for c in range(4)]
    assert len(prompt_ids(tokenizer, chats[0])) * len(chats) > TIER_BLOCKS * B
    previous = [0] * len(chats)
    for k in range(1, 4):
        for c, messages in enumerate(chats):
            messages.append(user_message(seed + 10 * c + k))
            ids = prompt_ids(tokenizer, messages)
            answer, delta = turn(cluster, messages, f"{tag}-{c}")
            assert answer == single_answer(cluster, messages), (k, c)
            if k > 1:  # the previous prompt's full blocks came from D, none was recomputed
                reused = previous[c] // B * B
                assert delta["pdserve:prompt_tokens_transferred_total"] >= reused, (k, c)
                assert delta["pdserve:prompt_tokens_computed_total"] <= len(ids) - reused, (k, c)
            previous[c] = len(ids)
            messages.append({"role": "assistant", "content": answer})
    m = d.metrics()
    assert m.get("pdserve:kv_offload_turns_demoted_total", 0) > 0
    assert m.get("pdserve:kv_offload_turns_restored_total", 0) > 0
    tier_line = [line for line in d.client.get("/metrics").text.splitlines() if line.startswith(
        'pdserve:kv_offload_turn_blocks_restored_total{medium="TIER"}')]
    assert tier_line and float(tier_line[0].rsplit(" ", 1)[1]) > 0  # read back from the host
    assert m.get("pdserve:kv_offload_turns_lost_total", 0) == 0
    cluster["p"].wait_all_blocks_free(timeout_s=TTL_S + 20)
    d.wait_all_blocks_free(timeout_s=TTL_S + 20)


def test_three_turn_chats_are_pulled_from_the_decoders_host_tier(server_pool, tokenizer):
    """The pooled P (no prefix cache) and the pooled bidirectional D with a small KV cache and
    a host tier (:func:`pull_chats_through_a_small_decoder`)."""
    servers = server_pool.get("single", "p_bidir", "d_tier_bidir")
    proxy = server_pool.proxy("multi-turn-d-tier", ["p_bidir"], ["d_tier_bidir"],
                              ["--multi-turn"])
    cluster = {"model": server_pool.model, "proxy": proxy, "single": servers["single"],
               "p": servers["p_bidir"], "d": servers["d_tier_bidir"]}
    pull_chats_through_a_small_decoder(cluster, tokenizer, 300, "d-tiered")


def test_three_turn_chats_are_pulled_from_a_tp2_decoders_host_tier(server_pool, tokenizer,
                                                                     tmp_path):
    """As above with a TP 2 decoder (CPU, gloo) of its own: each rank holds its shard of every
    turn under its own lease; a turn is demoted and restored only when both ranks did it, and
    P's claim (answered by rank 0 for both) names blocks that both ranks hold."""
    servers = server_pool.get("single", "p_bidir")
    d = EngineServer(server_pool.model, tmp_path / "d_tier_bidir_tp2.log",
                     POOL_SPECS["d_tier_bidir"].kv_config,
                     [*POOL_SPECS["d_tier_bidir"].args, "-tp", "2"])
    proxy = None
    try:
        start_all([d])
        proxy = ProxyServer([servers["p_bidir"]], [d], tmp_path / "proxy-tp2-d-tier.log",
                            ["--multi-turn"])
        proxy.wait_ready()
        cluster = {"model": server_pool.model, "proxy": proxy, "single": servers["single"],
                   "p": servers["p_bidir"], "d": d}
        pull_chats_through_a_small_decoder(cluster, tokenizer, 500, "d-tp2-tiered")
    finally:
        stop_together([*([proxy] if proxy is not None else []), d])


def test_all_blocks_free_after_conversations_and_ttl(cluster):
    # run last in this module: every conversation above is over
    cluster["p"].wait_all_blocks_free(timeout_s=TTL_S + 20)
    cluster["d"].wait_all_blocks_free(timeout_s=TTL_S + 20)
