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

Every path that gives up on P's blocks releases them, so no lease outlives its request. The
retry bookkeeping is :mod:`pdserve.router.retries` (shared with the concurrent hand-off,
:mod:`pdserve.router.concurrent_legs`, which hands requests it cannot serve concurrently to
:meth:`TurnLegs.run` with its bookkeeping so far).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Callable

import aiohttp

from pdserve.utils import phase_trace
from pdserve.router.bodies import decode_leg_body
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.errors import ProxyError
from pdserve.router.first_token import DecodeTimer
from pdserve.router.kv_routing import PromptBlocks
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.prefill_leg import parse_prefill_answer
from pdserve.router.retries import KV_SOURCE_FAILED, Attempts, RetryPolicy
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool

_encode = json.JSONEncoder(separators=(",", ":")).encode

#: ``route(pool, previous_url, prompt, turn)`` -> the instances to try, best first; ``prompt``:
#: the request's :class:`~pdserve.router.kv_routing.PromptBlocks` (kv-aware routing), or None.
Route = Callable[[UpstreamPool, "str | None", "PromptBlocks | None", Turn], list[Upstream]]


@dataclass
class DecodeAnswer:
    """D's answer to one turn.

    Attributes:
        p_up: the prefiller that served the turn; None after a decode-only fallback.
        p_params: the ``kv_transfer_params`` P returned (None: none, decode-only, or, in the
            concurrent hand-off, P's answer not read yet: D already read P's blocks then).
        d_up: the decoder; its in-flight slot is still held while ``raw`` is None.
        d_resp: D's response (headers read).
        raw: D's whole body; None for a 200 stream (the caller relays it, then calls
            ``client.leave(d_up)``).
        held: the start of a 200 stream the proxy already read from ``d_resp`` and did not
            send (the concurrent hand-off reads up to D's first token before answering, sending
            the opening chunks as they come): the relay sends it first.
        timer: a 200 stream's decode hand-off time still to observe: the relay feeds it the
            stream's chunks until D's first token.
        held_parsed: ``(payload, value)`` of the events in ``held`` already parsed as JSON
            (:attr:`~pdserve.router.first_token.FirstTokenWatch.parsed`), for a relay that
            parses them.
    """

    p_up: Upstream | None
    p_params: dict[str, Any] | None
    d_up: Upstream
    d_resp: aiohttp.ClientResponse
    raw: bytes | None
    held: bytes = b""
    timer: DecodeTimer | None = None
    held_parsed: list[tuple[bytes, Any]] = field(default_factory=list)


class TurnLegs:
    """Runs both legs of a turn with retries and fallback (see the module docstring).

    Args:
        client: the pooled client to the instances.
        prefillers, decoders: the leg pools.
        decode_guard: releases P's blocks the decode leg will not read.
        retries: the retry budget, the instances a request failed on, the decode-only fallback.
        metrics: ``pdserve:proxy_handoff_seconds`` is observed here.
        route: the proxy's routing decision per leg (:data:`Route`).
    """

    def __init__(self, client: UpstreamClient, prefillers: UpstreamPool, decoders: UpstreamPool,
                 decode_guard: DecodeLegGuard, retries: RetryPolicy, metrics: ProxyMetrics,
                 route: Route):
        self._client = client
        self._prefillers = prefillers
        self._decoders = decoders
        self._guard = decode_guard
        self._retries = retries
        self._handoff = metrics.handoff_child
        self._route = route

    async def run(self, path: str, body: dict[str, Any], p_data: bytes, headers: dict[str, str],
                  turn: Turn, stream: bool, previous: tuple[str | None, str | None],
                  prompt: PromptBlocks | None, return_token_ids: bool = False,
                  att: Attempts | None = None,
                  orders: tuple[list[Upstream] | None, list[Upstream] | None] = (None, None),
                  local: bool = False) -> DecodeAnswer:
        """Serve the turn up to D's answer.

        Args:
            path: the generation path (both legs).
            body: the client's checked body (the decode leg's base).
            p_data: the encoded prefill-leg body.
            headers: upstream headers (``X-Request-Id``, auth).
            stream: the client asked for a stream (a 200 stream is returned unread).
            previous: multi-turn: the conversation's previous (prefiller, decoder) URLs.
            prompt: the prompt's token ids and block hashes for kv-aware routing (one
                :class:`~pdserve.router.kv_routing.PromptBlocks` per request, so that each
                routing of either leg reuses its hashes), or None.
            return_token_ids: ask D for the token ids of its answer (a stream that may be
                migrated, :mod:`pdserve.router.migration`).
            att: the request's retry bookkeeping so far (the concurrent hand-off's); None: a
                new one.
            orders: the first prefill and decode orders to try, already routed (the
                concurrent hand-off's decision); None: routed here.
            local: the first attempt goes to the decoder alone, which prefills the request
                itself (:mod:`pdserve.router.local_prefill`); a retry goes through a prefiller.

        Raises:
            ProxyError: 502/503/504 when the turn cannot be served (the last failure, or the
                ``--enforce-disagg`` refusal).
            UpstreamHTTPError: an instance's error answer (4xx; or 5xx with no retry left).
        """
        att = att if att is not None else self._retries.attempts()
        p_order, d_first = orders
        while True:
            if local:
                local = False
                p_up = p_params = None
            else:
                p_up, p_params = await self._prefill(path, p_data, headers, turn, previous[0],
                                                     prompt, att, p_order)
            p_order = None
            phase_trace.mark("px.p_parsed")
            d_data = _encode(decode_leg_body(body, p_params, return_token_ids)).encode()
            phase_trace.mark("px.d_body_built")
            routed = (d_first if d_first is not None
                      else self._route(self._decoders, previous[1], prompt, turn))
            d_first = None
            order = self._retries.decode_order(routed, att)
            t_sent = perf_counter()
            try:
                d_up, d_resp = await self._client.open(order, self._decoders, path, d_data,
                                                       headers, turn)
            except ProxyError as e:
                self._guard.release(p_up, p_params, headers)
                if self._retries.retry_decode(e, att, turn):
                    continue
                raise
            except BaseException:  # the client went away between the legs
                self._guard.release(p_up, p_params, headers)
                raise
            if stream and d_resp.status == 200:
                return DecodeAnswer(p_up, p_params, d_up, d_resp, None,
                                    timer=DecodeTimer(self._handoff["decode"].observe, t_sent))
            try:
                raw = await self._client.read_body(d_up, d_resp, turn)
            except ProxyError as e:
                self._guard.release(p_up, p_params, headers)
                if self._retries.retry_decode(e, att, turn):
                    continue
                raise
            if d_resp.status >= 400:  # D refused the request: it will not read P's blocks
                self._guard.release(p_up, p_params, headers)
                try:
                    self._client.check_status(d_up, d_resp, raw,
                                              breaker=d_resp.status not in KV_SOURCE_FAILED)
                except UpstreamHTTPError as e:
                    if e.status >= 500 and self._retries.retry_decode(e, att, turn):
                        continue
                    raise
            else:
                self._handoff["decode"].observe(perf_counter() - t_sent)
            return DecodeAnswer(p_up, p_params, d_up, d_resp, raw)

    # ------------------------------------------------------------------ prefill leg
    async def _prefill(self, path: str, p_data: bytes, headers: dict[str, str], turn: Turn,
                       previous: str | None, prompt: PromptBlocks | None, att: Attempts,
                       first_order: list[Upstream] | None
                       ) -> tuple[Upstream | None, dict[str, Any] | None]:
        """(P, P's params) once a prefiller served the leg; (None, None) for decode-only."""
        pool = self._prefillers
        while True:
            routed = (first_order if first_order is not None
                      else self._route(pool, previous, prompt, turn))
            first_order = None
            order = [u for u in routed if u not in att.p_failed]
            if not order:
                self._retries.decode_only(turn, att)
                return None, None
            t_sent = perf_counter()
            try:
                p_up, p_resp = await self._client.open(order, pool, path, p_data, headers, turn)
                phase_trace.mark("px.p_hdr")
                p_raw = await self._client.read_body(p_up, p_resp, turn)
                phase_trace.mark("px.p_read")
                self._client.check_status(p_up, p_resp, p_raw)
                params = parse_prefill_answer(self._client, p_up, p_raw)
                self._handoff["prefill"].observe(perf_counter() - t_sent)
                return p_up, params
            except ProxyError as e:
                if e.upstream is None:  # no prefiller in the order accepted a connection
                    self._retries.prefill_unreachable(att, order, e)
                    continue  # free: nothing was sent
                failure: ProxyError | UpstreamHTTPError = e
            except UpstreamHTTPError as e:
                if e.status < 500:
                    raise
                failure = e
            self._retries.prefill_failed(att, pool.get(failure.upstream), failure, turn)
