"""Upstream health in the proxy: one circuit breaker per instance, probed back with ``GET /health``.

Each instance of each leg has a :class:`CircuitBreaker`:

* **closed** (in rotation): every failure of a request on it (connection refused or reset,
  timeout, dropped connection, invalid answer, HTTP 5xx) adds one to a run of consecutive
  failures; any answer below 500 ends the run (a 4xx is the client's error, the instance is
  alive). ``failure_threshold`` failures in a row open the breaker.
* **open** (out of rotation: routing skips it): after ``backoff`` seconds the proxy probes the
  instance's ``GET /health`` in the background. 200 -> half-open; anything else -> open again
  with the back-off doubled (up to ``max_backoff``).
* **half-open** (in rotation, on trial): the next request on it decides: an answer below 500
  closes the breaker (back-off reset), a failure opens it again with the back-off doubled.

The state is exported as ``pdserve:proxy_upstream_healthy{upstream, leg}`` (1 in rotation, 0 out)
and in the proxy's ``GET /health`` body. The scheme follows the circuit breakers of SGLang's
router and Envoy's outlier detection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import Awaitable, Callable

from prometheus_client import Gauge

from pdserve.router.upstreams import Upstream

logger = logging.getLogger("pdserve.router")

#: Default consecutive failures that take an instance out of rotation (``--breaker-failures``).
DEFAULT_BREAKER_FAILURES = 3
#: Default first back-off of an open breaker in seconds (``--breaker-backoff``).
DEFAULT_BREAKER_BACKOFF_S = 5.0
#: The back-off doubles per failed probe up to this many seconds (or the first back-off if larger).
MAX_BREAKER_BACKOFF_S = 60.0


class BreakerState(str, Enum):
    """A circuit breaker's state (the value shown in the proxy's ``GET /health``)."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerPolicy:
    """When a breaker opens and for how long.

    Attributes:
        failure_threshold: consecutive failures that open it; 0 = never (breakers off).
        backoff: seconds an opened breaker waits before its first probe.
        max_backoff: upper bound of the doubled back-off (seconds).
    """

    failure_threshold: int = DEFAULT_BREAKER_FAILURES
    backoff: float = DEFAULT_BREAKER_BACKOFF_S
    max_backoff: float = MAX_BREAKER_BACKOFF_S


class CircuitBreaker:
    """The breaker of one instance (state machine of the module docstring; no I/O).

    Args:
        policy: thresholds and back-off.

    Attributes:
        state: the current :class:`BreakerState`.
        failures: the current run of consecutive failures.
        backoff: seconds the next opening lasts before its probe.
    """

    __slots__ = ("policy", "state", "failures", "backoff")

    def __init__(self, policy: BreakerPolicy):
        self.policy = policy
        self.state = BreakerState.CLOSED
        self.failures = 0
        self.backoff = policy.backoff

    @property
    def in_rotation(self) -> bool:
        """True unless the breaker is open."""
        return self.state is not BreakerState.OPEN

    def success(self) -> bool:
        """Record an answer below 500; True when this closed a half-open breaker."""
        self.failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.state = BreakerState.CLOSED
            self.backoff = self.policy.backoff
            return True
        return False

    def failure(self) -> bool:
        """Record a failure; True when this opened the breaker (the caller schedules a probe)."""
        self.failures += 1
        if self.state is BreakerState.OPEN or self.policy.failure_threshold <= 0:
            return False
        if self.state is BreakerState.HALF_OPEN:
            self._grow_backoff()
        elif self.failures < self.policy.failure_threshold:
            return False
        self.state = BreakerState.OPEN
        return True

    def probed(self, ok: bool) -> bool:
        """Record a probe's outcome; True when the breaker stays open (probe again later)."""
        if self.state is not BreakerState.OPEN:
            return False
        if ok:
            self.state = BreakerState.HALF_OPEN
            return False
        self._grow_backoff()
        return True

    def _grow_backoff(self) -> None:
        self.backoff = min(self.backoff * 2, max(self.policy.max_backoff, self.policy.backoff))


class UpstreamHealth:
    """The breakers of every instance of both legs, their probes and their gauge.

    Args:
        upstreams: every instance (both legs).
        policy: the breakers' thresholds and back-off.
        probe: ``await probe(upstream)`` -> True when its ``GET /health`` answers 200.
        gauge: ``pdserve:proxy_upstream_healthy`` (labels ``upstream``, ``leg``).
        clock: monotonic clock in seconds (tests).
    """

    def __init__(self, upstreams: list[Upstream], policy: BreakerPolicy,
                 probe: Callable[[Upstream], Awaitable[bool]], gauge: Gauge,
                 clock: Callable[[], float] = time.monotonic):
        self.policy = policy
        self._probe = probe
        self._clock = clock
        self._breakers = {id(u): CircuitBreaker(policy) for u in upstreams}
        self._gauges = {id(u): gauge.labels(upstream=u.url, leg=u.leg) for u in upstreams}
        for g in self._gauges.values():
            g.set(1)
        self._tasks: dict[int, asyncio.Task] = {}
        self._closed = False

    def breaker(self, up: Upstream) -> CircuitBreaker:
        """The breaker of ``up``."""
        return self._breakers[id(up)]

    def in_rotation(self, up: Upstream) -> bool:
        """True unless ``up``'s breaker is open (routing skips it)."""
        return self._breakers[id(up)].in_rotation

    def success(self, up: Upstream) -> None:
        """Record that ``up`` answered (any status below 500)."""
        b = self._breakers[id(up)]
        if b.failures or b.state is not BreakerState.CLOSED:
            if b.success():
                logger.info("%s instance %s is back in rotation", up.leg, up.url)

    def failure(self, up: Upstream) -> None:
        """Record a failed request on ``up``; opening its breaker schedules its probe."""
        b = self._breakers[id(up)]
        if b.failure():
            self._gauges[id(up)].set(0)
            logger.warning("%s instance %s taken out of rotation after %d consecutive failures; "
                           "probing it in %g s", up.leg, up.url, b.failures, b.backoff)
            self._schedule_probe(up)

    def report(self, ups: list[Upstream]) -> dict[str, str]:
        """URL -> breaker state value, for the proxy's ``GET /health``."""
        return {u.url: self._breakers[id(u)].state.value for u in ups}

    async def close(self) -> None:
        """Cancel the pending probes."""
        self._closed = True
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _schedule_probe(self, up: Upstream) -> None:
        running = self._tasks.get(id(up))
        if self._closed or (running is not None and not running.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside a loop (unit tests of the state machine)
            return
        task = loop.create_task(self._probe_loop(up))
        self._tasks[id(up)] = task
        task.add_done_callback(lambda t, key=id(up): self._tasks.get(key) is t
                               and self._tasks.pop(key))

    async def _probe_loop(self, up: Upstream) -> None:
        b = self._breakers[id(up)]
        while b.state is BreakerState.OPEN:
            await asyncio.sleep(b.backoff)
            ok = await self._probe(up)
            if not b.probed(ok):
                break
            logger.info("%s instance %s still failing its health probe; next probe in %g s",
                        up.leg, up.url, b.backoff)
        if b.in_rotation:
            self._gauges[id(up)].set(1)
            logger.info("%s instance %s answered its health probe: on trial (half-open)",
                        up.leg, up.url)
