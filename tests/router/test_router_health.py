"""The per-instance circuit breaker's state machine and its probes (pdserve/router/health.py)."""

import asyncio

from prometheus_client import CollectorRegistry, Gauge

from pdserve.router.health import BreakerPolicy, BreakerState, CircuitBreaker, UpstreamHealth
from pdserve.router.upstreams import Upstream, UpstreamPool


def test_opens_after_consecutive_failures_only():
    b = CircuitBreaker(BreakerPolicy(failure_threshold=3, backoff=1.0, max_backoff=4.0))
    assert not b.failure() and not b.failure()
    b.success()  # the run is broken: counting starts again
    assert not b.failure() and not b.failure() and b.state is BreakerState.CLOSED
    assert b.failure() and b.state is BreakerState.OPEN and not b.in_rotation
    assert not b.failure()  # already open: no second probe scheduled


def test_probe_and_trial_request_decide_with_doubling_backoff():
    b = CircuitBreaker(BreakerPolicy(failure_threshold=1, backoff=1.0, max_backoff=4.0))
    b.failure()
    assert b.probed(False) and b.backoff == 2.0 and b.state is BreakerState.OPEN
    assert not b.probed(True) and b.state is BreakerState.HALF_OPEN and b.in_rotation
    assert b.failure() and b.state is BreakerState.OPEN and b.backoff == 4.0  # trial failed
    assert b.probed(False) and b.backoff == 4.0  # capped
    b.probed(True)
    assert b.success() and b.state is BreakerState.CLOSED and b.backoff == 1.0


def test_zero_threshold_never_opens():
    b = CircuitBreaker(BreakerPolicy(failure_threshold=0))
    for _ in range(100):
        assert not b.failure()
    assert b.in_rotation


async def test_health_probes_an_open_instance_back_and_routing_skips_it_meanwhile():
    answers = {"http://a:1": [False, True], "http://b:2": [False] * 100}
    probed = []

    async def probe(up):
        probed.append(up.url)
        return answers[up.url].pop(0)

    gauge = Gauge("g", "g", ["upstream", "leg"], registry=CollectorRegistry())
    health = None
    pool = UpstreamPool("prefill", ["http://a:1", "http://b:2"], "round-robin",
                        available=lambda u: health.in_rotation(u), panic=False)
    a, b = pool.upstreams
    health = UpstreamHealth(pool.upstreams, BreakerPolicy(1, 0.02), probe, gauge)
    health.failure(a)
    assert gauge.labels(upstream=a.url, leg="prefill")._value.get() == 0
    assert [pool.order(), pool.order()] == [[b], [b]]
    health.failure(b)
    assert pool.order() == []  # the prefill pool has no panic mode: the proxy falls back
    await asyncio.sleep(0.2)
    assert probed.count(a.url) == 2 and health.breaker(a).state is BreakerState.HALF_OPEN
    assert gauge.labels(upstream=a.url, leg="prefill")._value.get() == 1
    assert pool.order() == [a]
    health.success(a)
    assert health.breaker(a).state is BreakerState.CLOSED
    await health.close()  # b's pending probe is cancelled
    assert health.breaker(b).state is BreakerState.OPEN


def test_decode_pool_orders_everyone_when_all_are_out():
    pool = UpstreamPool("decode", ["http://a:1", "http://b:2"], "round-robin",
                        available=lambda u: False)
    assert sorted(u.url for u in pool.order()) == ["http://a:1", "http://b:2"]
    assert Upstream("http://a:1", "decode").in_flight == 0
