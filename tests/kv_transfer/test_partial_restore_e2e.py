"""End to end: a decoder restores only the leading blocks of a demoted turn, and the prefiller's
pull reads those and computes the rest (a partial load, docs/architecture.md, "Multi-turn:
bidirectional transfer").

Processes: the pooled oracle ``single`` and bidirectional P (no prefix cache of its own), a D of
this module with a small KV cache and no KV cache tier, and the multi-turn proxy. Chat A's first
turn is held on D; chat B's long first turn needs more blocks than D has free, so D demotes A's
turn: its blocks stay in D's prefix cache as evictable blocks, and B takes the tail ones (a
request's blocks are evicted tail first, block_manager.py). When A's second turn comes, D
restores the leading blocks still cached, fewer than P's pull planned.
"""

from __future__ import annotations

import pytest

from tests.kv_transfer.test_bidirectional_e2e import (SYSTEM, body, common_prefix, prompt_ids,
                                                      single_answer, user_message)
from tests.support.servers import BLOCK_SIZE as B
from tests.support.servers import LOAD_FACTOR, EngineServer, ProxyServer, nixl_config
from tests.support.servers import start_all, stop_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_TOKENS = 12
D_BLOCKS = 24  # D's KV cache: 384 tokens
#: ``decoder_kv_blocks_ttl`` of this module's D (s): it outlasts both chats' turns and their
#: oracle requests with room for P's 5 s pull safety margin.
TTL_S = 60.0 * LOAD_FACTOR
#: A's full blocks that B takes beyond D's free blocks when its prompt is allocated (its decode
#: may take one more): more than the blocks of A's answer that P's pull cannot match, fewer than
#: the blocks of A's prompt.
EVICTED = 3

P_KEYS = ("pdserve:prompt_tokens_total", "pdserve:prompt_tokens_computed_total",
          "pdserve:prompt_tokens_transferred_total", "pdserve:nixl_num_failed_transfers",
          "pdserve:nixl_num_partial_transfers")
D_KEYS = ("pdserve:kv_offload_turns_demoted_total", "pdserve:kv_offload_turns_restored_total",
          "pdserve:kv_offload_turn_blocks_restored_total", "pdserve:kv_offload_turns_lost_total")


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    from pdserve.model_files.client_tokenizer import load_tokenizer

    return load_tokenizer(tiny_llama_path)


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    """The pooled ``single`` and ``p_bidir``, this module's small bidirectional D without
    tiers, and a multi-turn proxy in front of P and D."""
    servers = server_pool.get("single", "p_bidir")
    logs = tmp_path_factory.mktemp("partial-restore")
    d = EngineServer(server_pool.model, logs / "d_small.log",
                     nixl_config("kv_consumer", decoder_kv_blocks_ttl=TTL_S,
                                 bidirectional_kv_xfer=True),
                     ["--block-size", str(B), "--num-gpu-blocks-override", str(D_BLOCKS),
                      "--max-model-len", str(D_BLOCKS * B)])
    proxy = None
    try:
        start_all([d])
        proxy = ProxyServer([servers["p_bidir"]], [d], logs / "proxy.log", ["--multi-turn"])
        proxy.wait_ready()
        yield {"model": server_pool.model, "proxy": proxy, "single": servers["single"],
               "p": servers["p_bidir"], "d": d}
    finally:
        stop_together([*([proxy] if proxy is not None else []), d])


def counters(server: EngineServer, keys: tuple[str, ...]) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(k, 0.0) for k in keys}


def turn(cluster, messages: list[dict], conversation_id: str) -> tuple[str, dict[str, float]]:
    """One turn through the proxy; returns D's answer and the change of P's counters."""
    before = counters(cluster["p"], P_KEYS)
    r = cluster["proxy"].client.post("/v1/chat/completions", json=dict(
        body(cluster, messages, conversation_id), max_tokens=MAX_TOKENS))
    assert r.status_code == 200, r.text
    data = r.json()
    total = before["pdserve:prompt_tokens_total"] + data["usage"]["prompt_tokens"]
    after = cluster["p"].wait_metrics(lambda m: m.get("pdserve:prompt_tokens_total", 0) >= total)
    return (data["choices"][0]["message"]["content"],
            {k: after.get(k, 0.0) - before[k] for k in P_KEYS})


def long_prompt(tokenizer, num_tokens: int) -> list[dict]:
    """A one-message chat whose prompt has the most tokens up to ``num_tokens``, word by word."""
    words = "the old harbour town kept its lighthouse lit through every winter storm".split() * 99

    def chat(n: int) -> list[dict]:
        return [{"role": "user", "content": " ".join(words[:n])}]

    n = 1
    while len(prompt_ids(tokenizer, chat(n + 1))) <= num_tokens:
        n += 1
    return chat(n)


def test_a_pull_reads_the_leading_blocks_a_decoder_restored_and_computes_the_rest(cluster,
                                                                                tokenizer):
    d = cluster["d"]
    chat_a = [{"role": "system", "content": SYSTEM * 3}, user_message(1)]
    answer, _ = turn(cluster, chat_a, "partial-a")
    m = d.wait_metrics(lambda m: m.get("pdserve:kv_cache_free_blocks", D_BLOCKS) < D_BLOCKS)
    held = D_BLOCKS - m["pdserve:kv_cache_free_blocks"]  # A's turn on D
    a1 = prompt_ids(tokenizer, chat_a)
    full = (len(a1) + MAX_TOKENS - 1) // B  # A's blocks with a hash (its KV's full blocks)
    assert full > EVICTED + 1, full
    chat_a += [{"role": "assistant", "content": answer}, user_message(2)]

    # B's prompt needs the free blocks, A's unhashed ones and EVICTED of A's tail blocks
    need = (D_BLOCKS - held) + (held - full) + EVICTED
    chat_b = long_prompt(tokenizer, need * B - 2)
    assert -(-len(prompt_ids(tokenizer, chat_b)) // B) == need
    d_before = counters(d, D_KEYS)
    turn(cluster, chat_b, "partial-b")
    d_mid = counters(d, D_KEYS)
    assert d_mid["pdserve:kv_offload_turns_demoted_total"] > d_before[
        "pdserve:kv_offload_turns_demoted_total"]  # A's turn left D's GPU for B

    a2 = prompt_ids(tokenizer, chat_a)
    planned = common_prefix(a1, a2) // B  # at least P's pull of A's prompt, in blocks
    answer, delta = turn(cluster, chat_a, "partial-a")
    d_after = counters(d, D_KEYS)
    restored = (d_after["pdserve:kv_offload_turn_blocks_restored_total"]
                - d_mid["pdserve:kv_offload_turn_blocks_restored_total"])
    assert d_after["pdserve:kv_offload_turns_restored_total"] == \
        d_mid["pdserve:kv_offload_turns_restored_total"] + 1
    assert d_after["pdserve:kv_offload_turns_lost_total"] == \
        d_before["pdserve:kv_offload_turns_lost_total"]
    assert 0 < restored < planned, (restored, planned)  # only A's leading blocks came back

    assert answer == single_answer(cluster, chat_a)
    assert delta["pdserve:prompt_tokens_transferred_total"] == restored * B  # all it got
    assert delta["pdserve:prompt_tokens_computed_total"] == len(a2) - restored * B
    assert delta["pdserve:nixl_num_partial_transfers"] == 1
    assert delta["pdserve:nixl_num_failed_transfers"] == 0
