"""End to end on real engines (tiny model, CPU, NIXL): two prefillers and two decoders that
publish KV events, a single instance as the oracle, and a Redis server.

* ``--routing kv-aware`` (proxy in-process): the proxy hashes prompts exactly as the engines do;
  a second request sharing a long prefix goes to the prefiller that cached it (its computed-token
  counter grows by the suffix only); outputs equal the single instance; with the event stream
  gone, routing falls back to least-loaded without errors.
* ``--state-store redis`` (two proxy replicas, each fronting one prefiller, both decoders):
  turn 1 through A, turn 2 through B pulls the history from D; the same turn sent to both replicas
  at once hands D's params to exactly one; with Redis stopped, turns still succeed (recompute)
  and the failure is counted.
"""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import pytest

from pdserve.types.block_hash import block_hashes
from pdserve.router.config import ProxyConfig
from pdserve.router.proxy import start_proxy
from tests.support.ports import free_port
from tests.support.servers import (EngineServer, ProxyServer, RedisServer, greedy_chat_body,
                                   nixl_config, start_all, stop_together)

from tests.support.router_fakes import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

B = 16
COMMON = ["--block-size", str(B), "--num-gpu-blocks-override", "256", "--max-model-len", "1024"]
MAX_TOKENS = 8
PREFIX = ("The harbour town kept careful records of every ship that entered its port, of the "
          "cargo each one carried, of the captains and their crews, of the weather on the day of "
          "arrival and of the fees paid to the harbour master, and these records were kept in a "
          "stone building near the lighthouse for more than two hundred years. ")
SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")
COMPUTED = "pdserve:prompt_tokens_computed_total"
TRANSFERRED = "pdserve:prompt_tokens_transferred_total"


def events_args() -> list[str]:
    return ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-snapshot-endpoint", f"tcp://127.0.0.1:{free_port()}"]


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    tiny_llama_path = server_pool.model
    logs = tmp_path_factory.mktemp("kv-aware-logs")
    bidir = {"bidirectional_kv_xfer": True}
    servers: dict[str, EngineServer] = {}
    redis = None
    try:
        redis = RedisServer(logs / "redis.log")
        for name in ("p0", "p1"):
            servers[name] = EngineServer(tiny_llama_path, logs / f"{name}.log",
                                         nixl_config("kv_producer", **bidir),
                                         COMMON + events_args())
        for name in ("d0", "d1"):
            servers[name] = EngineServer(tiny_llama_path, logs / f"{name}.log",
                                         nixl_config("kv_consumer", decoder_kv_blocks_ttl=30.0,
                                                     **bidir), COMMON + events_args())
        server_pool.start("single")
        redis.wait_ready()
        start_all(list(servers.values()))  # readiness waits scale to the machine (tests/support/processes.py)
        # the oracle: the session's pooled plain instance (greedy outputs do not depend on the
        # number of KV blocks)
        single = server_pool.get("single")["single"]
        yield {"model": tiny_llama_path, "redis": redis, "logs": logs, "single": single,
               **servers}
    finally:
        stop_together([*servers.values(), *([redis] if redis is not None else [])])


def counters(cluster, names=("p0", "p1"), metric=COMPUTED) -> dict[str, float]:
    return {n: cluster[n].metrics().get(metric, 0.0) for n in names}


def wait_counted(cluster, name: str, before: float, metric: str = "pdserve:prompt_tokens_total",
                 timeout_s: float = 20.0) -> None:
    """Engines publish counters with their step outputs: wait until ``metric`` moved."""
    import time

    deadline = time.monotonic() + timeout_s
    while cluster[name].metrics().get(metric, 0.0) <= before:
        assert time.monotonic() < deadline, f"{name}: {metric} did not move"
        time.sleep(0.05)


def completion_body(cluster, prompt: str) -> dict:
    return {"model": cluster["model"], "prompt": prompt, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}


def chat_body(cluster, messages: list[dict], conversation_id: str | None = None) -> dict:
    return greedy_chat_body(cluster["model"], messages, MAX_TOKENS, conversation_id)


def single(cluster, path: str, body: dict) -> dict:
    r = httpx.post(cluster["single"].url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def answer(data: dict) -> str:
    choice = data["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.fixture
async def kv_proxy(cluster):
    config = ProxyConfig(host="127.0.0.1", port=0, routing="kv-aware", tokenizer=cluster["model"],
                         prefillers=(cluster["p0"].url, cluster["p1"].url),
                         decoders=(cluster["d0"].url, cluster["d1"].url))
    running = await start_proxy(config)
    try:
        router = running.proxy.kv_router
        await wait_until(lambda: router.live(config.prefillers + config.decoders), timeout=60)
        yield running
    finally:
        await running.close()


async def post(url: str, path: str, body: dict) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(url + path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def decisions(proxy, leg: str, reason: str) -> float:
    return proxy.metrics.registry.get_sample_value(
        "pdserve:proxy_routing_decisions_total", {"leg": leg, "reason": reason}) or 0.0


async def test_kv_aware_routes_a_shared_prefix_to_the_prefiller_that_cached_it(cluster, kv_proxy):
    proxy = kv_proxy.proxy
    router = proxy.kv_router
    tokenizer = router.tokenizer
    for path, body in (
            ("/v1/completions", completion_body(cluster, PREFIX + "What was kept in the tower?")),
            ("/v1/chat/completions", chat_body(cluster, [
                {"role": "system", "content": SYSTEM + " " + PREFIX},
                {"role": "user", "content": "Who kept the lighthouse?"}]))):
        endpoint = "completions" if path == "/v1/completions" else "chat_completions"
        hashes = block_hashes(tokenizer.token_ids(endpoint, body), B)
        assert len(hashes) >= 4
        before = counters(cluster)
        first = await post(kv_proxy.url, path, body)
        assert answer(first) == answer(single(cluster, path, body))
        await wait_until(lambda: any(v > before[n] for n, v in counters(cluster).items()),
                         timeout=20)
        grew = {n: v - before[n] for n, v in counters(cluster).items()}
        (served,) = [n for n, v in grew.items() if v > 0]
        # the proxy's hashes of the prompt are the engine's: all its full blocks show up cached
        index = router.indexes[cluster[served].url]
        await wait_until(lambda: index.hit_blocks(hashes) == len(hashes), timeout=20)
        other = "p1" if served == "p0" else "p0"
        assert router.indexes[cluster[other].url].hit_blocks(hashes) == 0

        # a second request sharing the prefix: to the same prefiller, which computes the rest only
        if endpoint == "completions":
            body2 = completion_body(cluster, PREFIX + "Which ships came in winter?")
        else:
            body2 = chat_body(cluster, [body["messages"][0],
                                        {"role": "user", "content": "Which ships came in winter?"}])
        n_prompt2 = len(tokenizer.token_ids(endpoint, body2))
        hits_before = decisions(proxy, "prefill", "kv_hit")
        before = counters(cluster)
        second = await post(kv_proxy.url, path, body2)
        assert answer(second) == answer(single(cluster, path, body2))
        assert decisions(proxy, "prefill", "kv_hit") == hits_before + 1
        wait_counted(cluster, served, before[served], COMPUTED)
        grew = {n: v - before[n] for n, v in counters(cluster).items()}
        assert grew[other] == 0, grew
        assert 0 < grew[served] <= n_prompt2 - len(hashes) * B + B, (grew, n_prompt2)


async def test_without_events_routing_falls_back_to_least_loaded(cluster, kv_proxy):
    proxy = kv_proxy.proxy
    await proxy.kv_router.stop_events()
    assert not proxy.kv_router.live((cluster["p0"].url,))
    before = decisions(proxy, "prefill", "no_events")
    prompts = [PREFIX + f"Question {i}: who sailed in year {1800 + i}?" for i in range(4)]
    results = await asyncio.gather(*(post(kv_proxy.url, "/v1/completions",
                                          completion_body(cluster, p)) for p in prompts))
    for prompt, data in zip(prompts, results):
        assert answer(data) == answer(single(cluster, "/v1/completions",
                                             completion_body(cluster, prompt)))
    assert decisions(proxy, "prefill", "no_events") == before + 4
    assert decisions(proxy, "decode", "no_events") >= 4


# ------------------------------------------------------------------ replicas sharing Redis
@pytest.fixture(scope="module")
def replicas(cluster):
    made = []
    try:
        for name, p in (("a", "p0"), ("b", "p1")):
            proxy = ProxyServer([cluster[p]], [cluster["d0"], cluster["d1"]],
                                cluster["logs"] / f"proxy-{name}.log",
                                ["--multi-turn", "--state-store", cluster["redis"].url])
            made.append(proxy)
            proxy.wait_ready()
        yield made
    finally:
        stop_together(made)


def proxy_metric(proxy: ProxyServer, name: str) -> float:
    total = 0.0
    for line in httpx.get(proxy.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name):
            total += float(line.rpartition(" ")[2])
    return total


def user(i: int) -> dict:
    return {"role": "user", "content": f"Question {i}: what happened in the harbour in year "
                                       f"{1800 + 7 * i}, and who kept the lighthouse then?"}


def turn(cluster, proxy: ProxyServer, messages: list[dict], conversation_id: str) -> str:
    r = httpx.post(proxy.url + "/v1/chat/completions",
                   json=chat_body(cluster, messages, conversation_id), timeout=120)
    assert r.status_code == 200, r.text
    text = answer(r.json())
    assert text == answer(single(cluster, "/v1/chat/completions", chat_body(cluster, messages)))
    return text


def test_turn_two_through_another_replica_pulls_the_history_from_d(cluster, replicas):
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}, user(1)]
    messages.append({"role": "assistant", "content": turn(cluster, a, messages, "conv-ab")})
    messages.append(user(2))
    before = counters(cluster, ("p1",), TRANSFERRED)["p1"]
    turn(cluster, b, messages, "conv-ab")  # through replica B, to p1, which never saw turn 1
    wait_counted(cluster, "p1", before, TRANSFERRED)
    assert proxy_metric(b, "pdserve:proxy_kv_params_forwarded_total") == 1


def test_racing_replicas_hand_d_blocks_to_exactly_one(cluster, replicas):
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}, user(3)]
    messages.append({"role": "assistant", "content": turn(cluster, a, messages, "conv-race")})
    messages.append(user(4))
    forwarded = [proxy_metric(p, "pdserve:proxy_kv_params_forwarded_total") for p in replicas]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: turn(cluster, p, messages, "conv-race"), replicas))
    assert answers[0] == answers[1]
    grew = [proxy_metric(p, "pdserve:proxy_kv_params_forwarded_total") - f
            for p, f in zip(replicas, forwarded)]
    assert sorted(grew) == [0, 1]


def test_redis_stopped_mid_run_turns_still_succeed(cluster, replicas):
    a, b = replicas
    messages = [{"role": "system", "content": SYSTEM}, user(5)]
    messages.append({"role": "assistant", "content": turn(cluster, a, messages, "conv-down")})
    messages.append(user(6))
    cluster["redis"].stop()
    forwarded = proxy_metric(b, "pdserve:proxy_kv_params_forwarded_total")
    turn(cluster, b, messages, "conv-down")  # recompute, same answer
    assert proxy_metric(b, "pdserve:proxy_state_store_errors_total") >= 1
    assert proxy_metric(b, "pdserve:proxy_kv_params_forwarded_total") == forwarded
