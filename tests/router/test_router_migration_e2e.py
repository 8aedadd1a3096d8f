"""Mid-stream migration with real processes: a bidirectional prefiller, two decoders and
``pdserve proxy --multi-turn --migration-limit 2`` on the tiny Llama. The decoder serving a
stream is SIGKILLed after a few chunks; the client's stream must complete token-identical to one
plain instance's greedy answer (every token id once, in order), for chat and completions, and a
migrated turn's conversation must go on pulling its KV from the decoder that finished it. No
block stays held on any instance."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.servers import BIDIR_TTL_S, POOL_COMMON, EngineServer, ProxyServer
from tests.support.servers import nixl_config, start_all, stop_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MAX_TOKENS = 200  # long enough that the kill lands mid-stream on the CPU machine
RUNNING = "pdserve:num_requests_running"
WAITING = "pdserve:num_requests_waiting"
SYSTEM = ("You are a careful assistant. Answer every question about the rivers of the old "
          "valley, their bridges, their mills, the boats on them and the families who lived on "
          "their banks in detail, with names, years and places, and never in fewer than three "
          "paragraphs.")


@pytest.fixture(scope="module")
def cluster(server_pool, tmp_path_factory):
    """The pool's oracle ``single`` and bidirectional producer ``p_bidir``; two decoders of
    this module (killed and started again by the tests) and the migrating proxy."""
    pooled = server_pool.get("single", "p_bidir")
    logs = tmp_path_factory.mktemp("migration-logs")
    decoders = [EngineServer(server_pool.model, logs / f"d{i}.log",
                             nixl_config("kv_consumer", decoder_kv_blocks_ttl=BIDIR_TTL_S,
                                         bidirectional_kv_xfer=True), list(POOL_COMMON))
                for i in range(2)]
    start_all(decoders)
    proxy = ProxyServer([pooled["p_bidir"]], decoders, logs / "proxy.log",
                        ["--multi-turn", "--migration-limit", "2"])
    proxy.wait_ready()
    yield {"single": pooled["single"], "p": pooled["p_bidir"], "decoders": decoders,
           "proxy": proxy}
    stop_together([proxy, *decoders])


def oracle(cluster, path: str, body: dict) -> tuple[list[int], int]:
    """One plain instance's greedy token ids and prompt length for ``body``."""
    plain = {k: v for k, v in body.items() if k not in ("stream_options", "conversation_id")}
    r = cluster["single"].client.post(path, json=dict(plain, stream=False, return_token_ids=True))
    assert r.status_code == 200, r.text
    answer = r.json()
    return answer["choices"][0]["token_ids"], answer["usage"]["prompt_tokens"]


def serving(decoders: list[EngineServer]) -> EngineServer:
    """The decoder that holds the one request in flight (running, or waiting for its KV)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for d in decoders:
            m = d.metrics()
            if m.get(RUNNING, 0) + m.get(WAITING, 0) > 0:
                return d
        time.sleep(0.02)
    raise AssertionError("no decoder is serving the request")


def stream_killing_its_decoder(cluster, path: str, body: dict) -> tuple[list[dict], EngineServer]:
    """Stream ``body`` through the proxy, SIGKILL the serving decoder after 4 chunks, restart it
    once the stream is over. Returns the events (``[DONE]`` last, as the string) and the killed
    decoder."""
    events: list = []
    killed = None
    with httpx.Client(base_url=cluster["proxy"].url, timeout=300) as client:
        with client.stream("POST", path, json=dict(body, stream=True)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                events.append(data if data == "[DONE]" else json.loads(data))
                if killed is None and len(events) == 4:
                    killed = serving(cluster["decoders"])
                    killed.kill()
    assert killed is not None
    killed.start_again()
    killed.wait_ready()
    return events, killed


def token_ids(events: list) -> list[int]:
    return [t for e in events if isinstance(e, dict) and e.get("choices")
            for t in e["choices"][0]["token_ids"]]


def check_one_answer(events: list, expected: tuple[list[int], int]) -> None:
    ids, prompt_len = expected
    assert events[-1] == "[DONE]"
    assert not any("error" in e for e in events[:-1]), events[-2]
    assert token_ids(events) == ids  # no token lost or repeated
    assert len({e["id"] for e in events[:-1]}) == 1
    assert events[-2]["usage"]["completion_tokens"] == len(ids)
    assert events[-2]["usage"]["prompt_tokens"] == prompt_len


def no_block_held(cluster) -> None:
    cluster["p"].wait_all_blocks_free(timeout_s=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_killed_decoder_stream_completes_identically(cluster, path):
    body = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True}}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "Tell me a long story about rivers."}]
    else:
        body["prompt"] = "Once upon a time, in a valley between two mountains,"
    expected = oracle(cluster, path, body)
    before = cluster["proxy"].client.get("/metrics").text
    events, _ = stream_killing_its_decoder(cluster, path, body)
    check_one_answer(events, expected)
    after = cluster["proxy"].client.get("/metrics").text
    assert _migrations(after) == _migrations(before) + 1
    if "chat" in path:
        assert sum(1 for e in events[:-1] if e["choices"] and "role" in e["choices"][0]["delta"]) == 1
    no_block_held(cluster)
    for d in cluster["decoders"]:  # no conversation: the proxy released D's blocks at once
        d.wait_all_blocks_free(timeout_s=60)


def test_migrated_turn_of_a_conversation_keeps_reusing_kv(cluster):
    # a history long enough that P pulls it (the bidirectional pull threshold is 64 tokens)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "Name three rivers and describe them at length."}]
    body = {"messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream_options": {"include_usage": True},
            "conversation_id": "migrated-conversation"}
    expected = oracle(cluster, "/v1/chat/completions", body)
    events, _ = stream_killing_its_decoder(cluster, "/v1/chat/completions", body)
    check_one_answer(events, expected)
    answer = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]
                     if e["choices"])
    turn2 = dict({k: v for k, v in body.items() if k != "stream_options"}, max_tokens=8,
                 messages=messages + [
        {"role": "assistant", "content": answer}, {"role": "user", "content": "And a fourth?"}])
    transferred = "pdserve:prompt_tokens_transferred_total"
    before = cluster["p"].metrics().get(transferred, 0.0)
    r = cluster["proxy"].client.post("/v1/chat/completions", json=dict(turn2, stream=False))
    assert r.status_code == 200, r.text
    # P pulled the history from the decoder that finished the migrated turn (P's counters are
    # published with its last output: waited for)
    cluster["p"].wait_metrics(lambda m: m.get(transferred, 0.0) > before)
    assert r.json()["choices"][0]["token_ids"] == oracle(cluster, "/v1/chat/completions",
                                                         turn2)[0]
    no_block_held(cluster)


def _migrations(metrics_text: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in metrics_text.splitlines()
               if line.startswith("pdserve:proxy_migrations_total"))
