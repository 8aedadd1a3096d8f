"""End to end on real engines (tiny random Llama, float32, CPU, NIXL): local prefill
(``--local-prefill-max-tokens N``, pdserve/router/local_prefill.py; docs/proxy.md, "Local prefill").

Processes: a prefiller P and a decoder D (both ``bidirectional_kv_xfer``, both publishing KV
events), and the session's pooled plain instance ``single`` as the oracle; the multi-turn proxy
runs in-process (its KV indexes and metrics are read directly).

* A 3-turn greedy chat (one ``conversation_id``): turn 1's long prompt goes through P; turns 2
  and 3 (a short user message each) find all but a few of their prompt tokens held by D, which
  prefills them itself: ``pdserve:proxy_local_prefills_total`` is 0 after turn 1 and 2 after
  turn 3, P receives turn 1 only (its ``pdserve:prompt_tokens_total`` and
  ``pdserve:request_success_total`` do not move on turns 2-3), D loads nothing over NIXL for
  them and computes at most N prompt tokens each; every answer equals the plain instance's.
* With D's KV events gone (the proxy's index of D not live), a later turn D holds goes through
  P again and is not counted.
"""

from __future__ import annotations

import httpx
import pytest

from pdserve.router.config import ProxyConfig
from pdserve.router.kv_routing import PromptBlocks
from pdserve.router.proxy import start_proxy
from tests.support.ports import free_port
from tests.support.router_fakes import wait_until
from tests.support.servers import (BIDIR_TTL_S, POOL_COMMON, EngineServer, greedy_chat_body,
                                   nixl_config, start_all, stop_together)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N = 64  # --local-prefill-max-tokens
MAX_TOKENS = 8
LOCAL = "pdserve:proxy_local_prefills_total"
PROMPT = "pdserve:prompt_tokens_total"
COMPUTED = "pdserve:prompt_tokens_computed_total"
TRANSFERRED = "pdserve:prompt_tokens_transferred_total"
SUCCESS = "pdserve:request_success_total"
SYSTEM = ("You are a careful assistant. Answer every question about the history of the old "
          "harbour town, its ships, its lighthouse keepers and its fishing families in detail.")
HISTORY = ("The harbour town kept careful records of every ship that entered its port, of the "
           "cargo each one carried, of the captains and their crews, of the weather on the day of "
           "arrival and of the fees paid to the harbour master, and these records were kept in a "
           "stone building near the lighthouse for more than two hundred years. ") * 3


def events_args() -> list[str]:
    return ["--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
            "--kv-events-snapshot-endpoint", f"tcp://127.0.0.1:{free_port()}"]


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    logs = tmp_path_factory.mktemp("local-prefill-logs")
    bidir = {"bidirectional_kv_xfer": True}
    servers: dict[str, EngineServer] = {}
    try:
        servers["p"] = EngineServer(server_pool.model, logs / "p.log",
                                    nixl_config("kv_producer", **bidir),
                                    POOL_COMMON + events_args())
        servers["d"] = EngineServer(server_pool.model, logs / "d.log",
                                    nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                                **bidir), POOL_COMMON + events_args())
        server_pool.start("single")  # boots beside P and D
        start_all(list(servers.values()))
        single = server_pool.get("single")["single"]
        yield {"model": server_pool.model, "single": single, **servers}
    finally:
        stop_together(list(servers.values()))


@pytest.fixture
async def proxy(cluster):
    config = ProxyConfig(host="127.0.0.1", port=0, multi_turn=True, tokenizer=cluster["model"],
                         local_prefill_max_tokens=N,
                         prefillers=(cluster["p"].url,), decoders=(cluster["d"].url,))
    running = await start_proxy(config)
    try:
        await wait_until(lambda: running.proxy.kv_router.live(config.decoders), timeout=60)
        yield running
    finally:
        await running.close()


def body(cluster, messages: list[dict], conversation_id: str | None = None) -> dict:
    return greedy_chat_body(cluster["model"], messages, MAX_TOKENS, conversation_id)


def local_prefills(running) -> float:
    return running.proxy.metrics.registry.get_sample_value(LOCAL) or 0.0


def counters(server: EngineServer) -> dict[str, float]:
    m = server.metrics()
    return {k: m.get(k, 0.0) for k in (PROMPT, COMPUTED, TRANSFERRED, SUCCESS)}


def oracle(cluster, messages: list[dict]) -> str:
    r = cluster["single"].client.post("/v1/chat/completions", json=body(cluster, messages))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


async def chat(running, cluster, messages: list[dict], conversation_id: str) -> dict:
    async with httpx.AsyncClient(timeout=120) as client:
        r = await client.post(running.url + "/v1/chat/completions",
                              json=body(cluster, messages, conversation_id))
    assert r.status_code == 200, r.text
    return r.json()


def counted(server: EngineServer, before: dict[str, float], n_prompt: int) -> dict[str, float]:
    """Waits until ``server`` counted a finished request of ``n_prompt`` more prompt tokens
    (engines publish counters with their step outputs); returns the change of its counters."""
    after = server.wait_metrics(lambda m: m.get(PROMPT, 0.0) >= before[PROMPT] + n_prompt
                                and m.get(SUCCESS, 0.0) >= before[SUCCESS] + 1)
    return {k: after.get(k, 0.0) - v for k, v in before.items()}


def p_barrier(cluster, before: dict[str, float]) -> dict[str, float]:
    """The change of P's counters since ``before``, once every request P got before now is
    counted: a plain request sent to P directly is counted after them (P counts in step order),
    and is taken out of the change."""
    r = cluster["p"].client.post("/v1/completions", json={
        "model": cluster["model"], "prompt": "barrier", "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    after = cluster["p"].wait_metrics(lambda m: m.get(PROMPT, 0.0) >= before[PROMPT] + n
                                      and m.get(SUCCESS, 0.0) >= before[SUCCESS] + 1)
    delta = {k: after.get(k, 0.0) - v for k, v in before.items()}
    delta[PROMPT] -= n
    delta[SUCCESS] -= 1
    return delta


async def wait_held(running, cluster, messages: list[dict]) -> int:
    """Waits until the proxy's index of D (from D's KV events, which trail its answer) holds all
    but at most N tokens of the next turn's prompt; returns how many it does not hold."""
    kv = running.proxy.kv_router
    d_up = running.proxy.decoders.get(cluster["d"].url)
    ids = kv.tokenizer.token_ids("chat_completions", body(cluster, messages))
    assert ids
    prompt = PromptBlocks(ids)

    def held() -> bool:
        uncached = kv.uncached_tokens(d_up, prompt)
        return uncached is not None and uncached <= N

    await wait_until(held, timeout=20)
    return kv.uncached_tokens(d_up, prompt)


async def test_later_turns_of_a_chat_are_prefilled_by_the_decoder(cluster, proxy):
    p, d = cluster["p"], cluster["d"]
    messages = [{"role": "system", "content": "Conversation A. " + SYSTEM},
                {"role": "user", "content": HISTORY + "What was kept in the stone building?"}]
    followups = ["Who kept it?", "And in winter?"]

    # turn 1: long, nothing held by D -> through P
    p0, d0 = counters(p), counters(d)
    data = await chat(proxy, cluster, messages, "conv-local")
    n1 = data["usage"]["prompt_tokens"]
    assert n1 > 3 * N
    assert local_prefills(proxy) == 0
    p_grew = counted(p, p0, n1)
    assert p_grew[PROMPT] == n1 and p_grew[SUCCESS] == 1, p_grew
    d_grew = counted(d, d0, n1)
    assert d_grew[TRANSFERRED] > 0, d_grew  # D loaded turn 1 from P
    answers = [data["choices"][0]["message"]["content"]]
    messages.append({"role": "assistant", "content": answers[-1]})

    # turns 2 and 3: short, D holds the rest -> D alone
    p1 = counters(p)
    for i, text in enumerate(followups):
        messages.append({"role": "user", "content": text})
        uncached = await wait_held(proxy, cluster, messages)
        d_before = counters(d)
        data = await chat(proxy, cluster, messages, "conv-local")
        n = data["usage"]["prompt_tokens"]
        assert local_prefills(proxy) == i + 1
        d_grew = counted(d, d_before, n)
        assert d_grew[TRANSFERRED] == 0, d_grew  # nothing loaded over NIXL
        assert 0 < d_grew[COMPUTED] <= uncached <= N, (d_grew, uncached)
        answers.append(data["choices"][0]["message"]["content"])
        messages.append({"role": "assistant", "content": answers[-1]})
    assert local_prefills(proxy) == 2
    p_grew = p_barrier(cluster, p1)
    assert p_grew[PROMPT] == 0 and p_grew[SUCCESS] == 0, p_grew  # P got turn 1 only

    # the same conversation on one plain instance: the same greedy answers
    expected = [oracle(cluster, messages[:2 + 2 * t]) for t in range(3)]
    assert answers == expected


async def test_without_live_kv_events_of_the_decoder_a_turn_goes_through_p(cluster, proxy):
    p = cluster["p"]
    # (a system message of its own: D holds nothing of this prompt, turn 1 goes through P)
    messages = [{"role": "system", "content": "Conversation B. " + SYSTEM},
                {"role": "user", "content": HISTORY + "Which ships came in winter?"}]
    data = await chat(proxy, cluster, messages, "conv-no-events")
    assert local_prefills(proxy) == 0
    messages += [{"role": "assistant", "content": data["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Who kept it?"}]
    await wait_held(proxy, cluster, messages)  # D holds it: local, were its events live
    kv = proxy.proxy.kv_router
    await kv.stop_events()
    assert not kv.live((cluster["d"].url,))

    before = counters(p)
    data = await chat(proxy, cluster, messages, "conv-no-events")
    assert local_prefills(proxy) == 0
    n = data["usage"]["prompt_tokens"]
    grew = counted(p, before, n)
    assert grew[PROMPT] == n and grew[SUCCESS] == 1, grew
    assert data["choices"][0]["message"]["content"] == oracle(cluster, messages)
