"""Multi-turn conversation store: TTL, D's remote_blocks_expiry_time, LRU bound."""

import pytest

from pdserve.router.conversations import ConversationStore


class Clock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(max_entries=10, ttl=480.0):
    mono, wall = Clock(1000.0), Clock(1_700_000_000.0)
    return ConversationStore(max_entries, ttl, clock=mono, wall_clock=wall), mono, wall


def test_get_returns_last_turn_and_expires_after_ttl():
    store, mono, wall = make(ttl=480)
    store.record_turn("c", "http://p", "http://d", {"remote_block_ids": [1]})
    mono.t += 479.9
    state = store.get("c")
    assert (state.prefiller_url, state.decoder_url, state.kv_transfer_params) == (
        "http://p", "http://d", {"remote_block_ids": [1]})
    mono.t += 0.1
    assert store.get("c") is None and len(store) == 0


def test_remote_blocks_expiry_time_drops_params_before_ttl_but_keeps_routing():
    store, mono, wall = make(ttl=480)
    store.record_turn("c", "http://p", "http://d",
                      {"remote_block_ids": [1], "remote_blocks_expiry_time": wall.t + 60})
    mono.t += 59
    wall.t += 59
    assert store.get("c").kv_transfer_params is not None
    mono.t += 1
    wall.t += 1
    state = store.get("c")
    assert state.kv_transfer_params is None and state.decoder_url == "http://d"


def test_params_are_taken_once_and_a_turn_without_params_leaves_none():
    store, mono, wall = make(ttl=100)
    store.record_turn("c", "p", "d1", {"remote_block_ids": [1]})
    taken = store.take("c")
    assert taken.kv_transfer_params == {"remote_block_ids": [1]} and taken.decoder_url == "d1"
    again = store.take("c")  # taken: the routing stays
    assert again.kv_transfer_params is None and again.decoder_url == "d1"
    assert store.take("unknown") is None
    store.record_turn("c", "p", "d1", {"remote_block_ids": [2]})
    mono.t += 50
    store.record_turn("c", "p", "d2", None)  # never taken, still replaced
    state = store.get("c")
    assert state.kv_transfer_params is None and state.decoder_url == "d2"


def test_lru_bound_drops_least_recently_used():
    store, mono, wall = make(max_entries=2)
    store.record_turn("a", "p", "d", {"x": 1})
    store.record_turn("b", "p", "d", {"x": 2})
    assert store.get("a") is not None  # a is now more recent than b
    store.record_turn("c", "p", "d", {"x": 3})
    assert len(store) == 2
    assert store.get("b") is None
    assert store.get("a").kv_transfer_params == {"x": 1}
    assert store.get("c").kv_transfer_params == {"x": 3}


def test_expired_entries_at_cold_end_are_purged_on_insert():
    store, mono, wall = make(ttl=10)
    store.record_turn("old", "p", "d", None)
    mono.t += 11
    store.record_turn("new", "p", "d", None)
    assert len(store) == 1


@pytest.mark.parametrize("max_entries,ttl", [(0, 1.0), (1, 0.0)])
def test_bad_bounds(max_entries, ttl):
    with pytest.raises(ValueError):
        ConversationStore(max_entries, ttl)
