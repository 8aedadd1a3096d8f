"""One request's retries before its first token: the budget shared by both legs
(``--max-retries``), the instances the request failed on, and the decode-only fallback, for the
sequential legs (:mod:`pdserve.router.legs`) and the concurrent ones
(:mod:`pdserve.router.concurrent_legs`) alike."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from pdserve.router.errors import ProxyError
from pdserve.router.fallback import DecodeOnlyFallback
from pdserve.router.health import UpstreamHealth
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstream_client import Turn, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

#: A decoder's answers when its KV read from the prefiller failed (P did not answer in time /
#: transport error; docs/configuration.md, ``kv_load_failure_policy``): D itself is alive, so
#: with no other decoder the retry (a new prefill, or decode-only) may go to it again, and the
#: answer does not count against D's circuit breaker.
KV_SOURCE_FAILED = (502, 503)

Failure = ProxyError | UpstreamHTTPError


@dataclass
class Attempts:
    """One request's retry bookkeeping: budget left and the instances it failed on."""

    budget: int
    p_failed: list[Upstream] = field(default_factory=list)
    d_failed: list[Upstream] = field(default_factory=list)
    d_again: list[Upstream] = field(default_factory=list)  # answered 502/503: tried last
    causes: list[str] = field(default_factory=list)  # why prefillers did not serve, in order
    fell_back: bool = False


class RetryPolicy:
    """Decides, counts and logs the retries of requests (docs/proxy.md, "Failing instances
    before the first token").

    Args:
        prefillers, decoders: the leg pools.
        health: the instances' circuit breakers (who is in rotation).
        fallback: the decode-only fallback (or its refusal, ``--enforce-disagg``).
        metrics: counts retries (``pdserve:proxy_retries_total{leg}``).
        max_retries: the retry budget of one request (``--max-retries``).
    """

    def __init__(self, prefillers: UpstreamPool, decoders: UpstreamPool, health: UpstreamHealth,
                 fallback: DecodeOnlyFallback, metrics: ProxyMetrics, max_retries: int):
        self._prefillers = prefillers
        self._decoders = decoders
        self._health = health
        self._fallback = fallback
        self._metrics = metrics
        self._max_retries = max_retries

    def attempts(self) -> Attempts:
        """A new request's bookkeeping (the whole budget left)."""
        return Attempts(self._max_retries)

    def decode_order(self, routed: list[Upstream], att: Attempts) -> list[Upstream]:
        """The decoders to try, from a routing decision: without those the request failed on,
        those that answered 502/503 last."""
        routed = [u for u in routed if u not in att.d_failed]
        return [u for u in routed if u not in att.d_again] + [u for u in routed if u in att.d_again]

    def prefill_unreachable(self, att: Attempts, order: list[Upstream], error: ProxyError) -> None:
        """No prefiller of ``order`` accepted a connection (nothing was sent): they are left
        out of this request's next tries, without spending the budget."""
        att.causes.append(error.message)  # one clause per instance
        att.p_failed.extend(order)

    def prefill_failed(self, att: Attempts, up: Upstream, failure: Failure, turn: Turn) -> None:
        """A prefiller failed after the request was sent (5xx, timeout, dropped connection,
        invalid answer): it is left out, and one retry is spent.

        Raises:
            ProxyError | UpstreamHTTPError: ``failure`` when no budget is left; the
                ``--enforce-disagg`` refusal when no prefiller is left.
        """
        att.p_failed.append(up)
        att.causes.append(message(failure))
        if att.budget <= 0:
            raise failure
        if not self.prefiller_left(att) and self._fallback.enforce_disagg:
            self.decode_only(turn, att)  # raises the refusal, naming the causes
        self.spend(att, "prefill", turn, failure)

    def prefiller_left(self, att: Attempts) -> bool:
        """True while a prefiller in rotation has not failed this request."""
        return any(u not in att.p_failed and self._health.in_rotation(u)
                   for u in self._prefillers.upstreams)

    def decode_only(self, turn: Turn, att: Attempts) -> None:
        """Serve the request without a prefiller (counted once per request).

        Raises:
            ProxyError: 503 with ``--enforce-disagg``, naming why each prefiller did not serve.
        """
        if att.fell_back:
            return
        causes = att.causes + [f"prefill instance {u.url} out of rotation (circuit open)"
                               for u in self._prefillers.upstreams if u not in att.p_failed]
        self._fallback.take(turn.request_id, causes)
        att.fell_back = True

    def retry_decode(self, failure: Failure, att: Attempts, turn: Turn) -> bool:
        """True when the turn is to be served again (prefill included) on another decoder;
        one retry is spent then."""
        if failure.upstream is None:  # no decoder accepted a connection: none is left
            return False
        up = self._decoders.get(failure.upstream)
        if isinstance(failure, UpstreamHTTPError) and failure.status in KV_SOURCE_FAILED:
            att.d_again.append(up)  # D is alive; its read from P failed: it may serve the retry
        else:
            att.d_failed.append(up)
        if not any(u not in att.d_failed and self._health.in_rotation(u)
                   for u in self._decoders.upstreams):
            return False
        return self.spend(att, "decode", turn, failure)

    def spend(self, att: Attempts, leg: str, turn: Turn, failure: Failure) -> bool:
        """Spend one retry on ``leg`` (counted, logged); False when none is left."""
        if att.budget <= 0:
            return False
        att.budget -= 1
        self._metrics.retries_child[leg].inc()
        logger.warning("request %s: retrying the %s leg on another instance after: %s "
                       "(%d retries left)", turn.request_id, leg, message(failure), att.budget)
        return True


def message(failure: Failure) -> str:
    """The human message of a failure (an instance's error body, or the proxy's own)."""
    if isinstance(failure, ProxyError):
        return failure.message
    try:
        return str(json.loads(failure.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {failure.status}"
