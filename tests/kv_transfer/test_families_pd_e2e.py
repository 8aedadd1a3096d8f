"""End to end for the families of issue 17 (tests/support/families.py, and the tiny Gemma 3 with a
sliding window of 8 tokens): through ``pdserve proxy --multi-turn`` in front of a bidirectional
P/D pair, a completion and a three-turn chat give a single instance's greedy output, with prompts
past the rope-scaling threshold and longer than the sliding window; P pulls the history from D on
turns 2 and 3.

One module-scoped cluster per family: P (no prefix cache of its own, so history it does not
compute was pulled from D), D and the proxy (the same settings as the shared pool's ``p_bidir`` /
``d_bidir``, tests/support/servers.py). The single-instance oracle is P itself, asked directly with no
``kv_transfer_params``: a producer serves such a request as a plain instance, and without a
prefix cache it computes every oracle prompt from scratch. Oracle requests are sent before the
counters a test compares are read.
"""

from __future__ import annotations

import random

import pytest

from tests.support.families import ORIGINAL_CTX, make_family_model
from tests.support.servers import (
    BIDIR_TTL_S, BLOCK_SIZE as B, POOL_COMMON, EngineServer, ProxyServer)
from tests.support.servers import generate, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THRESHOLD = 64  # kv_recompute_threshold (the default)
MAX_TOKENS = 10
SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")


@pytest.fixture(scope="module", params=["qwen2-yarn", "llama3-rope", "qwen3-moe", "gemma3"])
def cluster(request, tmp_path_factory):
    name = request.param
    if name == "gemma3":
        model = request.getfixturevalue("tiny_gemma3_path")
    else:
        model = make_family_model(name, tmp_path_factory.mktemp(name))
    logs = tmp_path_factory.mktemp(f"{name}-logs")
    servers = {
        "p": EngineServer(model, logs / "p.log",
                          nixl_config("kv_producer", bidirectional_kv_xfer=True),
                          [*POOL_COMMON, "--no-enable-prefix-caching"]),
        "d": EngineServer(model, logs / "d.log",
                          nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                      bidirectional_kv_xfer=True), POOL_COMMON),
    }
    proxy = None
    try:
        start_all(list(servers.values()))
        proxy = ProxyServer([servers["p"]], [servers["d"]], logs / "proxy.log", ["--multi-turn"])
        proxy.wait_ready()
        yield {"name": name, "model": model, "proxy": proxy, "single": servers["p"], **servers}
    finally:
        for process in [proxy, *servers.values()]:
            if process is not None:
                process.stop()


def _p_counters(cluster) -> dict[str, float]:
    m = cluster["p"].metrics()
    return {k: m.get(k, 0.0) for k in ("pdserve:prompt_tokens_total",
                                       "pdserve:prompt_tokens_transferred_total")}


def test_completion_through_the_proxy_equals_single_instance(cluster):
    rng = random.Random(7)
    prompt = [rng.randrange(1000, 30000) for _ in range(3 * ORIGINAL_CTX + 5)]
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    single = generate(cluster["single"], "completions", body)
    assert single["status"] == 200, single
    keys = ("pdserve:prompt_tokens_total", "pdserve:prompt_tokens_computed_total",
            "pdserve:prompt_tokens_transferred_total")
    m = cluster["d"].metrics()
    before = {k: m.get(k, 0.0) for k in keys}
    for stream in (False, True):
        out = generate(cluster["proxy"], "completions", dict(body, stream=stream))
        assert out["status"] == 200, out
        assert out["text"] == single["text"], f"{cluster['name']} stream={stream}"
    after = cluster["d"].wait_metrics(
        lambda m: m.get(keys[0], 0.0) >= before[keys[0]] + 2 * len(prompt))
    # D computed none of the prompt: the first time all of it came from P (the second time its
    # own prefix cache holds the full blocks)
    assert after[keys[1]] == before[keys[1]]
    assert after[keys[2]] - before[keys[2]] >= len(prompt)
    cluster["p"].wait_all_blocks_free(timeout_s=10)


def test_three_turn_chat_equals_single_instance(cluster):
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(1, 4):
        messages.append({"role": "user", "content": f"Question {k}: what happened in the "
                         f"harbour in year {1800 + 7 * k}, and who kept the lighthouse then?"})
        body = {"model": cluster["model"], "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        single = generate(cluster["single"], "chat/completions", body)
        assert single["status"] == 200, single
        n_prompt = single["body"]["usage"]["prompt_tokens"]
        assert n_prompt > ORIGINAL_CTX
        before = _p_counters(cluster)
        r = cluster["proxy"].client.post("/v1/chat/completions",
                                         json=dict(body, conversation_id=cluster["name"]))
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer == single["text"], f"{cluster['name']} turn {k}"
        after = cluster["p"].wait_metrics(
            lambda m: m.get("pdserve:prompt_tokens_total", 0.0)
            >= before["pdserve:prompt_tokens_total"] + n_prompt)
        pulled = (after.get("pdserve:prompt_tokens_transferred_total", 0.0)
                  - before["pdserve:prompt_tokens_transferred_total"])
        if k == 1:
            assert pulled == 0
        else:
            assert pulled >= THRESHOLD and pulled % B == 0, f"turn {k}: P pulled {pulled}"
        messages.append({"role": "assistant", "content": answer})
