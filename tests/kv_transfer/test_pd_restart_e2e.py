"""End to end through ``pdserve proxy``: a restarted instance does not break its partners, and
work the decoder will refuse is not done (or kept) by the prefiller.

P runs with an explicit ``engine_id`` (as deployments set it) and a long lease; D has a shorter
``--max-model-len`` than P, so D refuses some requests that P accepts (the case where only D
can say no).
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from tests.support.servers import EngineServer, ProxyServer, nixl_config, start_all, stop_together

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

B = 16
COMMON = ["--block-size", str(B), "--num-gpu-blocks-override", "256"]
P_LEN, D_LEN = 1024, 512
LEASE_S = 120.0  # long: a block freed in a few seconds was freed by the release, not the lease
TRANSFERRED = "pdserve:prompt_tokens_transferred_total"
COMPUTED = "pdserve:prompt_tokens_computed_total"
RELEASED = "pdserve:kv_leases_released_early_total"
EXPIRED = "pdserve:nixl_num_kv_expired_reqs"


@pytest.fixture(scope="module")
def cluster(tiny_llama_path, tmp_path_factory):
    logs = tmp_path_factory.mktemp("pd-restart-logs")
    p_kv = dict(nixl_config("kv_producer", kv_lease_duration=LEASE_S), engine_id="p-fixed")
    servers = {
        "p": EngineServer(tiny_llama_path, logs / "p.log", p_kv, COMMON + ["--max-model-len", str(P_LEN)]),
        "d": EngineServer(tiny_llama_path, logs / "d.log", nixl_config("kv_consumer"),
                    COMMON + ["--max-model-len", str(D_LEN)]),
    }
    proxies: dict[str, ProxyServer] = {}
    try:
        start_all(list(servers.values()))
        for handoff in ("concurrent", "sequential"):
            proxies[handoff] = ProxyServer([servers["p"]], [servers["d"]],
                                           logs / f"proxy-{handoff}.log", ["--handoff", handoff])
        for proxy in proxies.values():
            proxy.wait_ready()
        yield {**servers, "proxy": proxies["concurrent"], "proxy_sequential": proxies["sequential"],
               "model": tiny_llama_path}
    finally:
        stop_together(list(proxies.values()))
        stop_together(list(servers.values()))


def ask(cluster, prompt_len: int, max_tokens: int = 4, seed: int = 0, proxy: str = "proxy",
        **extra) -> httpx.Response:
    prompt = [(seed * 7919 + i * 31) % 900 + 10 for i in range(prompt_len)]
    body = {"model": cluster["model"], "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, **extra}
    return httpx.post(cluster[proxy].url + "/v1/completions", json=body, timeout=300)


def restart(server: EngineServer, sig: signal.Signals) -> None:
    if sig == signal.SIGKILL:
        server.kill()
    else:
        server.proc.send_signal(sig)
        server.proc.wait(60)
    server.start_again()
    start_all([server])


def test_refused_by_both_is_not_prefilled(cluster):
    p = cluster["p"]
    before = p.metrics()[COMPUTED]
    for extra in ({"max_tokens": P_LEN}, {"max_tokens": 0}, {"max_tokens": 4, "min_tokens": 5}):
        r = ask(cluster, 40, **{"max_tokens": 4, **extra})
        assert r.status_code == 400, r.text
    assert p.metrics()[COMPUTED] == before


def test_refused_by_the_decoder_frees_prefiller_blocks_at_once(cluster):
    """Sequential hand-off: P has answered when D refuses, so the proxy releases P's lease."""
    p = cluster["p"]
    released0 = p.metrics().get(RELEASED, 0.0)
    t0 = time.monotonic()
    r = ask(cluster, 480, max_tokens=100, seed=1, proxy="proxy_sequential")  # fits P, not D
    assert r.status_code == 400, r.text
    p.wait_all_blocks_free(timeout_s=30)
    assert time.monotonic() - t0 < LEASE_S / 2
    assert p.metrics()[RELEASED] == released0 + 1


def test_refused_by_the_decoder_in_the_concurrent_hand_off_frees_prefiller_blocks_at_once(cluster):
    """Concurrent hand-off: D's refusal may come before or after P's answer; the proxy then
    closes P's leg (P aborts the request) or releases P's lease. Either way nothing waits for the
    lease to expire."""
    p = cluster["p"]
    expired0 = p.metrics().get(EXPIRED, 0.0)
    t0 = time.monotonic()
    r = ask(cluster, 480, max_tokens=100, seed=2)  # fits P (1024), not D (512)
    assert r.status_code == 400, r.text
    p.wait_all_blocks_free(timeout_s=30)
    assert time.monotonic() - t0 < LEASE_S / 2
    assert p.metrics().get(EXPIRED, 0.0) == expired0


@pytest.mark.parametrize("who,sig", [("p", signal.SIGKILL), ("p", signal.SIGTERM),
                                     ("d", signal.SIGKILL)])
def test_requests_after_a_restart_move_kv(cluster, who, sig):
    assert ask(cluster, 64, seed=2).status_code == 200  # the handshake is cached
    restart(cluster[who], sig)
    d = cluster["d"]
    for seed in (3, 4):  # no request after the restart may fail, and KV moves
        moved0 = d.metrics().get(TRANSFERRED, 0.0)
        r = ask(cluster, 64, seed=seed)
        assert r.status_code == 200, r.text
        assert d.metrics()[TRANSFERRED] > moved0
