"""KV transfer statistics: per-step deltas for the front end's Prometheus metrics, and the
periodic ``KV Transfer metrics: ...`` log line.

The delta dict (``KVConnectorOutput.stats``) has exactly these keys::

    {"xfer_time_s": [float], "post_time_s": [float], "bytes": [int], "num_descriptors": [int],
     "num_failed_transfers": int, "num_partial_transfers": int, "num_failed_notifications": int,
     "num_kv_expired_reqs": int, "num_kv_turns_expired": int, "num_kv_leases_released_early": int,
     "num_pulls_given_up": int, "handoff_s": [float]}

one list entry per successful transfer (a partial one too; ``handoff_s``: per prompt lease read,
on the owner's TP rank 0); the server turns them into the ``pdserve:nixl_*`` histograms and counters and the
``pdserve:kv_handoff_seconds`` histogram.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("pdserve.kv_transfer")


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a non-empty list.

    Args:
        values: samples.
        q: percentile in 0..100.
    """
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _avg_p90_ms(seconds: list[float]) -> tuple[float, float]:
    """Average and P90 of ``seconds`` in milliseconds (0.0 each when empty)."""
    if not seconds:
        return 0.0, 0.0
    return 1e3 * sum(seconds) / len(seconds), 1e3 * percentile(seconds, 90)


@dataclass
class TransferStats:
    """Transfer observations over some period.

    Attributes:
        xfer_time_s: per successful transfer, seconds from post to completion.
        post_time_s: per successful transfer, seconds spent creating and posting it.
        bytes: per successful transfer, bytes moved.
        num_descriptors: per successful transfer, descriptors after merging runs of blocks.
        num_failed_transfers: transfers that failed (error, timeout, failed handshake or lease
            claim, invalid block ids).
        num_partial_transfers: successful transfers that read only the leading blocks of their
            load because the owner held no more (a decoder's restored turn; the reader computes
            the rest): not failures.
        num_failed_notifications: control notifications that could not be sent.
        num_kv_expired_reqs: leases that ended without a read (blocks freed by expiry).
        num_kv_turns_expired: among those, a decoder's multi-turn blocks that no prefiller
            pulled before their TTL (expected in normal traffic: the conversation ended or
            moved to another instance).
        num_kv_leases_released_early: leases released before a read or their expiry because
            their decode leg will not read them (the proxy's release: D refused, unreachable,
            client gone between the legs; or the prefill's client gone before it got the
            params).
        num_pulls_given_up: a prefiller's pulls of a decoder's turn whose lease claim was not
            answered within the time computing their tokens takes (``RecvSpec.claim_wait_s``):
            nothing read, the tokens computed. Not failures.
        handoff_s: per prompt lease (P's blocks for a decoder) ended by its reader's "done",
            seconds from the lease's start (P holds the KV) to that "done" (the KV is in the
            reader's cache): the hand-off as the owner sees it.
    """

    xfer_time_s: list[float] = field(default_factory=list)
    post_time_s: list[float] = field(default_factory=list)
    bytes: list[int] = field(default_factory=list)
    num_descriptors: list[int] = field(default_factory=list)
    num_failed_transfers: int = 0
    num_partial_transfers: int = 0
    num_failed_notifications: int = 0
    num_kv_expired_reqs: int = 0
    num_kv_turns_expired: int = 0
    num_kv_leases_released_early: int = 0
    num_pulls_given_up: int = 0
    handoff_s: list[float] = field(default_factory=list)

    def record_transfer(
        self, xfer_time_s: float, post_time_s: float, nbytes: int, num_descriptors: int
    ) -> None:
        self.xfer_time_s.append(float(xfer_time_s))
        self.post_time_s.append(float(post_time_s))
        self.bytes.append(int(nbytes))
        self.num_descriptors.append(int(num_descriptors))

    def merge(self, other: "TransferStats") -> None:
        self.xfer_time_s += other.xfer_time_s
        self.post_time_s += other.post_time_s
        self.bytes += other.bytes
        self.num_descriptors += other.num_descriptors
        self.num_failed_transfers += other.num_failed_transfers
        self.num_partial_transfers += other.num_partial_transfers
        self.num_failed_notifications += other.num_failed_notifications
        self.num_kv_expired_reqs += other.num_kv_expired_reqs
        self.num_kv_turns_expired += other.num_kv_turns_expired
        self.num_kv_leases_released_early += other.num_kv_leases_released_early
        self.num_pulls_given_up += other.num_pulls_given_up
        self.handoff_s += other.handoff_s

    def is_empty(self) -> bool:
        return not (
            self.xfer_time_s or self.num_failed_transfers or self.num_failed_notifications
            or self.num_kv_expired_reqs or self.num_kv_leases_released_early or self.handoff_s
            or self.num_pulls_given_up
        )

    def to_dict(self) -> dict[str, Any]:
        """The ``KVConnectorOutput.stats`` form (see the module docstring)."""
        return {
            "xfer_time_s": list(self.xfer_time_s),
            "post_time_s": list(self.post_time_s),
            "bytes": list(self.bytes),
            "num_descriptors": list(self.num_descriptors),
            "num_failed_transfers": self.num_failed_transfers,
            "num_partial_transfers": self.num_partial_transfers,
            "num_failed_notifications": self.num_failed_notifications,
            "num_kv_expired_reqs": self.num_kv_expired_reqs,
            "num_kv_turns_expired": self.num_kv_turns_expired,
            "num_kv_leases_released_early": self.num_kv_leases_released_early,
            "num_pulls_given_up": self.num_pulls_given_up,
            "handoff_s": list(self.handoff_s),
        }

    def format_log_line(self) -> str:
        """``KV Transfer metrics: ...`` with averages and P90s in milliseconds, sizes in MB
        (10^6 bytes) and throughput as total MB over total transfer time: vLLM's
        NixlConnector fields, in its order, then the counts that only pdserve has, each only
        when not zero (the owner's hand-offs with their average and P90, pulls given up,
        leases released early, failed notifications), so that an interval whose activity
        was only those says what it was."""
        n = len(self.xfer_time_s)
        total_mb = sum(self.bytes) / 1e6
        total_xfer_s = sum(self.xfer_time_s)
        avg_xfer, p90_xfer = _avg_p90_ms(self.xfer_time_s)
        avg_post, p90_post = _avg_p90_ms(self.post_time_s)
        avg_mb = total_mb / n if n else 0.0
        throughput = total_mb / total_xfer_s if total_xfer_s > 0 else 0.0
        avg_desc = sum(self.num_descriptors) / n if n else 0.0
        return (
            f"KV Transfer metrics: Num successful transfers={n}, "
            f"Avg xfer time (ms)={avg_xfer:.3f}, P90 xfer time (ms)={p90_xfer:.3f}, "
            f"Avg post time (ms)={avg_post:.3f}, P90 post time (ms)={p90_post:.3f}, "
            f"Avg MB per transfer={avg_mb:.3f}, Throughput (MB/s)={throughput:.3f}, "
            f"Avg number of descriptors={avg_desc:.1f}, "
            f"Num failed transfers={self.num_failed_transfers}, "
            f"Num KV expired reqs={self.num_kv_expired_reqs}"
        ) + "".join(self._own_fields())

    def _own_fields(self) -> list[str]:
        out = []
        if self.handoff_s:
            avg, p90 = _avg_p90_ms(self.handoff_s)
            out.append(f", Num hand-offs={len(self.handoff_s)}, Avg hand-off (ms)={avg:.3f}, "
                       f"P90 hand-off (ms)={p90:.3f}")
        for name, value in (("Num pulls given up", self.num_pulls_given_up),
                            ("Num leases released early", self.num_kv_leases_released_early),
                            ("Num failed notifications", self.num_failed_notifications)):
            if value:
                out.append(f", {name}={value}")
        return out


class StatsRecorder:
    """Collects observations; hands out per-step deltas and logs the interval line.

    One line per interval with activity, none while idle. An interval starts at the previous
    line, or, after a quiet stretch longer than an interval, at the first new activity; its line
    is due when it ends (:meth:`next_log_in`), and the engine loop wakes up for it even when it
    has nothing else to do.

    Args:
        log_interval_s: seconds between two log lines (a line is logged only when something
            happened during the interval).
    """

    def __init__(self, log_interval_s: float):
        self.log_interval_s = log_interval_s
        self._delta = TransferStats()
        self._interval = TransferStats()
        self._last_log = time.monotonic()

    @property
    def current(self) -> TransferStats:
        """The observations not yet taken by :meth:`take_delta` (record into this)."""
        return self._delta

    def _interval_end(self) -> float:
        # compared as a sum (not ``now - last``), so ``now = last + interval`` is exactly due
        return self._last_log + self.log_interval_s

    def take_delta(self, now: float | None = None) -> dict[str, Any] | None:
        """This step's observations as a stats dict, or None when nothing happened."""
        if self._delta.is_empty():
            return None
        now = time.monotonic() if now is None else now
        if self._interval.is_empty() and now >= self._interval_end():
            self._last_log = now  # activity after a quiet stretch opens a new interval
        delta = self._delta
        self._delta = TransferStats()
        self._interval.merge(delta)
        return delta.to_dict()

    def next_log_in(self, now: float | None = None) -> float | None:
        """Seconds until the pending interval line is due (0 when overdue), or None when the
        current interval has no activity (nothing to log)."""
        if self._interval.is_empty():
            return None
        now = time.monotonic() if now is None else now
        return max(0.0, self._interval_end() - now)

    def maybe_log(self, now: float | None = None) -> str | None:
        """Log (INFO) and return the interval line when the interval has passed and there was
        activity; otherwise return None."""
        now = time.monotonic() if now is None else now
        if now < self._interval_end():
            return None
        self._last_log = now
        if self._interval.is_empty():
            return None
        line = self._interval.format_log_line()
        self._interval = TransferStats()
        logger.info("%s", line)
        return line
