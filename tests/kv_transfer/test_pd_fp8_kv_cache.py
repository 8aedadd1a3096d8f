"""P/D with an fp8 KV cache (``--kv-cache-dtype fp8``) between real ``pdserve serve`` processes:
fp8 on both sides moves the fp8 blocks over NIXL and reproduces a single fp8 instance's greedy
output; a pair whose KV dtypes differ is refused at the handshake, with both dtypes named."""

from __future__ import annotations

import random

import pytest

from tests.support.servers import BLOCK_SIZE as B
from tests.support.servers import decode_leg, generate, prefill_leg

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster(server_pool):
    servers = server_pool.get("single_fp8", "p_fp8", "d_fp8", "p", "d_fail")
    return {**servers, "model": server_pool.model}


def body(cluster, length: int, seed: int) -> dict:
    rng = random.Random(seed)
    prompt = [rng.randrange(1000, 30000) for _ in range(length)]
    return {"model": cluster["model"], "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "stream": False}


def moved(m: dict[str, float]) -> tuple[float, float, float]:
    return (m.get("pdserve:prompt_tokens_transferred_total", 0.0),
            m.get("pdserve:prompt_tokens_computed_total", 0.0),
            m.get("pdserve:request_success_total", 0.0))


@pytest.mark.parametrize("length", [B + 1, 300])
def test_fp8_pair_equals_a_single_fp8_instance(cluster, length):
    p, d = cluster["p_fp8"], cluster["d_fp8"]
    req = body(cluster, length, seed=length)
    expected = generate(cluster["single_fp8"], "completions", req)
    assert expected["status"] == 200, expected
    before = moved(d.metrics())
    out = decode_leg(d, "completions", req, prefill_leg(p, "completions", req))
    assert out["status"] == 200, out
    assert out["text"] == expected["text"]
    after = moved(d.wait_metrics(lambda m: moved(m)[2] > before[2]))
    assert after[0] - before[0] == length  # the whole prompt's KV came from P, as fp8
    assert after[1] - before[1] == 0
    p.wait_all_blocks_free(timeout_s=10)


@pytest.mark.parametrize(("producer", "decoder"), [("p_fp8", "d_fail"), ("p", "d_fp8")],
                         ids=["fp8-to-auto", "auto-to-fp8"])
def test_pair_with_different_kv_dtypes_is_refused(cluster, producer, decoder):
    p, d = cluster[producer], cluster[decoder]
    req = body(cluster, 2 * B + 5, seed=len(producer) * 31)
    out = decode_leg(d, "completions", req, prefill_leg(p, "completions", req))
    assert out["status"] >= 500, out
    message = out["error"]["error"]["message"]
    assert "engine mismatch" in message and "dtype" in message, message
    assert "float8_e4m3fn" in message and "float32" in message, message
    p.wait_all_blocks_free(timeout_s=10)  # the failed handshake releases P's lease
