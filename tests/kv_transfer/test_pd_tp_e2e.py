"""End to end: P/D through ``pdserve proxy`` between instances of different TP sizes (CPU, gloo).

Instances of the tiny Llama (2 KV heads): the session pool's oracle ``single`` (TP 1), its
prefiller ``p`` and decoder ``d_fail`` (TP 1) and bidirectional decoder ``d_bidir`` (TP 1), plus
two TP-2 instances of this module: a prefiller (bidirectional, without its own prefix cache, so
history it does not compute was pulled) and a decoder. Greedy output through the proxy must equal
``single``'s, token for token; D's metrics prove that the KV moved (transferred prompt tokens,
none computed). A TP-1 prefiller of another model shape (4 KV heads) is refused at the TP-2
decoder's handshake with a message naming both sides.
"""

from __future__ import annotations

import random

import pytest

from tests.support.servers import BIDIR_TTL_S, BLOCK_SIZE as B, HANDSHAKE_TIMEOUT_S
from tests.support.servers import POOL_COMMON as COMMON
from tests.support.servers import (
    EngineServer, ProxyServer, decode_leg, generate, nixl_config, prefill_leg)
from tests.support.servers import start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

THRESHOLD = 64  # kv_recompute_threshold (the default)


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    from pdserve.testing.tiny_models import make_tiny_model

    logs = tmp_path_factory.mktemp("tp-e2e-logs")
    wide = make_tiny_model(tmp_path_factory.mktemp("tiny-llama-4kv"), "llama",
                           num_key_value_heads=4)
    model = server_pool.model
    own = {
        "p_tp2": EngineServer(model, logs / "p_tp2.log",
                              nixl_config("kv_producer", bidirectional_kv_xfer=True),
                              [*COMMON, "-tp", "2", "--no-enable-prefix-caching"]),
        "d_tp2": EngineServer(model, logs / "d_tp2.log",
                              nixl_config("kv_consumer", kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                              [*COMMON, "-tp", "2"]),
        # another shape under the same served name, so only its KV heads differ
        "p_wide": EngineServer(str(wide), logs / "p_wide.log", nixl_config("kv_producer"),
                               [*COMMON, "--served-model-name", model]),
    }
    proxies: list[ProxyServer] = []
    try:
        pooled = server_pool.get("single", "p", "d_fail", "d_bidir")
        start_all(list(own.values()))
        servers = {**pooled, **own}
        pairs = {"2-1": ("p_tp2", "d_fail"), "1-2": ("p", "d_tp2"), "2-2": ("p_tp2", "d_tp2")}
        for name, (p, d) in pairs.items():
            proxies.append(ProxyServer([servers[p]], [servers[d]], logs / f"proxy-{name}.log"))
        proxies.append(ProxyServer([servers["p_tp2"]], [servers["d_bidir"]],
                                   logs / "proxy-bidir.log", ["--multi-turn"]))
        for proxy in proxies:
            proxy.wait_ready()
        yield {"model": model, **servers, "proxy": dict(zip([*pairs, "bidir"], proxies)),
               "pairs": pairs}
    finally:
        for proc in [*proxies, *own.values()]:
            proc.stop()


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def moved(m: dict[str, float]) -> tuple[float, float, float]:
    return (m.get("pdserve:prompt_tokens_transferred_total", 0.0),
            m.get("pdserve:prompt_tokens_computed_total", 0.0),
            m.get("pdserve:request_success_total", 0.0))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("pair", ["2-1", "1-2", "2-2"])
def test_proxy_output_equals_single_instance_and_kv_moved(cluster, pair, stream):
    p_name, d_name = cluster["pairs"][pair]
    d = cluster[d_name]
    length = 3 * B + 5
    seed = {"2-1": 1, "1-2": 2, "2-2": 3}[pair] * 10 + stream
    body = {"model": cluster["model"], "prompt": token_prompt(length, seed), "max_tokens": 8,
            "temperature": 0, "stream": stream}
    expected = generate(cluster["single"], "completions", dict(body, stream=False))
    assert expected["status"] == 200, expected
    before = moved(d.metrics())
    out = generate(cluster["proxy"][pair], "completions", body)
    assert out["status"] == 200, out
    assert out["text"] == expected["text"]
    after = moved(d.wait_metrics(lambda m: moved(m)[2] > before[2]))
    # P's first token comes with its params: D reads the whole prompt and computes none of it
    assert after[0] - before[0] == length
    assert after[1] - before[1] == 0
    cluster[p_name].wait_all_blocks_free(timeout_s=30)  # every P rank heard "done"


def test_chat_through_the_proxy_with_different_tp_sizes(cluster):
    body = {"model": cluster["model"], "max_tokens": 8, "temperature": 0,
            "messages": [{"role": "user", "content": "Name three harbour towns and their ships."}]}
    expected = generate(cluster["single"], "chat/completions", body)
    for pair in ("2-1", "1-2"):
        out = generate(cluster["proxy"][pair], "chat/completions", body)
        assert out["status"] == 200, out
        assert out["text"] == expected["text"], pair


def test_three_turn_bidirectional_chat_between_tp_2_and_tp_1(cluster):
    """P (TP 2) pulls the previous turns' KV from D (TP 1): turns 2 and 3 transfer at least the
    recompute threshold into P, and every answer equals the single instance's."""
    proxy, p = cluster["proxy"]["bidir"], cluster["p_tp2"]
    messages = [{"role": "system", "content": "You are a careful assistant. Answer every "
                 "question about the old harbour town, its ships and its lighthouse keepers."}]
    for k in range(1, 4):
        messages.append({"role": "user", "content": f"Question {k}: what happened in the "
                         f"harbour in year {1800 + 7 * k}, and who kept the lighthouse then?"})
        body = {"model": cluster["model"], "messages": messages, "max_tokens": 12,
                "temperature": 0, "ignore_eos": True, "conversation_id": "tp-bidir"}
        before = p.metrics()
        r = proxy.client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        n_prompt = data["usage"]["prompt_tokens"]
        after = p.wait_metrics(lambda m: m.get("pdserve:prompt_tokens_total", 0.0)
                               >= before.get("pdserve:prompt_tokens_total", 0.0) + n_prompt)
        pulled = (after.get("pdserve:prompt_tokens_transferred_total", 0.0)
                  - before.get("pdserve:prompt_tokens_transferred_total", 0.0))
        answer = data["choices"][0]["message"]["content"]
        single = dict(body)
        single.pop("conversation_id")
        expected = generate(cluster["single"], "chat/completions", single)
        assert answer == expected["text"], f"turn {k}"
        if k == 1:
            assert pulled == 0
        else:
            assert pulled >= THRESHOLD, f"turn {k}: P pulled {pulled} tokens from D"
        assert after.get("pdserve:nixl_num_failed_transfers", 0.0) == \
            before.get("pdserve:nixl_num_failed_transfers", 0.0)
        messages.append({"role": "assistant", "content": answer})


def test_kv_heads_mismatch_is_refused_at_the_handshake(cluster):
    """A prefiller of 4 KV heads (TP 1) and a decoder of 2 KV heads (TP 2) cannot exchange KV:
    the decode leg fails with a message naming both sides, and P's blocks are freed."""
    p, d = cluster["p_wide"], cluster["d_tp2"]
    body = {"model": cluster["model"], "prompt": token_prompt(2 * B, 99), "max_tokens": 4,
            "temperature": 0}
    params = prefill_leg(p, "completions", body)
    out = decode_leg(d, "completions", body, params)
    assert out["status"] != 200, out
    message = str(out["error"])
    assert "has TP 1 with 4 KV heads (4 per rank)" in message, message
    assert "has TP 2 with 2 KV heads (1 per rank)" in message, message
    p.wait_all_blocks_free(timeout_s=30)  # D's abort reached P by the side channel
