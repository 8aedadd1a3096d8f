"""The proxy's hand-off modes (``--handoff``) and what it knows of each instance for the
concurrent one: a prefiller's KV endpoints, one per data-parallel rank, with this proxy's prefill
legs in flight per rank, and which decoders take the concurrent decode leg.

Learned from the role check's ``GET /pdserve/instance`` answers (:mod:`pdserve.router.role_check`):
a prefiller that lists ``kv_endpoints`` (docs/proxy.md, "Concurrent hand-off"); a decoder that
answered without being a pdserve ``kv_consumer`` (a vLLM decoder has no such route, and does not
know the pending decode leg) is never sent one. A decoder not asked yet (unreachable so far) may
be. An instance whose engine restarted has another engine id: its entry is forgotten
(:meth:`HandoffTargets.forget`) until it is asked again, and it is served sequentially meanwhile.
"""

from __future__ import annotations

import enum
import logging
from typing import Any

from pdserve.router.upstreams import Upstream
from pdserve.types.kv_endpoints import KVEndpoint, KVEndpointsError, PrefillEndpoints

logger = logging.getLogger("pdserve.router")

#: A decoder's ``kv_role`` values that read KV from a prefiller.
_DECODER_ROLES = ("kv_consumer", "kv_both")


class HandoffMode(enum.Enum):
    """``--handoff``: how the two legs of a turn are sent."""

    CONCURRENT = "concurrent"  # both legs at once; D learns P's blocks from P's side channel
    SEQUENTIAL = "sequential"  # the decode leg after P's answer, with P's returned params


class PrefillRanks:
    """A prefiller's KV endpoints and this proxy's prefill legs in flight on each rank.

    Args:
        endpoints: the prefiller's (at least one endpoint).
    """

    __slots__ = ("endpoints", "in_flight", "_next")

    def __init__(self, endpoints: PrefillEndpoints):
        self.endpoints = endpoints
        self.in_flight = [0] * len(endpoints.endpoints)
        self._next = 0

    @property
    def multi_rank(self) -> bool:
        """True with several data-parallel ranks (the leg then names its rank in a header)."""
        return len(self.in_flight) > 1

    def pick(self) -> int:
        """The rank with the fewest legs in flight; ties go to the first one at or after the
        rank following the last choice (round robin among equals)."""
        n = len(self.in_flight)
        order = [(self._next + i) % n for i in range(n)]
        rank = min(order, key=lambda r: self.in_flight[r])
        self._next = (rank + 1) % n
        return rank

    def endpoint(self, rank: int) -> KVEndpoint:
        """The side channel of ``rank``."""
        return self.endpoints.endpoints[rank]

    def enter(self, rank: int) -> None:
        """Count one more prefill leg in flight on ``rank``."""
        self.in_flight[rank] += 1

    def leave(self, rank: int) -> None:
        """Count one prefill leg fewer in flight on ``rank``."""
        self.in_flight[rank] -= 1


class HandoffTargets:
    """What the concurrent hand-off knows of each instance (see the module docstring)."""

    def __init__(self) -> None:
        self._prefill: dict[str, PrefillRanks] = {}
        self._plain_decoders: set[str] = set()  # answered, and not as a pdserve kv_consumer
        self._stale: set[str] = set()

    def learn(self, up: Upstream, info: dict[str, Any] | None) -> None:
        """Record an instance's ``GET /pdserve/instance`` answer (None: it has no such route,
        a vLLM engine). Malformed endpoints are logged and leave the prefiller sequential."""
        self._stale.discard(up.url)
        if up.leg == "decode":
            if info is not None and info.get("kv_role") in _DECODER_ROLES:
                self._plain_decoders.discard(up.url)
            else:
                self._plain_decoders.add(up.url)
            return
        self._prefill.pop(up.url, None)
        if info is None:
            return
        try:
            endpoints = PrefillEndpoints.from_info(info)
        except KVEndpointsError as e:
            logger.warning("prefill instance %s lists unusable KV endpoints (%s); it is served "
                           "with the sequential hand-off", up.url, e)
            return
        if endpoints is not None:
            self._prefill[up.url] = PrefillRanks(endpoints)

    def prefill(self, up: Upstream) -> PrefillRanks | None:
        """A prefiller's ranks, or None when it is served sequentially (no endpoints known)."""
        return self._prefill.get(up.url)

    def concurrent_decoder(self, up: Upstream) -> bool:
        """False for a decoder known not to take the concurrent decode leg."""
        return up.url not in self._plain_decoders

    def forget(self, up: Upstream) -> None:
        """Drop a prefiller's endpoints (its engine restarted or failed): it is served
        sequentially until :meth:`learn` is called for it again."""
        if self._prefill.pop(up.url, None) is not None:
            self._stale.add(up.url)

    def stale(self, up: Upstream) -> bool:
        """True for a prefiller forgotten and not learned again yet (ask it again)."""
        return up.url in self._stale


def names_endpoint(params: dict[str, Any] | None, endpoint: KVEndpoint) -> bool:
    """Whether the ``kv_transfer_params`` a prefiller returned name ``endpoint`` (engine id and
    side-channel port): otherwise its engine restarted since its endpoints were learned."""
    if params is None:
        return True  # nothing to compare (the decoder's answer tells)
    return (params.get("remote_engine_id") == endpoint.engine_id
            and params.get("remote_port") == endpoint.port)
