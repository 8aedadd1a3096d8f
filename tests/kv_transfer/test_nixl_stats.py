"""KV transfer statistics: the per-step delta dict and the interval log line."""

from __future__ import annotations

import logging
import re

from pdserve.kv_transfer.nixl.agent import block_runs
from pdserve.kv_transfer.nixl.stats import StatsRecorder, percentile

LINE = re.compile(
    r"^KV Transfer metrics: Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+), "
    r"P90 xfer time \(ms\)=([\d.]+), Avg post time \(ms\)=([\d.]+), P90 post time \(ms\)=([\d.]+), "
    r"Avg MB per transfer=([\d.]+), Throughput \(MB/s\)=([\d.]+), "
    r"Avg number of descriptors=([\d.]+), Num failed transfers=(\d+), Num KV expired reqs=(\d+)$"
)


def test_delta_dict_and_log_line(caplog):
    rec = StatsRecorder(log_interval_s=10.0)
    assert rec.take_delta() is None
    rec.current.record_transfer(0.010, 0.001, 2_000_000, 2)
    rec.current.record_transfer(0.030, 0.003, 4_000_000, 4)
    rec.current.num_failed_transfers += 1
    rec.current.num_kv_expired_reqs += 2
    delta = rec.take_delta()
    assert delta == {
        "xfer_time_s": [0.010, 0.030], "post_time_s": [0.001, 0.003],
        "bytes": [2_000_000, 4_000_000], "num_descriptors": [2, 4],
        "num_failed_transfers": 1, "num_partial_transfers": 0, "num_failed_notifications": 0,
        "num_kv_expired_reqs": 2, "num_kv_turns_expired": 0, "num_kv_leases_released_early": 0,
        "num_pulls_given_up": 0, "handoff_s": [],
    }
    assert rec.take_delta() is None
    assert rec.maybe_log(now=rec._last_log + 1.0) is None  # interval not over yet
    with caplog.at_level(logging.INFO, logger="pdserve.kv_transfer"):
        line = rec.maybe_log(now=rec._last_log + 10.0)
    m = LINE.match(line)
    assert m, line
    n, avg_x, p90_x, avg_p, p90_p, avg_mb, tput, avg_d, failed, expired = m.groups()
    assert int(n) == 2 and int(failed) == 1 and int(expired) == 2
    assert float(avg_x) == 20.0 and float(p90_x) == 28.0
    assert float(avg_p) == 2.0 and float(p90_p) == 2.8
    assert float(avg_mb) == 3.0 and float(tput) == 150.0 and float(avg_d) == 3.0
    assert line in caplog.text
    # no activity in the next interval -> no line
    assert rec.maybe_log(now=rec._last_log + 20.0) is None


def test_percentile_matches_linear_interpolation():
    assert percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0], 90) == 9.1


def test_block_runs_merge_only_when_both_sides_are_consecutive():
    assert block_runs([10, 11, 12, 20], [3, 4, 5, 9]) == [(10, 3, 3), (20, 9, 1)]
    assert block_runs([1, 2, 3], [7, 9, 10]) == [(1, 7, 1), (2, 9, 2)]
    assert block_runs([], []) == []


def test_line_deadline_one_interval_after_activity_none_while_idle():
    rec = StatsRecorder(log_interval_s=10.0)
    t0 = rec._last_log
    assert rec.next_log_in(now=t0 + 1.0) is None  # nothing happened: no deadline
    # activity after a quiet stretch opens an interval at that moment
    rec.current.record_transfer(0.010, 0.001, 1000, 1)
    rec.take_delta(now=t0 + 25.0)
    assert rec.next_log_in(now=t0 + 26.0) == 9.0
    assert rec.maybe_log(now=t0 + 26.0) is None
    # more activity in the same interval: same deadline, one line for both
    rec.current.record_transfer(0.010, 0.001, 1000, 1)
    rec.take_delta(now=t0 + 30.0)
    assert rec.next_log_in(now=t0 + 30.0) == 5.0
    line = rec.maybe_log(now=t0 + 35.0)
    assert line is not None and "Num successful transfers=2," in line
    assert rec.next_log_in(now=t0 + 35.0) is None
    assert rec.maybe_log(now=t0 + 60.0) is None


def test_an_interval_of_only_hand_offs_and_given_up_pulls_says_so():
    """A prefiller's interval without reads of its own (its activity: leases handed off to
    decoders, pulls given up) gets vLLM's fields at zero followed by what it did."""
    rec = StatsRecorder(log_interval_s=10.0)
    rec.current.handoff_s += [0.010, 0.020, 0.030]
    rec.current.num_pulls_given_up += 2
    rec.take_delta()
    line = rec.maybe_log(now=rec._last_log + 10.0)
    head, tail = line.split(", Num hand-offs=")
    assert LINE.match(head) and "Num successful transfers=0," in head
    assert tail == "3, Avg hand-off (ms)=20.000, P90 hand-off (ms)=28.000, Num pulls given up=2"
