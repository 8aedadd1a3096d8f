"""Multi-host end to end, with network namespaces as hosts (``tests/support/netns.py``).

Hosts ``p``, ``d`` and ``x``, each its own namespace with its own address on a bridge: P runs
in ``p``, D in ``d``, the proxy in ``x``; each side channel is advertised on its host's address
(``PDSERVE_NIXL_SIDE_CHANNEL_HOST``) and KV moves between the namespaces over UCX's TCP
transport (``UCX_TLS=tcp``). A data-parallel group spans ``p`` (the head, rank 0) and ``d`` (a
``--headless`` host, rank 1). Skipped, with the reason, where ``ip netns`` cannot be used (it
needs root); the namespaces are deleted by a finalizer also when a test fails.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.netns import Hosts, NetnsUnavailable
from tests.support.ports import free_port
from tests.support.processes import Process
from tests.support.servers import HANDSHAKE_TIMEOUT_S, POOL_COMMON
from tests.support.servers import EngineServer, ProxyServer, decode_leg, descendants, generate
from tests.support.servers import nixl_config, prefill_leg, start_all, still_running, stop_together
from tests.support.servers import wait_progressing

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

UCX_TCP = {"UCX_TLS": "tcp"}


@pytest.fixture(scope="module")
def hosts(request):
    try:
        made = Hosts(["p", "d", "x"])
    except NetnsUnavailable as e:
        pytest.skip(f"network namespaces are unavailable here ({e}); these tests need root "
                    "and 'ip netns'")
    request.addfinalizer(made.close)
    return made


@pytest.fixture(scope="module")
def base(hosts, server_pool, tmp_path_factory):
    """The model, the oracle ``single`` (in the test's own namespace) and a log directory."""
    return {"model": server_pool.model, "single": server_pool.get("single")["single"],
            "logs": tmp_path_factory.mktemp("netns-logs")}


@pytest.fixture(scope="module")
def cluster(hosts, base):
    """P on host ``p``, D on host ``d``, the proxy on host ``x``."""
    model, logs = base["model"], base["logs"]
    p = EngineServer(model, logs / "p.log", nixl_config("kv_producer"), list(POOL_COMMON),
                     host=hosts.address["p"], netns=hosts.netns["p"], env=UCX_TCP)
    d = EngineServer(model, logs / "d.log",
                     nixl_config("kv_consumer", kv_handshake_timeout=HANDSHAKE_TIMEOUT_S),
                     list(POOL_COMMON), host=hosts.address["d"], netns=hosts.netns["d"],
                     env=UCX_TCP)
    proxy = None
    try:
        start_all([p, d])
        proxy = ProxyServer([p], [d], logs / "proxy.log", host=hosts.address["x"],
                            netns=hosts.netns["x"])
        proxy.wait_ready()
        yield {**base, "p": p, "d": d, "proxy": proxy}
    finally:
        if proxy is not None:
            proxy.stop()
        stop_together([p, d])


def completion(cluster, i: int) -> dict:
    return {"model": cluster["model"], "prompt": f"Host {i}: the lighthouse keeper's log " * 5,
            "max_tokens": 8, "temperature": 0}


def test_pd_across_hosts_moves_kv_over_tcp(cluster, hosts):
    d = cluster["d"]
    body = completion(cluster, 0)
    expected = generate(cluster["single"], "completions", body)["text"]
    before = d.metrics()
    r = cluster["proxy"].client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == expected
    after = d.wait_metrics(lambda m: m.get("pdserve:request_success_total", 0)
                           > before.get("pdserve:request_success_total", 0))
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in (
        "pdserve:nixl_xfer_time_seconds_count", "pdserve:nixl_num_failed_transfers",
        "pdserve:prompt_tokens_computed_total", "pdserve:prompt_tokens_transferred_total")}
    assert delta["pdserve:nixl_xfer_time_seconds_count"] > 0
    assert delta["pdserve:nixl_num_failed_transfers"] == 0
    assert delta["pdserve:prompt_tokens_computed_total"] == 0
    assert delta["pdserve:prompt_tokens_transferred_total"] > 0
    # D read from P's address on the other host, by NIXL (not a same-host shortcut)
    params = prefill_leg(cluster["p"], "completions", completion(cluster, 1))
    assert params["remote_host"] == hosts.address["p"]
    text = d.client.get("/metrics").text
    paths = [s.labels for fam in text_string_to_metric_families(text) for s in fam.samples
             if s.name == "pdserve:kv_transfer_path_info"]
    assert paths and all(p["transport"] == "nixl" for p in paths)


def test_peer_advertising_localhost_fails_fast_naming_the_setting(cluster):
    body = completion(cluster, 2)
    params = prefill_leg(cluster["p"], "completions", body)
    params["remote_host"] = "localhost"  # what P says when PDSERVE_NIXL_SIDE_CHANNEL_HOST is unset
    start = time.monotonic()
    out = decode_leg(cluster["d"], "completions", body, params)
    elapsed = time.monotonic() - start
    assert out["status"] != 200, out
    assert "PDSERVE_NIXL_SIDE_CHANNEL_HOST" in str(out["error"]), out
    assert elapsed < 2 * HANDSHAKE_TIMEOUT_S + 10


def _headless(base, hosts, rank_host: str, head_address: str, rpc_port: int,
              extra: list[str] = ()) -> Process:
    cmd = ["ip", "netns", "exec", hosts.netns[rank_host], sys.executable, "-m", "pdserve.cli",
           "serve", base["model"], "--headless", "--data-parallel-size", "2",
           "--data-parallel-size-local", "1", "--data-parallel-start-rank", "1",
           "--data-parallel-address", head_address, "--data-parallel-rpc-port", str(rpc_port),
           *POOL_COMMON, *extra]
    return Process(cmd, base["logs"] / f"headless-{rpc_port}.log")


def _group(base, hosts, name: str) -> tuple[EngineServer, Process]:
    """A DP group of two ranks: the head (rank 0) on host ``p``, a headless rank 1 on ``d``;
    returns once the head is healthy (both ranks ready)."""
    rpc_port = free_port()
    head = EngineServer(base["model"], base["logs"] / f"{name}-head.log", None,
                        [*POOL_COMMON, "--data-parallel-size", "2",
                         "--data-parallel-size-local", "1",
                         "--data-parallel-address", hosts.address["p"],
                         "--data-parallel-rpc-port", str(rpc_port)],
                        host=hosts.address["p"], netns=hosts.netns["p"])
    rank1 = _headless(base, hosts, "d", hosts.address["p"], rpc_port)
    try:
        wait_progressing(head.is_ready, [head, rank1], "data-parallel head and headless rank")
    except BaseException:
        head.stop()
        rank1.stop()
        raise
    return head, rank1


def _wait_gone(family: dict[int, int]) -> None:
    deadline = time.monotonic() + 30  # helpers such as the resource tracker exit by themselves
    while still_running(family) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert still_running(family) == []


def test_multi_host_data_parallel_group_serves_on_both_ranks_and_stops_when_one_dies(base, hosts):
    head, rank1 = _group(base, hosts, "group")
    try:
        family = {**descendants(head.proc.pid), **descendants(rank1.proc.pid)}
        bodies = [completion(base, 10 + i) for i in range(4)]
        expected = [generate(base["single"], "completions", b)["text"] for b in bodies]
        with ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(lambda b: generate(head, "completions", b), bodies))
        assert [o["text"] for o in outs] == expected
        text = head.client.get("/metrics").text
        served = {s.labels["dp_rank"]: s.value for fam in text_string_to_metric_families(text)
                  for s in fam.samples if s.name == "pdserve:prompt_tokens_total"}
        assert served.get("0", 0) > 0 and served.get("1", 0) > 0, served
        # the remote rank's engine core dies: its host exits at once, the head notices the
        # silence (no heartbeats), reports the rank and exits non-zero; nothing is left
        core = [pid for pid in descendants(rank1.proc.pid)
                if "spawn_main" in open(f"/proc/{pid}/cmdline").read()]
        assert len(core) == 1
        os.kill(core[0], signal.SIGKILL)
        assert rank1.proc.wait(timeout=60) == 1
        assert head.proc.wait(timeout=120) != 0
        assert "data-parallel rank 1 sent nothing" in head.log_text(), head.log_tail()
        _wait_gone(family)
    finally:
        head.stop()
        rank1.stop()


def test_headless_host_that_cannot_reach_the_head_fails_fast(base, hosts):
    unreachable = hosts.address["p"].rsplit(".", 1)[0] + ".77"  # no host has this address
    rank1 = _headless(base, hosts, "d", unreachable, free_port(),
                      ["--data-parallel-join-timeout", "2"])
    try:
        assert rank1.proc.wait(timeout=120) == 1
        log = rank1.log_text()
        assert "--data-parallel-address" in log and unreachable in log, log
    finally:
        rank1.stop()
