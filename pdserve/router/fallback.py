"""Decode-only fallback: a request no prefill instance can serve is prefilled by a decoder itself.

When every prefiller is out of rotation (circuit open, :mod:`pdserve.router.health`), refused
the connection, or failed the request before its first token with no other prefiller left, the
proxy sends the client's body to a decoder without ``kv_transfer_params``: a ``kv_consumer``
engine takes such a request as a plain one and computes the prompt itself (vLLM's and
Dynamo's behaviour for a request that names no remote KV). Such requests are counted in
``pdserve:proxy_decode_only_fallback_total``. With ``--enforce-disagg`` the proxy answers 503
naming why instead (a deployment that must keep prefill work off its decoders).
"""

from __future__ import annotations

import logging

from prometheus_client import Counter

from pdserve.router.errors import UPSTREAM_UNAVAILABLE, ProxyError

logger = logging.getLogger("pdserve.router")


class DecodeOnlyFallback:
    """Decides, counts and logs the decode-only fallback of requests.

    Args:
        enforce_disagg: ``--enforce-disagg``: refuse (503) instead of falling back.
        counter: ``pdserve:proxy_decode_only_fallback_total``.
    """

    def __init__(self, enforce_disagg: bool, counter: Counter):
        self.enforce_disagg = enforce_disagg
        self._counter = counter

    def take(self, request_id: str, causes: list[str]) -> None:
        """Fall back for one request (counted once per request), or refuse it.

        Args:
            request_id: the request's ``X-Request-Id`` (logged).
            causes: why each prefill instance could not serve it, e.g.
                ``"prefill instance http://h:p out of rotation (circuit open)"``.

        Raises:
            ProxyError: 503 ``upstream_unavailable`` with ``--enforce-disagg``, naming the causes.
        """
        why = "; ".join(causes)
        if self.enforce_disagg:
            raise ProxyError(503, f"no prefill instance is available ({why}); decode-only "
                             "fallback is off (--enforce-disagg)", UPSTREAM_UNAVAILABLE)
        self._counter.inc()
        logger.warning("request %s: no prefill instance is available (%s); a decoder prefills "
                       "it itself (decode-only fallback)", request_id, why)
