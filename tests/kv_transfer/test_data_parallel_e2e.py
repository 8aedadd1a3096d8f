"""End to end: data parallelism on one host (``pdserve serve --data-parallel-size 2``), alone and
as prefiller and decoder groups behind ``pdserve proxy --multi-turn``.

Processes: the session's oracle ``single``; P, two ranks, bidirectional and without its own
prefix cache (so history it does not compute was pulled from a decoder rank); D, two ranks,
bidirectional; the proxy. Each rank has its own side channel (``base + rank``) and engine id
(``<id>_dp<rank>``): a decoder that read from the wrong rank would be refused its lease claim, so
a transfer with no failure and no prompt token computed on D proves it read from the rank that
computed the prompt. The last test kills a rank of P.
"""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import BIDIR_TTL_S, HANDSHAKE_TIMEOUT_S, POOL_COMMON
from tests.support.servers import (
    EngineServer, ProxyServer, descendants, generate, nixl_config, start_all)
from tests.support.servers import prefill_leg, still_running, stop_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DP = ["--data-parallel-size", "2"]


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    logs = tmp_path_factory.mktemp("dp-logs")
    model = server_pool.model
    single = server_pool.get("single")["single"]
    p = EngineServer(model, logs / "p-dp2.log",
                     nixl_config("kv_producer", bidirectional_kv_xfer=True),
                     [*POOL_COMMON, "--no-enable-prefix-caching", *DP])
    d = EngineServer(model, logs / "d-dp2.log",
                     nixl_config("kv_consumer", bidirectional_kv_xfer=True,
                                 decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                 kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                     [*POOL_COMMON, *DP])
    proxy = None
    try:
        start_all([p, d])
        proxy = ProxyServer([p], [d], logs / "proxy-dp2.log", ["--multi-turn"])
        proxy.wait_ready()
        yield {"model": model, "single": single, "p": p, "d": d, "proxy": proxy}
    finally:
        if proxy is not None:
            proxy.stop()
        stop_together([p, d])


def rank_metrics(server: EngineServer) -> dict[tuple[str, str], float]:
    """``(metric, dp_rank) -> value`` of the samples labelled with a rank."""
    text = server.client.get("/metrics").text
    return {(s.name, s.labels["dp_rank"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples
            if "dp_rank" in s.labels}


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def completion(cluster, seed: int, n: int = 40) -> dict:
    return {"model": cluster["model"], "prompt": token_prompt(n, seed), "max_tokens": 8,
            "temperature": 0}


def single_text(cluster, body: dict, endpoint: str = "completions") -> str:
    out = generate(cluster["single"], endpoint, body)
    assert out["status"] == 200, out
    return out["text"]


def test_ranks_have_own_side_channels_and_share_the_load(cluster):
    p = cluster["p"]
    before = rank_metrics(p)
    total = p.metrics().get("pdserve:prompt_tokens_total", 0.0)
    bodies = [completion(cluster, seed) for seed in range(6)]
    with ThreadPoolExecutor(6) as pool:
        params = list(pool.map(lambda b: prefill_leg(p, "completions", b), bodies))
    base = p.side_channel_port
    assert {x["remote_port"] for x in params} == {base, base + 1}
    for x in params:  # each rank answers with its own side channel and engine id
        assert x["remote_engine_id"].endswith(f"_dp{x['remote_port'] - base}")
    assert len({x["remote_engine_id"] for x in params}) == 2
    p.wait_metrics(lambda m: m.get("pdserve:prompt_tokens_total", 0) >= total + 6 * 40)
    now = rank_metrics(p)
    for rank in ("0", "1"):  # both ranks computed prompts
        key = ("pdserve:prompt_tokens_total", rank)
        assert now[key] > before.get(key, 0.0)
    # and both were busy at once: greedy outputs of concurrent plain requests equal the oracle
    plain = [completion(cluster, 100 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda b: generate(p, "completions", b), plain))
    assert [o["text"] for o in outs] == [single_text(cluster, b) for b in plain]


def test_prefill_group_to_decode_group_reads_from_the_computing_rank(cluster):
    d = cluster["d"]
    proxy = cluster["proxy"]
    m0 = d.metrics()
    bodies = [completion(cluster, 200 + i, n=33 + i) for i in range(6)]
    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda b: proxy.client.post("/v1/completions", json=b), bodies))
    for r in outs:
        assert r.status_code == 200, r.text
    assert [r.json()["choices"][0]["text"] for r in outs] == [single_text(cluster, b)
                                                              for b in bodies]
    n_prompt = sum(len(b["prompt"]) for b in bodies)
    m1 = d.wait_metrics(lambda m: m.get("pdserve:prompt_tokens_total", 0)
                        >= m0.get("pdserve:prompt_tokens_total", 0) + n_prompt)
    delta = {k: m1.get(k, 0.0) - m0.get(k, 0.0) for k in (
        "pdserve:prompt_tokens_transferred_total", "pdserve:prompt_tokens_computed_total",
        "pdserve:nixl_xfer_time_seconds_count", "pdserve:nixl_num_failed_transfers")}
    assert delta["pdserve:nixl_xfer_time_seconds_count"] > 0
    assert delta["pdserve:nixl_num_failed_transfers"] == 0
    assert delta["pdserve:prompt_tokens_computed_total"] == 0  # nothing recomputed on D
    assert delta["pdserve:prompt_tokens_transferred_total"] == n_prompt
    per_rank = rank_metrics(d)
    assert all(per_rank[("pdserve:prompt_tokens_transferred_total", r)] > 0 for r in "01")


def test_multi_turn_chats_pull_history_from_decoder_ranks(cluster):
    proxy, p = cluster["proxy"], cluster["p"]
    histories = {f"dp-chat-{i}": [] for i in range(2)}
    pulled = 0.0
    for turn in range(3):
        before = p.metrics().get("pdserve:prompt_tokens_transferred_total", 0.0)
        requests = []
        for i, (cid, messages) in enumerate(histories.items()):
            messages.append({"role": "user", "content": (
                f"Conversation {i}, question {turn}: tell me about the harbour's ships, the "
                f"lighthouse keepers and the fishing families in the year {1800 + 9 * turn + i}.")})
            requests.append((cid, {"model": cluster["model"], "messages": list(messages),
                                   "max_tokens": 12, "temperature": 0, "ignore_eos": True}))
        with ThreadPoolExecutor(len(requests)) as pool:
            answers = list(pool.map(lambda cb: proxy.client.post(
                "/v1/chat/completions", json=dict(cb[1], conversation_id=cb[0])), requests))
        for (cid, body), r in zip(requests, answers):
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            assert text == single_text(cluster, body, "chat/completions")
            histories[cid].append({"role": "assistant", "content": text})
        if turn:
            after = p.wait_metrics(lambda m: m.get("pdserve:prompt_tokens_transferred_total",
                                                   0.0) > before)
            pulled += after["pdserve:prompt_tokens_transferred_total"] - before
    assert pulled > 0  # P (no prefix cache) pulled history from the decoder ranks


def test_killing_one_rank_stops_the_instance(cluster):
    p = cluster["p"]
    family = descendants(p.proc.pid)
    cores = [pid for pid in family if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
    assert len(cores) == 2
    os.kill(cores[1], signal.SIGKILL)
    assert p.proc.wait(timeout=120) != 0
    deadline = time.monotonic() + 30  # helpers such as the resource tracker exit by themselves
    while still_running(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(family) == []
