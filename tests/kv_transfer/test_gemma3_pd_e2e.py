"""End to end on the tiny random Gemma 3 (a sliding window of 8 tokens, shorter than every
prompt here): P/D through ``pdserve proxy --multi-turn`` equals a single instance, for a plain
completion and for a three-turn chat whose history P pulls back from D (bidirectional transfer,
docs/architecture.md, "Multi-turn: bidirectional transfer").

Three engines (the oracle, a bidirectional P and D) and one proxy, started for this module only
and stopped at its end.
"""

from __future__ import annotations

import random

import pytest

from servers import BIDIR_TTL_S, POOL_COMMON, EngineServer, ProxyServer, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 12
SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")


@pytest.fixture(scope="module")
def cluster(tiny_gemma3_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("gemma3-pd-logs")
    single = EngineServer(tiny_gemma3_path, logs / "single.log", None, list(POOL_COMMON))
    p = EngineServer(tiny_gemma3_path, logs / "p.log",
                     nixl_config("kv_producer", bidirectional_kv_xfer=True),
                     [*POOL_COMMON, "--no-enable-prefix-caching"])
    d = EngineServer(tiny_gemma3_path, logs / "d.log",
                     nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                 bidirectional_kv_xfer=True), list(POOL_COMMON))
    servers = [single, p, d]
    proxy = None
    try:
        start_all(servers)
        proxy = ProxyServer([p], [d], logs / "proxy.log", ["--multi-turn"])
        proxy.wait_ready()
        yield {"model": tiny_gemma3_path, "single": single, "p": p, "d": d, "proxy": proxy}
    finally:
        for proc in ([proxy] if proxy is not None else []) + servers:
            proc.stop()


_COUNTERS = ("pdserve:prompt_tokens_total", "pdserve:prompt_tokens_transferred_total")


def _post(server, endpoint: str, body: dict) -> dict:
    r = server.client.post(f"/v1/{endpoint}", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_through_proxy_equals_single(cluster):
    rng = random.Random(3)
    prompt = [rng.randrange(1000, 30000) for _ in range(45)]
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}
    expected = _post(cluster["single"], "completions", body)["choices"][0]["text"]
    got = _post(cluster["proxy"], "completions", body)["choices"][0]["text"]
    assert got == expected


def test_three_turn_chat_through_proxy_equals_single(cluster):
    messages = [{"role": "system", "content": SYSTEM}]
    for k in range(1, 4):
        messages.append({"role": "user", "content": f"Question {k}: what happened in the "
                                                    f"harbour in year {1800 + 7 * k}?"})
        body = {"model": cluster["model"], "messages": messages, "max_tokens": MAX_TOKENS,
                "temperature": 0, "ignore_eos": True}
        expected = _post(cluster["single"], "chat/completions", body)
        before = {k_: cluster["p"].metrics().get(k_, 0.0) for k_ in _COUNTERS}
        got = _post(cluster["proxy"], "chat/completions", dict(body, conversation_id="g3"))
        answer = got["choices"][0]["message"]["content"]
        assert answer == expected["choices"][0]["message"]["content"], f"turn {k}"
        n_prompt = got["usage"]["prompt_tokens"]
        # P's counters are published with its last output: wait until this prompt is counted
        after = cluster["p"].wait_metrics(
            lambda m: m.get(_COUNTERS[0], 0.0) >= before[_COUNTERS[0]] + n_prompt)
        pulled = after.get(_COUNTERS[1], 0.0) - before[_COUNTERS[1]]
        if k > 1:  # the history (longer than the window) came back from D
            assert pulled >= 64, f"turn {k}: P pulled {pulled} of {n_prompt} prompt tokens"
        messages.append({"role": "assistant", "content": answer})
