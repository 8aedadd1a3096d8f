"""Both legs of one turn up to D's answer, retried on other instances before the first token.

:meth:`TurnLegs.run` sends the prefill leg, then opens the decode leg, and returns D's response
(headers read; the body too, unless it is a 200 stream for the caller to relay). Before anything
reached the client, a failed instance is replaced by another one, within one retry budget per
request shared by both legs (``--max-retries``):

* **Prefill leg**: P failed after the request was sent (HTTP 5xx, timeout, dropped connection,
  invalid answer) -> the leg goes to another prefiller. A refused connection (nothing sent) moves
  on to the next prefiller without counting. With no prefiller left (all failed this request or
  are out of rotation) -> decode-only fallback (:mod:`pdserve.router.fallback`), or 503 with
  ``--enforce-disagg``.
* **Decode leg**: a refused connection -> the next decoder with the same P params (nobody
  claimed P's blocks). D failed after the request was sent (HTTP 5xx, timeout, dropped
  connection, before its response reached the client) -> P's blocks are released
  (:mod:`pdserve.router.decode_guard`; D may have claimed them, so they are not reused), and the
  turn is prefilled again and decoded on another decoder; a decoder that answered 502/503 (its
  KV read from P failed: P died or hung) is only tried after the others, and serves the retry
  itself when it is the only one (a prefiller that died meanwhile then means decode-only).
* An instance's 4xx is the client's error: relayed, never retried. A retry goes to an instance
  the request has not failed on; with none left, or no budget left, the last error is answered.

Every path that gives up on P's blocks releases them, so no lease outlives its request.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from pdserve.utils import phase_trace
from pdserve.router.bodies import decode_leg_body
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.errors import ProxyError
from pdserve.router.fallback import DecodeOnlyFallback
from pdserve.router.health import UpstreamHealth
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

_encode = json.JSONEncoder(separators=(",", ":")).encode

#: A decoder's answers when its KV read from the prefiller failed (P did not answer in time /
#: transport error; docs/configuration.md, ``kv_load_failure_policy``): D itself is alive, so
#: with no other decoder the retry (a new prefill, or decode-only) may go to it again, and the
#: answer does not count against D's circuit breaker.
_KV_SOURCE_FAILED = (502, 503)
#: ``route(pool, previous_url, token_ids, turn)`` -> the instances to try, best first.
Route = Callable[[UpstreamPool, "str | None", "list[int] | None", Turn], list[Upstream]]


@dataclass
class DecodeAnswer:
    """D's answer to one turn.

    Attributes:
        p_up: the prefiller that served the turn; None after a decode-only fallback.
        p_params: the ``kv_transfer_params`` P returned (None: none, or decode-only).
        d_up: the decoder; its in-flight slot is still held while ``raw`` is None.
        d_resp: D's response (headers read).
        raw: D's whole body; None for a 200 stream (the caller relays it, then calls
            ``client.leave(d_up)``).
    """

    p_up: Upstream | None
    p_params: dict[str, Any] | None
    d_up: Upstream
    d_resp: aiohttp.ClientResponse
    raw: bytes | None


@dataclass
class _Attempts:
    """One request's retry bookkeeping: budget left and the instances it failed on."""

    budget: int
    p_failed: list[Upstream] = field(default_factory=list)
    d_failed: list[Upstream] = field(default_factory=list)
    d_again: list[Upstream] = field(default_factory=list)  # answered 502/503: tried last
    causes: list[str] = field(default_factory=list)  # why prefillers did not serve, in order
    fell_back: bool = False


class TurnLegs:
    """Runs both legs of a turn with retries and fallback (see the module docstring).

    Args:
        client: the pooled client to the instances.
        prefillers, decoders: the leg pools.
        health: the instances' circuit breakers (who is in rotation).
        decode_guard: releases P's blocks the decode leg will not read.
        fallback: the decode-only fallback (or its refusal, ``--enforce-disagg``).
        metrics: counts retries.
        route: the proxy's routing decision per leg (:data:`Route`).
        max_retries: the retry budget of one request (``--max-retries``).
    """

    def __init__(self, client: UpstreamClient, prefillers: UpstreamPool, decoders: UpstreamPool,
                 health: UpstreamHealth, decode_guard: DecodeLegGuard,
                 fallback: DecodeOnlyFallback, metrics: ProxyMetrics, route: Route,
                 max_retries: int):
        self._client = client
        self._prefillers = prefillers
        self._decoders = decoders
        self._health = health
        self._guard = decode_guard
        self._fallback = fallback
        self._metrics = metrics
        self._route = route
        self._max_retries = max_retries

    async def run(self, path: str, body: dict[str, Any], p_data: bytes, headers: dict[str, str],
                  turn: Turn, stream: bool, previous: tuple[str | None, str | None],
                  token_ids: list[int] | None, return_token_ids: bool = False) -> DecodeAnswer:
        """Serve the turn up to D's answer.

        Args:
            path: the generation path (both legs).
            body: the client's checked body (the decode leg's base).
            p_data: the encoded prefill-leg body.
            headers: upstream headers (``X-Request-Id``, auth).
            stream: the client asked for a stream (a 200 stream is returned unread).
            previous: multi-turn: the conversation's previous (prefiller, decoder) URLs.
            token_ids: kv-aware routing's prompt ids, or None.
            return_token_ids: ask D for the token ids of its answer (a stream that may be
                migrated, :mod:`pdserve.router.migration`).

        Raises:
            ProxyError: 502/503/504 when the turn cannot be served (the last failure, or the
                ``--enforce-disagg`` refusal).
            UpstreamHTTPError: an instance's error answer (4xx; or 5xx with no retry left).
        """
        att = _Attempts(self._max_retries)
        while True:
            p_up, p_params = await self._prefill(path, p_data, headers, turn, previous[0],
                                                 token_ids, att)
            phase_trace.mark("px.p_parsed")
            d_data = _encode(decode_leg_body(body, p_params, return_token_ids)).encode()
            phase_trace.mark("px.d_body_built")
            routed = [u for u in self._route(self._decoders, previous[1], token_ids, turn)
                      if u not in att.d_failed]
            order = ([u for u in routed if u not in att.d_again]
                     + [u for u in routed if u in att.d_again])
            try:
                d_up, d_resp = await self._client.open(order, self._decoders, path, d_data,
                                                       headers, turn)
            except ProxyError as e:
                self._guard.release(p_up, p_params, headers)
                if self._retry_decode(e, att, turn):
                    continue
                raise
            except BaseException:  # the client went away between the legs
                self._guard.release(p_up, p_params, headers)
                raise
            if stream and d_resp.status == 200:
                return DecodeAnswer(p_up, p_params, d_up, d_resp, None)
            try:
                raw = await self._client.read_body(d_up, d_resp, turn)
            except ProxyError as e:
                self._guard.release(p_up, p_params, headers)
                if self._retry_decode(e, att, turn):
                    continue
                raise
            if d_resp.status >= 400:  # D refused the request: it will not read P's blocks
                self._guard.release(p_up, p_params, headers)
                try:
                    self._client.check_status(d_up, d_resp, raw,
                                              breaker=d_resp.status not in _KV_SOURCE_FAILED)
                except UpstreamHTTPError as e:
                    if e.status >= 500 and self._retry_decode(e, att, turn):
                        continue
                    raise
            return DecodeAnswer(p_up, p_params, d_up, d_resp, raw)

    # ------------------------------------------------------------------ prefill leg
    async def _prefill(self, path: str, p_data: bytes, headers: dict[str, str], turn: Turn,
                       previous: str | None, token_ids: list[int] | None,
                       att: _Attempts) -> tuple[Upstream | None, dict[str, Any] | None]:
        """(P, P's params) once a prefiller served the leg; (None, None) for decode-only."""
        pool = self._prefillers
        while True:
            order = [u for u in self._route(pool, previous, token_ids, turn)
                     if u not in att.p_failed]
            if not order:
                self._decode_only(turn, att)
                return None, None
            try:
                p_up, p_resp = await self._client.open(order, pool, path, p_data, headers, turn)
                phase_trace.mark("px.p_hdr")
                p_raw = await self._client.read_body(p_up, p_resp, turn)
                phase_trace.mark("px.p_read")
                self._client.check_status(p_up, p_resp, p_raw)
                return p_up, self._params(p_up, p_raw)
            except ProxyError as e:
                if e.upstream is None:  # no prefiller in the order accepted a connection
                    att.causes.append(e.message)  # one clause per instance
                    att.p_failed.extend(order)
                    continue  # free: nothing was sent
                failure: ProxyError | UpstreamHTTPError = e
            except UpstreamHTTPError as e:
                if e.status < 500:
                    raise
                failure = e
            up = pool.get(failure.upstream)
            att.p_failed.append(up)
            att.causes.append(_message(failure))
            if att.budget <= 0:
                raise failure
            if not self._prefiller_left(att) and self._fallback.enforce_disagg:
                self._decode_only(turn, att)  # raises the refusal, naming the causes
            self._spend(att, "prefill", turn, failure)

    def _params(self, p_up: Upstream, p_raw: bytes) -> dict[str, Any] | None:
        try:
            answer = json.loads(p_raw)
        except ValueError:
            raise self._client.invalid_response(p_up, "body is not JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if params is not None and not isinstance(params, dict):
            raise self._client.invalid_response(p_up, "kv_transfer_params is not an object")
        return params

    def _prefiller_left(self, att: _Attempts) -> bool:
        return any(u not in att.p_failed and self._health.in_rotation(u)
                   for u in self._prefillers.upstreams)

    def _decode_only(self, turn: Turn, att: _Attempts) -> None:
        if att.fell_back:
            return
        causes = att.causes + [f"prefill instance {u.url} out of rotation (circuit open)"
                               for u in self._prefillers.upstreams if u not in att.p_failed]
        self._fallback.take(turn.request_id, causes)
        att.fell_back = True

    # ------------------------------------------------------------------ decode leg
    def _retry_decode(self, failure: ProxyError | UpstreamHTTPError, att: _Attempts,
                      turn: Turn) -> bool:
        """True when the turn is to be served again (prefill included) on another decoder."""
        if failure.upstream is None:  # no decoder accepted a connection: none is left
            return False
        up = self._decoders.get(failure.upstream)
        if isinstance(failure, UpstreamHTTPError) and failure.status in _KV_SOURCE_FAILED:
            att.d_again.append(up)  # D is alive; its read from P failed: it may serve the retry
        else:
            att.d_failed.append(up)
        if not any(u not in att.d_failed and self._health.in_rotation(u)
                   for u in self._decoders.upstreams):
            return False
        return self._spend(att, "decode", turn, failure)

    def _spend(self, att: _Attempts, leg: str, turn: Turn,
               failure: ProxyError | UpstreamHTTPError) -> bool:
        if att.budget <= 0:
            return False
        att.budget -= 1
        self._metrics.retries_child[leg].inc()
        logger.warning("request %s: retrying the %s leg on another instance after: %s "
                       "(%d retries left)", turn.request_id, leg, _message(failure), att.budget)
        return True


def _message(failure: ProxyError | UpstreamHTTPError) -> str:
    """The human message of a failure (an instance's error body, or the proxy's own)."""
    if isinstance(failure, ProxyError):
        return failure.message
    try:
        return str(json.loads(failure.body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return f"HTTP {failure.status}"
