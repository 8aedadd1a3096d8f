"""Instance selection: round-robin, least-loaded, preferred instance, cool-down after refusal."""

from pdserve.router.upstreams import COOL_DOWN_S, UpstreamPool


def urls(order):
    return [u.url for u in order]


def test_round_robin_rotates():
    pool = UpstreamPool("decode", ["a", "b", "c"], "round-robin")
    firsts = [pool.order()[0].url for _ in range(6)]
    assert firsts == ["a", "b", "c", "a", "b", "c"]
    assert urls(pool.order()) == ["a", "b", "c"]


def test_least_loaded_picks_fewest_in_flight_ties_round_robin():
    pool = UpstreamPool("decode", ["a", "b", "c"], "least-loaded")
    a, b, c = pool.upstreams
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert urls(pool.order()) == ["b", "c", "a"]
    a.in_flight = b.in_flight = c.in_flight = 0
    assert [pool.order()[0].url for _ in range(3)] == ["b", "c", "a"]


def test_preferred_goes_first_unless_cooling_down():
    t = [100.0]
    pool = UpstreamPool("decode", ["a", "b"], "least-loaded", clock=lambda: t[0])
    a, b = pool.upstreams
    b.in_flight = 5
    assert pool.order(preferred=b)[0] is b
    pool.mark_down(b)
    assert urls(pool.order(preferred=b)) == ["a", "b"]
    t[0] += COOL_DOWN_S
    assert pool.order(preferred=b)[0] is b


def test_cooling_down_instances_are_tried_last():
    t = [0.0]
    pool = UpstreamPool("prefill", ["a", "b", "c"], "round-robin", clock=lambda: t[0])
    pool.mark_down(pool.upstreams[0])
    assert [urls(pool.order()) for _ in range(3)] == [["b", "c", "a"], ["b", "c", "a"], ["c", "b", "a"]]
    pool.mark_up(pool.upstreams[0])
    assert urls(pool.order()) == ["a", "b", "c"]
