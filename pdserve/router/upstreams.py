"""Prefill/decode instances as seen by the proxy, and how one is picked per leg.

Routing policies:

* ``round-robin``: instances take turns, in the order given on the command line.
* ``least-loaded``: the instance with the fewest requests in flight *through this proxy*; ties
  go to the round-robin order, so equal load still spreads evenly.
* ``kv-aware``: the pool orders least-loaded; :mod:`pdserve.router.kv_routing` then puts the
  instance with the best cache-hit-vs-load score first.

Instances whose circuit breaker is open (:mod:`pdserve.router.health`) are left out of every
order; when that leaves none, a pool made with ``panic=True`` (the decode leg) orders them all
anyway (Envoy's "panic routing": trying is better than refusing), one without (the prefill leg)
orders none and the proxy falls back to decode-only.

An instance whose last connection attempt failed is "cooling down" for :data:`COOL_DOWN_S`
seconds and is tried after all other instances (never skipped entirely: it is still tried when
nothing else answers).
"""

from __future__ import annotations

import time
from typing import Callable

#: Seconds an instance that refused a connection is tried last (cheap protection against paying a
#: connect attempt per request for a dead instance; it is retried as soon as this passes).
COOL_DOWN_S = 2.0
#: Values of ``--routing``.
ROUTING_POLICIES = ("round-robin", "least-loaded", "kv-aware")


def proxy_needs_tokenizer(routing: str, local_prefill_max_tokens: int) -> bool:
    """True when the proxy hashes prompts and so needs the served model's tokenizer: kv-aware
    routing and local prefill both compare a prompt's block hashes with the instances' KV
    events (``pdserve proxy --tokenizer``)."""
    return routing == "kv-aware" or local_prefill_max_tokens > 0


class Upstream:
    """One prefill or decode instance.

    Attributes:
        url: base URL, e.g. ``"http://127.0.0.1:8100"`` (no trailing slash).
        leg: ``"prefill"`` or ``"decode"``.
        in_flight: requests this proxy currently has open on the instance.
        down_until: ``time.monotonic()`` before which the instance is tried last.
    """

    __slots__ = ("url", "leg", "in_flight", "down_until")

    def __init__(self, url: str, leg: str):
        self.url = url
        self.leg = leg
        self.in_flight = 0
        self.down_until = 0.0

    def __repr__(self) -> str:
        return f"Upstream({self.leg} {self.url}, in_flight={self.in_flight})"


class UpstreamPool:
    """The instances of one leg and the routing policy over them.

    Args:
        leg: ``"prefill"`` or ``"decode"``.
        urls: base URLs (at least one).
        routing: ``"round-robin"``, ``"least-loaded"`` or ``"kv-aware"`` (ordered least-loaded).
        clock: monotonic clock in seconds (injectable for tests).
        available: ``available(upstream)`` -> False while its circuit breaker is open (it is
            left out of :meth:`order`); None = always available.
        panic: when no instance is available, :meth:`order` returns them all (else none).

    Raises:
        ValueError: empty ``urls`` or unknown ``routing``.
    """

    def __init__(self, leg: str, urls: tuple[str, ...] | list[str], routing: str,
                 clock: Callable[[], float] = time.monotonic,
                 available: Callable[[Upstream], bool] | None = None, panic: bool = True):
        if not urls:
            raise ValueError(f"no {leg} instances")
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"unknown routing policy {routing!r}")
        self.leg = leg
        self.upstreams = [Upstream(u, leg) for u in urls]
        self._by_url = {u.url: u for u in self.upstreams}
        self._least_loaded = routing != "round-robin"
        self._next = 0
        self._clock = clock
        self._available = available
        self._panic = panic

    @property
    def least_loaded(self) -> bool:
        """True when :meth:`order` sorts by requests in flight."""
        return self._least_loaded

    def is_down(self, upstream: Upstream) -> bool:
        """True while ``upstream`` is cooling down after a refused connection."""
        return upstream.down_until > self._clock()

    def get(self, url: str | None) -> Upstream | None:
        """The upstream with base URL ``url``, or None."""
        return self._by_url.get(url) if url else None

    def order(self, preferred: Upstream | None = None) -> list[Upstream]:
        """All instances in the order to try them for one request.

        The first element is the routing decision; the rest are fallbacks for when an instance
        cannot be connected to. ``preferred`` (a multi-turn conversation's previous instance) goes
        first unless it is cooling down. Instances out of rotation are left out (see the module
        docstring for when none is left). Advances the round-robin position by one.
        """
        ups = self.upstreams
        n = len(ups)
        start = self._next
        self._next = (start + 1) % n
        rotated = ups[start:] + ups[:start]
        if self._available is not None:
            rotated = [u for u in rotated if self._available(u)]
            if not rotated:
                rotated = ups[start:] + ups[:start] if self._panic else []
            if preferred is not None and preferred not in rotated:
                preferred = None
        if len(rotated) <= 1:
            return rotated
        if self._least_loaded:
            rotated.sort(key=lambda u: u.in_flight)  # stable: ties keep round-robin order
        now = self._clock()
        if preferred is not None and preferred.down_until <= now:
            rotated.remove(preferred)
            rotated.insert(0, preferred)
        if any(u.down_until > now for u in rotated):
            rotated.sort(key=lambda u: u.down_until > now)  # stable: cooling-down ones last
        return rotated

    def mark_down(self, upstream: Upstream) -> None:
        """Record that ``upstream`` refused a connection (it is tried last for COOL_DOWN_S)."""
        upstream.down_until = self._clock() + COOL_DOWN_S

    def all_failed(self) -> bool:
        """True when every instance's last connection attempt failed (none answered since)."""
        return all(u.down_until > 0.0 for u in self.upstreams)

    def mark_up(self, upstream: Upstream) -> None:
        """Record that ``upstream`` answered."""
        upstream.down_until = 0.0
