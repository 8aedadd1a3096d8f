"""The concurrent hand-off (``--handoff concurrent``, docs/proxy.md): both legs of a turn sent at
once, up to D's first token, retried on other instances before it.

Per attempt the proxy routes P (and one of P's data-parallel ranks: the one with the fewest
prefill legs in flight, :class:`~pdserve.router.handoff.PrefillRanks`) and D up front, draws a
fresh ``transfer_id``, and sends the prefill leg (:mod:`pdserve.router.prefill_leg`, read in the
background) and the decode leg with pending params (:func:`~pdserve.router.bodies.pending_decode_leg_body`)
together. D's answer is what the client gets; before D's first token (a stream: its first
event with output, :mod:`pdserve.router.first_token`) nothing of the answer has reached the
client but, for a stream, the headers and the chat opening chunks, sent as a decoder accepts the
leg and as its opening comes (:mod:`pdserve.router.client_stream`: a later leg's opening is
dropped, its chunks get the first leg's ``id``), so a failure is retried as in the sequential
flow (:mod:`pdserve.router.legs`), within the same ``--max-retries``:

* **P fails** (5xx, timeout, dropped connection, invalid answer) before D's first token -> the
  decode leg is closed (D aborts the request and frees its blocks), the retry is counted, and
  both legs go again, with a new transfer id, to a prefiller this request has not failed on. A
  prefiller that refused the connection is skipped the same way without spending the budget.
  No prefiller left -> the sequential flow's decode-only fallback (or 503 with
  ``--enforce-disagg``). P's 4xx is the client's error: relayed.
* **D refused the connection** -> the next decoder, same transfer id (P is untouched).
* **D fails after the request was sent**, or answers >= 400 (also an in-band error event before
  its first token) -> P's blocks are released once P answered (or P's leg is closed while it
  runs), then retried or answered as in the sequential flow (502/503: D's KV read failed). A
  decoder that refuses the pending params (400 naming ``kv_transfer_params``: P's engine
  restarted with another engine id, or the two sides disagree) costs no retry: P's endpoints
  are asked again and the request is served sequentially.
* **The client goes away** -> both legs are closed (P's blocks released if P had answered).

After D's first token P holds nothing for the request (D's read ended P's lease; D reads before
it emits a token), and P's answer is read in the background, for the metrics and P's
in-flight counts. Requests that cannot go concurrently are served by :class:`~pdserve.router.legs.TurnLegs`
with this request's retry bookkeeping: a prefiller without KV endpoints (a vLLM engine, an
older pdserve, ranks on other hosts, an engine asked again after a restart), a decoder that is
not a pdserve ``kv_consumer`` (a vLLM one: it is left out of the concurrent legs' orders), and
the decode-only fallback; a stream whose client already has an opening chunk is read here up
to its first token as the concurrent legs' are. Mid-stream migration
(:mod:`pdserve.router.migration`) sends its resumed legs sequentially.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import logging
import uuid
from time import perf_counter
from typing import Any, Callable

import aiohttp

from pdserve.utils import phase_trace
from pdserve.router.bodies import concurrent_prefill_body, pending_decode_leg_body
from pdserve.router.client_stream import ClientStream, LegOpening
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.errors import ProxyError
from pdserve.router.first_token import FirstEvent, FirstEventKind
from pdserve.router.handoff import HandoffTargets, PrefillRanks
from pdserve.router.kv_routing import PromptBlocks
from pdserve.router.legs import DecodeAnswer, Route, TurnLegs
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.prefill_leg import PrefillLeg
from pdserve.router.retries import KV_SOURCE_FAILED, Attempts, RetryPolicy
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool
from pdserve.types.kv_endpoints import DATA_PARALLEL_RANK_HEADER

logger = logging.getLogger("pdserve.router")

_encode = json.JSONEncoder(separators=(",", ":")).encode
#: The ``param`` of a decoder's 400 that refuses the pending params themselves.
_KV_PARAMS = "kv_transfer_params"


class _Next(enum.Enum):
    """What follows an attempt that did not reach D's first token."""

    RETRY = "retry"  # both legs again (another prefiller or decoder, a new transfer id)
    SEQUENTIAL = "sequential"  # the pending params were refused: serve it sequentially


class _DecodeStart:
    """D's response up to its first token: the instance, its response, a non-streamed (or
    error) body, a stream's bytes read so far and their events parsed."""

    __slots__ = ("up", "resp", "raw", "held", "parsed", "first")

    def __init__(self) -> None:
        self.up: Upstream | None = None
        self.resp: aiohttp.ClientResponse | None = None
        self.raw: bytes | None = None
        self.held = b""
        self.parsed: list[tuple[bytes, Any]] = []
        self.first: FirstEvent | None = None


class ConcurrentLegs:
    """Serves turns with the concurrent hand-off (see the module docstring).

    Args:
        client: the pooled client to the instances.
        prefillers, decoders: the leg pools.
        targets: the prefillers' KV endpoints and the concurrent decoders.
        refresh: ``refresh(prefiller)`` asks an instance for its endpoints again, in the
            background (:meth:`pdserve.router.role_check.RoleCheck.refresh`).
        decode_guard: releases P's blocks the decode leg will not read.
        retries: the retry budget and bookkeeping, shared with ``sequential``.
        sequential: serves the requests that cannot go concurrently.
        metrics: ``pdserve:proxy_handoff_seconds`` is observed here.
        route: the proxy's routing decision per leg.
    """

    def __init__(self, client: UpstreamClient, prefillers: UpstreamPool, decoders: UpstreamPool,
                 targets: HandoffTargets, refresh: Callable[[Upstream], None],
                 decode_guard: DecodeLegGuard, retries: RetryPolicy, sequential: TurnLegs,
                 metrics: ProxyMetrics, route: Route):
        self._client = client
        self._prefillers = prefillers
        self._decoders = decoders
        self._targets = targets
        self._refresh = refresh
        self._guard = decode_guard
        self._retries = retries
        self._sequential = sequential
        self._handoff = metrics.handoff_child
        self._route = route
        self._background: set[asyncio.Task] = set()

    async def run(self, path: str, body: dict[str, Any], p_body: dict[str, Any],
                  headers: dict[str, str], turn: Turn, stream: bool,
                  previous: tuple[str | None, str | None], prompt: PromptBlocks | None,
                  return_token_ids: bool = False,
                  client: ClientStream | None = None,
                  d_first: list[Upstream] | None = None) -> DecodeAnswer:
        """Serve the turn up to D's first token (:meth:`TurnLegs.run`'s contract).

        Args:
            p_body: the prefill leg's body (:func:`~pdserve.router.bodies.prefill_leg_body`;
                each attempt adds its transfer id).
            client: a stream's response (its ledger set), opened when a decoder answers the
                decode leg with a 200 stream, sent D's opening chunks as they come
                (:mod:`pdserve.router.client_stream`); None for a non-streamed turn.
            d_first: the first decode order to try, already routed; None: routed here.
            (others): as :meth:`TurnLegs.run`.

        Raises:
            ProxyError: 502/503/504 when the turn cannot be served.
            UpstreamHTTPError: an instance's error answer (4xx; or 5xx with no retry left).
        """
        att = self._retries.attempts()
        concurrent = True
        while True:
            p_order = [u for u in self._route(self._prefillers, previous[0], prompt, turn)
                       if u not in att.p_failed]
            ranks = self._ranks(p_order[0]) if p_order and concurrent else None
            if ranks is None:
                d_order = d_first  # routed by the sequential legs when None
            else:
                routed = (d_first if d_first is not None
                          else self._route(self._decoders, previous[1], prompt, turn))
                d_order = self._retries.decode_order(routed, att)
            d_first = None
            if ranks is None or not d_order or not self._targets.concurrent_decoder(d_order[0]):
                answer = await self._sequential.run(
                    path, body, _encode(p_body).encode(), headers, turn, stream, previous,
                    prompt, return_token_ids, att, (p_order, d_order))
                return await self._continue(answer, client, headers, turn)
            d_order = [u for u in d_order if self._targets.concurrent_decoder(u)]
            outcome = await self._attempt(path, body, p_body, headers, turn, stream,
                                          return_token_ids, p_order[0], ranks, d_order, att,
                                          client)
            if outcome is _Next.SEQUENTIAL:
                concurrent = False
            elif isinstance(outcome, DecodeAnswer):
                return outcome

    async def close(self) -> None:
        """Cancel the prefill legs still read in the background (proxy shutdown)."""
        tasks = list(self._background)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _ranks(self, up: Upstream) -> PrefillRanks | None:
        """The prefiller's endpoints; None to serve it sequentially (asked again when its
        endpoints were forgotten)."""
        ranks = self._targets.prefill(up)
        if ranks is None and self._targets.stale(up):
            self._refresh(up)
        return ranks

    def _stale(self, up: Upstream) -> None:
        """P's engine is not the one its endpoints named: forget them and ask again."""
        self._targets.forget(up)
        self._refresh(up)

    # ------------------------------------------------------------------ one attempt
    async def _attempt(self, path: str, body: dict[str, Any], p_body: dict[str, Any],
                       headers: dict[str, str], turn: Turn, stream: bool, return_token_ids: bool,
                       p_up: Upstream, ranks: PrefillRanks, d_order: list[Upstream],
                       att: Attempts, client: ClientStream | None) -> DecodeAnswer | _Next:
        """Both legs with one transfer id, up to D's first token or a failure."""
        transfer_id = uuid.uuid4().hex
        rank = ranks.pick()
        endpoint = ranks.endpoint(rank)
        p_headers = dict(headers, **{DATA_PARALLEL_RANK_HEADER: str(rank)}) \
            if ranks.multi_rank else headers
        prefill = PrefillLeg(self._client, self._prefillers, self._guard, p_up, ranks, rank,
                             p_headers, turn.request_id, self._handoff["prefill"].observe,
                             self._stale)
        d_data = _encode(pending_decode_leg_body(body, endpoint, ranks.endpoints.tp_size,
                                                 transfer_id, return_token_ids)).encode()
        p_data = _encode(concurrent_prefill_body(p_body, transfer_id)).encode()
        phase_trace.mark("px.d_body_built")
        start = _DecodeStart()
        t_sent = perf_counter()
        p_task = prefill.start(path, p_data)
        self._background.add(p_task)  # P's answer may be read after the request's answer
        p_task.add_done_callback(self._background.discard)
        d_task = asyncio.get_running_loop().create_task(
            self._decode_start(start, d_order, path, d_data, headers, turn, stream, client))
        try:
            while not d_task.done():
                waits = {d_task} if prefill.done else {d_task, prefill.task}
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                if not d_task.done() and prefill.failure is not None:
                    d_task.cancel()  # closes the decode leg: D aborts and frees its blocks
                    await asyncio.gather(d_task, return_exceptions=True)
                    return self._prefill_failed(prefill, att, turn)
        except BaseException:  # the client went away: close both legs
            self._close_decode(d_task, start)
            prefill.abandon()
            raise
        try:
            d_task.result()
        except ProxyError as e:
            if prefill.failure is not None:  # D failed because P did
                return self._prefill_failed(prefill, att, turn)
            prefill.abandon()  # D will not read P's blocks
            # (an error no one instance caused, e.upstream None, is not retried)
            if self._retries.retry_decode(e, att, turn):
                return _Next.RETRY
            raise
        return self._answer(start, prefill, att, turn, t_sent, p_up)

    def _answer(self, start: _DecodeStart, prefill: PrefillLeg, att: Attempts, turn: Turn,
                t_sent: float, p_up: Upstream) -> DecodeAnswer | _Next:
        """D's response up to its first token: the answer, or why it is not one."""
        d_up, d_resp = start.up, start.resp
        first = start.first
        if start.raw is not None and d_resp.status < 400 or (
                first is not None and first.kind is FirstEventKind.TOKEN):
            self._handoff["decode"].observe(perf_counter() - t_sent)
            return DecodeAnswer(p_up, prefill.params, d_up, d_resp, start.raw, held=start.held,
                                held_parsed=start.parsed)
        if prefill.failure is not None:  # D failed because P did
            return self._prefill_failed(prefill, att, turn)
        if first is not None:  # an in-band error before any token: D's answer, as a status
            status = first.code if first.code is not None and first.code >= 400 else 502
            raw, param = first.payload, first.param
        else:
            status, raw = d_resp.status, start.raw
            param = _param(raw)
        prefill.abandon()  # D refused the request: it will not read P's blocks
        if status == 400 and param == _KV_PARAMS:
            logger.warning("request %s: decode instance %s refused the concurrent hand-off's "
                           "params (%s); asking %s for its KV endpoints again and serving the "
                           "request sequentially", turn.request_id, d_up.url,
                           raw.decode("utf-8", "replace")[:200], p_up.url)
            self._stale(p_up)
            return _Next.SEQUENTIAL
        error = self._client.http_error(d_up, status, raw, breaker=status not in KV_SOURCE_FAILED)
        if status >= 500 and self._retries.retry_decode(error, att, turn):
            return _Next.RETRY
        raise error

    def _close_decode(self, d_task: asyncio.Task, start: _DecodeStart) -> None:
        """Close the decode leg whatever it reached (D aborts the request)."""
        if not d_task.done():
            d_task.cancel()  # the task closes what it opened
        elif (not d_task.cancelled() and d_task.exception() is None and start.raw is None
              and start.first is not None and start.first.kind is FirstEventKind.TOKEN):
            start.resp.close()  # a stream up to its first token, not handed on
            self._client.leave(start.up)

    def _prefill_failed(self, prefill: PrefillLeg, att: Attempts, turn: Turn) -> _Next:
        """P's leg failed before D's first token (the decode leg is closed)."""
        failure = prefill.failure
        if isinstance(failure, UpstreamHTTPError) and failure.status < 500:
            raise failure  # the client's error
        self._stale(prefill.up)  # it may come back as another engine: ask it again
        if isinstance(failure, ProxyError) and failure.upstream is None:
            self._retries.prefill_unreachable(att, [prefill.up], failure)
            return _Next.RETRY  # free: nothing was sent
        self._retries.prefill_failed(att, prefill.up, failure, turn)
        return _Next.RETRY

    # ------------------------------------------------------------------ decode leg
    async def _decode_start(self, start: _DecodeStart, order: list[Upstream], path: str,
                            data: bytes, headers: dict[str, str], turn: Turn,
                            stream: bool, client: ClientStream | None) -> None:
        """Open the decode leg and read it up to D's first token (a 200 stream, which opens
        ``client`` first) or its whole body (into ``start``). Cancelled, or failing, it closes
        the leg.

        Raises:
            ProxyError: no decoder accepted a connection (503), or D failed (502/504).
        """
        up, resp = await self._client.open(order, self._decoders, path, data, headers, turn)
        start.up, start.resp = up, resp
        if not stream or resp.status != 200:
            start.raw = await self._client.read_body(up, resp, turn)
            return
        t = perf_counter()
        try:
            await client.open(resp.headers.get("Content-Type", "text/event-stream"))
            await self._read_start(start, client)
        except BaseException:
            resp.close()  # D's server sees the disconnect and aborts the request
            self._client.leave(up)
            raise
        finally:
            turn.upstream_wait += perf_counter() - t
        if start.first.kind is FirstEventKind.ERROR:  # not relayed: D's answer is an error
            resp.close()
            self._client.leave(up)

    async def _read_start(self, start: _DecodeStart, client: ClientStream) -> None:
        """Read ``start``'s 200 stream up to D's first token (``start.first``), its opening
        chunks sent to ``client`` as they come (:class:`LegOpening`); the rest read is held.

        Raises:
            ProxyError: D failed (502/504), or tokenized the prompt otherwise than the leg whose
                opening the client has (502).
        """
        up, resp = start.up, start.resp
        reader = LegOpening(client, resp, up.url)
        while start.first is None:
            try:
                chunk = await resp.content.readany()
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise self._client.failure(up, e) from e
            if not chunk:
                raise self._client.invalid_response(up, "the stream ended before its first token")
            start.first = await reader.feed(chunk)
        start.held, start.parsed = reader.held, reader.parsed

    async def _continue(self, answer: DecodeAnswer, client: ClientStream | None,
                        headers: dict[str, str], turn: Turn) -> DecodeAnswer:
        """A stream served sequentially after an earlier leg's opening went out: read up to
        D's first token as :meth:`_read_start` does (its own opening is dropped; an in-band
        error is held for the relay). Other answers are returned as they are.

        Raises:
            ProxyError: D failed before its first token (not retried: its stream is the one
                the client gets, as in the sequential flow), or tokenized the prompt otherwise.
        """
        if client is None or client.opener is None or answer.raw is not None:
            return answer
        start = _DecodeStart()
        start.up, start.resp = answer.d_up, answer.d_resp
        t = perf_counter()
        try:
            await self._read_start(start, client)
        except BaseException:
            answer.d_resp.close()  # D's server sees the disconnect and aborts the request
            self._client.leave(answer.d_up)
            self._guard.release(answer.p_up, answer.p_params, headers)
            raise
        finally:
            turn.upstream_wait += perf_counter() - t
        return dataclasses.replace(answer, held=start.held, held_parsed=start.parsed)


def _param(raw: bytes | None) -> str | None:
    """The ``error.param`` of an OpenAI-style error body."""
    try:
        param = json.loads(raw)["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
    return param if isinstance(param, str) else None

