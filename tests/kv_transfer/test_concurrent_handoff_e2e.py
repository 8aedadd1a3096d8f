"""End to end: the concurrent hand-off (docs/proxy.md) between ``pdserve serve`` prefiller (P)
and decoder (D) processes, the test playing the router.

The decode leg is sent first, with pending params naming only P's side channel and a transfer
id; the prefill leg follows with the same transfer id. D admits the request and waits at P's side
channel; it reads the KV the moment P holds it. D's greedy output equals a single instance's,
D computes no prompt token, and both sides' blocks are free afterwards, also when the client
leaves D before P has prefilled.
"""

from __future__ import annotations

import concurrent.futures as cf
import random
import time
import uuid

import pytest

from tests.support.servers import BLOCK_SIZE as B
from tests.support.servers import generate

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster(server_pool):
    """The session's shared instances: ``single`` (the oracle), ``p`` and ``d_fail``."""
    return {**server_pool.get("single", "p", "d_fail"), "model": server_pool.model}


def token_prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 30000) for _ in range(n)]


def pending_params(p, transfer_id: str) -> dict:
    """The decode leg's params of the wire contract (no blocks, no request id, no token)."""
    engine_id = p.client.get("/pdserve/instance").json()["engine_id"]
    return {"do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": engine_id, "remote_host": "127.0.0.1",
            "remote_port": p.side_channel_port, "remote_transfer_id": transfer_id,
            "tp_size": 1}


def prefill_body(body: dict, transfer_id: str) -> dict:
    leg = dict(body, max_tokens=1, stream=False,
               kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False,
                                   "transfer_id": transfer_id})
    leg.pop("stream_options", None)
    return leg


def counters(m: dict[str, float]) -> dict[str, float]:
    return {"computed": m.get("pdserve:prompt_tokens_computed_total", 0.0),
            "transferred": m.get("pdserve:prompt_tokens_transferred_total", 0.0),
            "requests": m.get("pdserve:request_success_total", 0.0),
            "expired": m.get("pdserve:nixl_num_kv_expired_reqs", 0.0)}


def both_legs(cluster, endpoint: str, body: dict, delay_s: float = 0.2) -> tuple[dict, dict]:
    """D's leg first, P's ``delay_s`` later (D waits at P's side channel meanwhile)."""
    p, d = cluster["p"], cluster["d_fail"]
    transfer_id = uuid.uuid4().hex
    with cf.ThreadPoolExecutor(1) as pool:
        d_out = pool.submit(generate, d, endpoint,
                            dict(body, kv_transfer_params=pending_params(p, transfer_id)))
        time.sleep(delay_s)
        p_out = generate(p, endpoint, prefill_body(body, transfer_id))
        return p_out, d_out.result(timeout=120)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("length", [B + 1, 300])
def test_completions_through_the_concurrent_hand_off_equal_one_instance(cluster, length, stream):
    d = cluster["d_fail"]
    body = {"model": cluster["model"], "prompt": token_prompt(length, seed=7000 + length + stream),
            "max_tokens": 8, "temperature": 0, "stream": stream}
    expected = generate(cluster["single"], "completions", dict(body, stream=False))
    before = counters(d.metrics())
    p_out, d_out = both_legs(cluster, "completions", body)
    assert p_out["status"] == 200 and p_out["kv_transfer_params"]["do_remote_prefill"], p_out
    assert d_out["status"] == 200, d_out
    assert d_out["text"] == expected["text"]
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["computed"] - before["computed"] == 0  # D computed no prompt token
    assert after["transferred"] - before["transferred"] == length
    cluster["p"].wait_all_blocks_free(timeout_s=10)  # read done -> P's lease ends at once


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_chat_through_the_concurrent_hand_off_equals_one_instance(cluster, stream):
    d = cluster["d_fail"]
    body = {"model": cluster["model"], "max_tokens": 8, "temperature": 0, "stream": stream,
            "messages": [{"role": "user", "content": f"Concurrent hand-off {stream}: rivers?"}]}
    expected = generate(cluster["single"], "chat/completions", dict(body, stream=False))
    before = counters(d.metrics())
    _, d_out = both_legs(cluster, "chat/completions", body)
    assert d_out["status"] == 200 and d_out["text"] == expected["text"], d_out
    after = counters(d.wait_metrics(lambda m: counters(m)["requests"] > before["requests"]))
    assert after["computed"] - before["computed"] == 0
    cluster["p"].wait_all_blocks_free(timeout_s=10)


def test_a_client_gone_before_the_prefill_frees_both_sides(cluster):
    """The client leaves D while D waits for P: D frees its blocks and tells P by transfer id,
    so P's lease ends the moment P holds the blocks, not after its lease duration."""
    p, d = cluster["p"], cluster["d_fail"]
    transfer_id = uuid.uuid4().hex
    body = {"model": cluster["model"], "prompt": token_prompt(90, seed=7777), "max_tokens": 8,
            "temperature": 0, "stream": True}
    before_p = counters(p.metrics())
    with d.client.stream("POST", "/v1/completions",
                         json=dict(body, kv_transfer_params=pending_params(p, transfer_id))):
        d.wait_metrics(lambda m: m.get("pdserve:num_requests_running", 0)
                       + m.get("pdserve:num_requests_waiting", 0) >= 1)
    d.wait_all_blocks_free(timeout_s=10)
    time.sleep(0.5)  # D's abort by transfer id reaches P's side channel
    p_out = generate(p, "completions", prefill_body(body, transfer_id))
    assert p_out["status"] == 200, p_out
    m = p.wait_all_blocks_free(timeout_s=5)  # well before the 30 s lease
    assert counters(m)["expired"] == before_p["expired"]


def test_a_bad_transfer_id_is_a_400_on_both_legs(cluster):
    p, d = cluster["p"], cluster["d_fail"]
    body = {"model": cluster["model"], "prompt": "hello", "max_tokens": 2}
    for server, params in ((d, pending_params(p, "not a valid id!")),
                           (p, {"do_remote_decode": True, "transfer_id": 12})):
        out = generate(server, "completions", dict(body, kv_transfer_params=params))
        assert out["status"] == 400, out
        assert "transfer_id" in out["error"]["error"]["message"], out
    p.wait_all_blocks_free(timeout_s=10)
    d.wait_all_blocks_free(timeout_s=10)
