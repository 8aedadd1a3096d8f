"""End to end for DeepSeek (multi-head latent attention, issue 38): through ``pdserve proxy
--multi-turn`` in front of a bidirectional P/D pair of different TP sizes, a completion and a
three-turn chat give a single instance's greedy output, and every reader rank reads the latent
once, from one owner rank.

One module-scoped cluster per case (tiny random models of ``pdserve.testing.tiny_models``):

* ``v2-p2-d1``: DeepSeek-V2 with ``q_lora_rank``, P at TP 2 and D at TP 1;
* ``v2lite-p1-d2``: DeepSeek-V2 without ``q_lora_rank``, P at TP 1 and D at TP 2;
* ``v3-p2-d1``: DeepSeek-V3 (sigmoid routing, interleaved rotary), P at TP 2 and D at TP 1.

P runs without a prefix cache of its own (history it does not compute was pulled from D, turns
2 and 3 read D's latent the other way). The single-instance oracle is P asked directly with no
``kv_transfer_params`` (a producer then serves as a plain instance). The latent is replicated on
every TP rank, so a read moves one rank's bytes: D's ``pdserve:nixl_bytes_transferred`` grows by
exactly the prompt's blocks times one rank's block bytes per D rank, and its descriptors are one
per run of blocks per D rank (docs/architecture.md, "MLA latent cache").
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from tests.support.servers import (
    BIDIR_TTL_S, BLOCK_SIZE as B, POOL_COMMON, EngineServer, ProxyServer)
from tests.support.servers import generate, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THRESHOLD = 64  # kv_recompute_threshold (the default)
MAX_TOKENS = 8
ORIGINAL_CTX = 32  # the tiny DeepSeek models' YaRN original context
# past the YaRN threshold; max_position_embeddings = factor * original context
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0,
        "original_max_position_embeddings": ORIGINAL_CTX, "mscale": 1.0,
        "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}
SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")
#: case -> (tiny_models arch, P's TP size, D's TP size)
CASES = {"v2-p2-d1": ("deepseek_v2", 2, 1), "v2lite-p1-d2": ("deepseek_v2_lite", 1, 2),
         "v3-p2-d1": ("deepseek_v3", 2, 1)}


@pytest.fixture(scope="module", params=list(CASES))
def cluster(request, tmp_path_factory):
    from pdserve.testing.tiny_models import make_tiny_model

    name = request.param
    arch, p_tp, d_tp = CASES[name]
    model = str(make_tiny_model(tmp_path_factory.mktemp(name), arch, rope_parameters=YARN,
                                max_position_embeddings=16 * ORIGINAL_CTX))
    logs = tmp_path_factory.mktemp(f"{name}-logs")
    common = [*POOL_COMMON[:-2], "--max-model-len", "512"]
    servers = {
        "p": EngineServer(model, logs / "p.log",
                          nixl_config("kv_producer", bidirectional_kv_xfer=True),
                          [*common, "-tp", str(p_tp), "--no-enable-prefix-caching"]),
        "d": EngineServer(model, logs / "d.log",
                          nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                      bidirectional_kv_xfer=True),
                          [*common, "-tp", str(d_tp)]),
    }
    proxy = None
    try:
        start_all(list(servers.values()))
        proxy = ProxyServer([servers["p"]], [servers["d"]], logs / "proxy.log", ["--multi-turn"])
        proxy.wait_ready()
        yield {"name": name, "model": model, "proxy": proxy, "d_tp": d_tp, **servers}
    finally:
        for process in [proxy, *servers.values()]:
            if process is not None:
                process.stop()


KEYS = ("pdserve:prompt_tokens_total", "pdserve:prompt_tokens_computed_total",
        "pdserve:prompt_tokens_transferred_total", "pdserve:nixl_bytes_transferred_sum",
        "pdserve:nixl_num_descriptors_sum", "pdserve:nixl_num_failed_transfers")


def _counters(server: EngineServer) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(k, 0.0) for k in KEYS}


def _block_bytes(model: str) -> int:
    """One rank's latent block (bytes): every layer's entries of ``kv_lora_rank +
    qk_rope_head_dim`` float32 values (the servers' dtype on CPU) for ``B`` tokens."""
    hf = json.loads((Path(model) / "config.json").read_text())
    width = hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
    return hf["num_hidden_layers"] * width * B * 4


def test_completion_equals_single_instance_and_the_latent_is_read_once(cluster):
    rng = random.Random(38)
    n_blocks = 4
    prompt = [rng.randrange(1000, 30000) for _ in range(n_blocks * B + 5)]
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    single = generate(cluster["p"], "completions", body)
    assert single["status"] == 200, single
    before = _counters(cluster["d"])
    out = generate(cluster["proxy"], "completions", body)
    assert out["status"] == 200, out
    assert out["text"] == single["text"], cluster["name"]
    after = cluster["d"].wait_metrics(
        lambda m: m.get(KEYS[0], 0.0) >= before[KEYS[0]] + len(prompt))
    delta = {k: after.get(k, 0.0) - before[k] for k in KEYS}
    # D computed none of the prompt; each D rank read the prompt's blocks once, from one P rank
    assert delta[KEYS[1]] == 0 and delta[KEYS[2]] == len(prompt), delta
    blocks = -(-len(prompt) // B)
    assert delta["pdserve:nixl_bytes_transferred_sum"] == \
        cluster["d_tp"] * blocks * _block_bytes(cluster["model"]), delta
    # fresh blocks of one request are one run on both sides, or a few: at most one descriptor
    # per block and D rank, never one per head slice or per layer
    assert cluster["d_tp"] <= delta["pdserve:nixl_num_descriptors_sum"] <= \
        cluster["d_tp"] * blocks, delta
    assert delta["pdserve:nixl_num_failed_transfers"] == 0
    cluster["p"].wait_all_blocks_free(timeout_s=30)  # every P rank heard "done"


def test_three_turn_chat_equals_single_instance(cluster):
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(1, 4):
        messages.append({"role": "user", "content": f"Question {k}: what happened in the "
                         f"harbour in year {1800 + 7 * k}, and who kept the lighthouse then?"})
        body = {"model": cluster["model"], "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        single = generate(cluster["p"], "chat/completions", body)
        assert single["status"] == 200, single
        n_prompt = single["body"]["usage"]["prompt_tokens"]
        assert n_prompt > ORIGINAL_CTX
        before = _counters(cluster["p"])
        r = cluster["proxy"].client.post("/v1/chat/completions",
                                         json=dict(body, conversation_id=cluster["name"]))
        assert r.status_code == 200, r.text
        answer = r.json()["choices"][0]["message"]["content"]
        assert answer == single["text"], f"{cluster['name']} turn {k}"
        after = cluster["p"].wait_metrics(
            lambda m: m.get(KEYS[0], 0.0) >= before[KEYS[0]] + n_prompt)
        pulled = after.get(KEYS[2], 0.0) - before[KEYS[2]]
        if k == 1:
            assert pulled == 0
        else:
            assert pulled >= THRESHOLD and pulled % B == 0, f"turn {k}: P pulled {pulled}"
        assert after.get(KEYS[5], 0.0) == before[KEYS[5]]
        messages.append({"role": "assistant", "content": answer})
