"""Notices across TP ranks: "done" notifications carry how many an owner rank waits for
(pdserve/kv_transfer/nixl/notifications.py) and a lease ends after that many, or at the first
"abort", also when they arrive before the lease (pdserve/kv_transfer/nixl/leases.py)."""

from __future__ import annotations

from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseTable
from pdserve.kv_transfer.nixl.notifications import Notice, decode_notif, encode_notif
from pdserve.kv_transfer.nixl.side_channel import rank_info


def test_notification_round_trip_and_the_tp_1_form():
    assert decode_notif(encode_notif("done", "r|1", 3)) == Notice("done", "r|1", 3)
    assert decode_notif(encode_notif("heartbeat", "r", 1, [4, 5])) == Notice("heartbeat", "r",
                                                                             1, [4, 5])
    assert decode_notif(b"pdserve1|abort|req-7") == Notice("abort", "req-7")
    for bad in (b"other", b"pdserve2|\x00", encode_notif("done", "r", 0),
                encode_notif("bogus", "r"), b"pdserve1|release|r",
                encode_notif("release", "r", 1, [4, 5])):  # the proxy's release: not a notice
        assert decode_notif(bad) is None, bad


def test_lease_ends_after_the_expected_number_of_done_notices():
    leases = LeaseTable()
    leases.add("r", [1, 2], 30.0)
    assert not leases.done("r", expected=3, block_ids=[1, 2])
    assert not leases.done("r", expected=3, block_ids=[1, 2])
    assert "r" in leases
    assert leases.done("r", expected=3, block_ids=[1, 2])
    assert "r" not in leases
    assert not leases.done("r", expected=3, block_ids=[1, 2])  # a late one is ignored


def test_done_notices_before_the_lease_are_counted_and_abort_wins():
    leases = LeaseTable()
    leases.note_unknown("a", "done", expected=2, block_ids=[1])
    assert leases.add("a", [1], 30.0) is None  # one of two: the lease starts with it
    assert leases.done("a", expected=2, block_ids=[1])
    leases.done("b", expected=2, block_ids=[1])  # unknown yet: remembered
    leases.done("b", expected=2, block_ids=[1])
    assert leases.add("b", [1], 30.0) == "done"
    leases.note_unknown("c", "abort", block_ids=[1])
    leases.note_unknown("c", "done", expected=2, block_ids=[1])
    assert leases.add("c", [1], 30.0) == "abort"


def test_notices_naming_other_blocks_leave_the_lease_alone():
    """Forged params (a real request id, other block ids): the claim is refused, and the
    reader's abort, done or heartbeat for them, or an early release, must not end or extend the
    real lease, before or after it is registered; the honest reader's claim still succeeds."""
    leases = LeaseTable()
    leases.abort("r", [9, 9])  # before the lease: remembered under the forged ids only
    leases.done("r", block_ids=[9, 9])
    assert leases.add("r", [1, 2], 30.0, now=0.0) is None
    assert leases.claim("r", [1, 3], now=0.0)[0] is ClaimStatus.REJECT
    for block_ids in ([1, 3], [1], [1, 2, 3], None, "1,2", [1, True]):
        assert not leases.abort("r", block_ids)
        assert not leases.done("r", block_ids=block_ids)
        assert not leases.release_early("r", block_ids)
        assert not leases.renew("r", block_ids, now=20.0)
    assert leases.next_expiry() == 30.0  # no forged heartbeat extended it
    assert leases.claim("r", [1, 2], now=0.0)[0] is ClaimStatus.OK
    assert leases.renew("r", [1, 2], now=20.0) and leases.next_expiry() == 50.0
    assert leases.abort("r", [1, 2]) and "r" not in leases


def test_side_channel_answers_for_the_rank_named():
    info = {"engine_id": "e", "tp_size": 2, "ranks": [{"tp_rank": 0, "agent_name": "a0"},
                                                      {"tp_rank": 1, "agent_name": "a1"}]}
    assert rank_info(info, 1) == {"engine_id": "e", "tp_size": 2, "tp_rank": 1,
                                  "agent_name": "a1"}
    assert rank_info(info, 0)["agent_name"] == "a0"
    for bad in (2, -1, "1", True, None):
        assert isinstance(rank_info(info, bad), str)
    assert rank_info({"x": 1}, 0) == {"x": 1}
