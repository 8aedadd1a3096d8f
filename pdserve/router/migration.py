"""Mid-stream migration of the decode leg (``--migration-limit N``): a streamed answer whose
decoder fails after some tokens continues on another P/D pair, to the same client.

The decode leg of a migratable stream asks for vLLM's ``return_token_ids``, so every chunk names
the tokens it carries (the proxy strips those fields when the client did not ask for them, and
drops the chunks that only carried tokens whose text is held back). When the decode leg fails —
the connection drops, the stream ends without ``[DONE]``, an in-band error event with a 5xx
code, or no bytes for ``--stall-timeout`` seconds (a live pdserve decoder with nothing to send,
its request queued or preempted, sends an SSE keep-alive comment every
:data:`~pdserve.entrypoints.job_runner.KEEPALIVE_INTERVAL_S`, which the proxy passes on) — the
proxy closes it (a live D aborts the request and frees its blocks; P's lease is released if D
never read it), routes the request again to a prefiller and to a decoder this request has not
failed on, with the client's body plus ``pdserve_resume`` (the prompt ids and the output ids
already streamed; the engine side is :class:`pdserve.entrypoints.protocol.ResumeFields`), and
goes on forwarding, every chunk's ``id`` and ``created`` rewritten to the first leg's. At most
``--migration-limit`` migrations per request; past it (or when no other decoder is left, or the
request cannot be resumed identically: :func:`pdserve.types.resume.resume_refusal`) the client
gets the error event as without migration. docs/proxy.md has the whole contract.

The same relay, without migrating (a failure ends the stream with the error event), serves a
stream whose client has an earlier leg's opening chunk: the concurrent hand-off retried before
D's first token (:mod:`pdserve.router.client_stream`); the ledger gives its chunks that leg's
``id`` and ``created`` as it does a resumed leg's.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
from dataclasses import dataclass, field
from time import perf_counter
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from pdserve.router.bodies import decode_leg_body, prefill_leg_body
from pdserve.router.errors import UPSTREAM_ERROR, UPSTREAM_TIMEOUT, UPSTREAM_UNAVAILABLE, ProxyError
from pdserve.router.first_token import DecodeTimer
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.stream_ledger import (
    SSE_DONE,
    SSE_KEEPALIVE,
    SSEEvents,
    StreamLedger,
    sse_event,
)
from pdserve.router.upstreams import Upstream, UpstreamPool
from pdserve.types.openai_errors import error_type
from pdserve.types.resume import resume_refusal

logger = logging.getLogger("pdserve.router")

#: Default ``--stall-timeout``: seconds without a byte from a streaming decoder before the proxy
#: takes it as failed (only with ``--migration-limit`` > 0; ``--timeout`` applies otherwise).
#: A pdserve decoder sends a keep-alive comment after 10 s with nothing to send
#: (:data:`pdserve.entrypoints.job_runner.KEEPALIVE_INTERVAL_S`): keep this at twice that or more.
DEFAULT_STALL_TIMEOUT_S = 30.0
_encode = json.JSONEncoder(separators=(",", ":")).encode
_DONE = SSE_DONE


class MigrationReason(enum.Enum):
    """Why a decode leg was given up (the ``reason`` label of
    ``pdserve:proxy_migrations_total``)."""

    CONNECTION = "connection"  # the connection failed or was reset
    EOF = "eof"  # the stream ended without [DONE]
    UPSTREAM_ERROR = "upstream_error"  # an in-band error event, or an answer, with a 5xx code
    STALL = "stall"  # nothing for --stall-timeout seconds


def migration_refusal(body: dict[str, Any]) -> str | None:
    """Why a (checked) client body's stream may not be migrated, or None when it may."""
    refusal = resume_refusal(
        n=body.get("n"), seed=body.get("seed"), logprobs=body.get("logprobs"),
        top_logprobs=body.get("top_logprobs"), presence_penalty=body.get("presence_penalty"),
        frequency_penalty=body.get("frequency_penalty"))
    return refusal[1] if refusal is not None else None


@dataclass
class Leg:
    """One P/D attempt of a stream: the instances, P's returned params (None: none, or not read
    yet in the concurrent hand-off) and D's open response; ``held``: the stream's start already
    read from it (relayed first), ``held_parsed`` its events already parsed (``(payload,
    value)``, in order); ``timer``: the decode hand-off time still to observe."""

    p_up: Upstream
    p_params: dict[str, Any] | None
    d_up: Upstream
    d_resp: aiohttp.ClientResponse
    held: bytes = b""
    timer: DecodeTimer | None = None
    held_parsed: list[tuple[bytes, Any]] = field(default_factory=list)


class StreamMigrator:
    """Relays a migratable decode-leg stream to the client, migrating it when it fails.

    Args:
        client: the proxy's upstream client (opens legs, counts failures and in-flight).
        prefillers, decoders: the pools the resumed legs are routed in.
        route: ``route(pool, turn)`` -> the instances to try, best first.
        release: ``release(owner, params, headers)``: free the blocks ``owner`` keeps for
            ``params`` (:meth:`pdserve.router.decode_guard.DecodeLegGuard.release`).
        record_turn: multi-turn only (else None): ``await record_turn(conv_id, p_up, d_up,
            params)`` remembers a conversation's last turn (the last leg's instances and D's
            ``kv_transfer_params``), so that its next turn pulls from that decoder.
        metrics: ``pdserve:proxy_migrations_total`` is counted here.
        limit: the most migrations per request (``--migration-limit``; 0: none, the relay still
            serves the streams that continue an earlier leg's opening chunk).
        stall_timeout: seconds without a byte after which a decode leg has failed.
    """

    def __init__(self, client: UpstreamClient, prefillers: UpstreamPool, decoders: UpstreamPool,
                 route: Callable[[UpstreamPool, Turn], list[Upstream]],
                 release: Callable[[Upstream, dict[str, Any] | None, dict[str, str]], None],
                 record_turn: Callable[[str, Upstream, Upstream, dict[str, Any] | None],
                                       Awaitable[None]] | None,
                 metrics: ProxyMetrics, limit: int, stall_timeout: float):
        self._client = client
        self._prefillers = prefillers
        self._decoders = decoders
        self._route = route
        self._release = release
        self._record_turn = record_turn
        self._metrics = metrics
        self.limit = limit
        self.stall_timeout = stall_timeout

    async def relay(self, request: web.Request, out: web.StreamResponse, turn: Turn, leg: Leg,
                    body: dict[str, Any], conv_id: str | None, headers: dict[str, str],
                    ledger: StreamLedger | None = None,
                    migrate: bool = True) -> web.StreamResponse:
        """Answer ``request`` with ``out`` (not prepared yet, or prepared with what ``ledger``
        records): the stream of ``leg`` (D's response headers read, status 200), migrated when
        it fails.

        In multi-turn mode each chunk's ``kv_transfer_params`` are recorded for ``conv_id``
        with the leg that sent them (released on D when there is no conversation) and forwarded
        as null; a finished turn without them is recorded too (routing stickiness).

        Args:
            body: the client's checked body (the resumed legs' bodies are built from it).
            ledger: what the client already has of the stream (the concurrent hand-off's
                opening chunks, :mod:`pdserve.router.client_stream`); None: nothing.
            migrate: False for a stream that may not be migrated, relayed here because an
                earlier leg's opening went out (its chunks get that leg's ``id``): a failure
                ends it with the error event, and no ``--stall-timeout`` applies.

        Returns:
            ``out``, ended; every leg's response released or closed (a closed one makes a live
            D abort the request), its in-flight slot left. A client that went away is
            ``turn.status`` 499.
        """
        recorded = False

        async def on_kv_params(leg: Leg, params: dict[str, Any]) -> None:
            nonlocal recorded
            if conv_id:  # the last leg's decoder: the next turn pulls from it
                await self._record_turn(conv_id, leg.p_up, leg.d_up, params)
            else:
                self._release(leg.d_up, params, headers)
            recorded = True

        try:
            await out.prepare(request)
            turn.status = 200
            self._metrics.added_latency.observe(perf_counter() - turn.t0 - turn.upstream_wait)
            leg, completed = await self._relay(
                out, turn, leg, body, request.path, headers,
                on_kv_params if self._record_turn is not None else None,
                ledger if ledger is not None else StreamLedger.for_request(body), migrate)
        except ConnectionResetError:
            turn.client_left()  # the open decode leg was closed
            return out
        if completed and conv_id and not recorded:
            await self._record_turn(conv_id, leg.p_up, leg.d_up, None)
        return out

    async def _relay(self, out: web.StreamResponse, turn: Turn, leg: Leg, body: dict[str, Any],
                     path: str, headers: dict[str, str],
                     on_kv_params: Callable[[Leg, dict[str, Any]], Awaitable[None]] | None,
                     ledger: StreamLedger, migrate: bool) -> tuple[Leg, bool]:
        """Forward ``leg``'s stream to ``out`` (prepared), migrating it on failure (when
        ``migrate``); ends ``out``. Returns the last leg and whether the stream ended normally
        (else with an error event). ``on_kv_params``: called with the leg and a chunk's
        ``kv_transfer_params`` before the chunk is forwarded with them set to null (without it
        they are forwarded as they are)."""
        limit = self.limit if migrate else 0
        stall = self.stall_timeout if migrate else None
        tried = {leg.d_up.url}
        migrations = 0
        open_leg: Leg | None = leg
        try:
            while True:
                failed = await self._pump(out, turn, leg, ledger, on_kv_params, stall)
                if failed is None:
                    leg.d_resp.release()
                    open_leg = None
                    self._client.leave(leg.d_up)
                    await out.write_eof()
                    return leg, True
                reason, err = failed
                self._close(leg, headers)
                open_leg = None
                if ledger.finished:  # every token is in; only the end was lost
                    await out.write_eof(ledger.tail())
                    return leg, True
                while True:
                    refusal = self._refusal(ledger, migrations, tried, limit)
                    if refusal is not None:
                        logger.warning("request %s: not migrated (%s): %s", turn.request_id,
                                       refusal, err.message)
                        turn.status = err.status  # the request's metric counts the error
                        await out.write_eof(sse_event(err.body()) + _DONE)
                        return leg, False
                    migrations += 1
                    self._metrics.count_migration(reason.value)
                    logger.warning("request %s: decode leg on %s failed (%s) after %d tokens; "
                                   "migration %d/%d", turn.request_id, leg.d_up.url, reason.value,
                                   len(ledger.output_token_ids), migrations, limit)
                    try:
                        leg = await self._open_legs(ledger.resumed_body(body), path, headers,
                                                    turn, tried)
                    except UpstreamHTTPError as e:
                        if e.status < 500:  # the instance refused the resumed request itself
                            turn.status = e.status
                            await out.write_eof(sse_event(e.body) + _DONE)
                            return leg, False
                        reason, err = MigrationReason.UPSTREAM_ERROR, ProxyError(
                            e.status, _message(e.body), error_type(e.status))
                        continue
                    except ProxyError as e:
                        reason, err = MigrationReason.CONNECTION, e
                        if e.status == 503:  # no instance left to try
                            turn.status = e.status
                            await out.write_eof(sse_event(e.body()) + _DONE)
                            return leg, False
                        continue
                    open_leg = leg
                    break
        finally:
            if open_leg is not None:  # the client went away: D's server aborts the request
                open_leg.d_resp.close()
                self._client.leave(open_leg.d_up)

    def _refusal(self, ledger: StreamLedger, migrations: int, tried: set[str],
                 limit: int) -> str | None:
        if limit == 0:
            return "the request may not be migrated"
        if migrations >= limit:
            return f"--migration-limit {limit} reached"
        if not ledger.resumable():
            return "the decode instance did not return the prompt's token ids"
        if all(u.url in tried for u in self._decoders.upstreams):
            return "no other decode instance"
        return None

    def _close(self, leg: Leg, headers: dict[str, str]) -> None:
        """Give up a failed leg: close D's response (a live D aborts), free P's lease (a no-op
        when D read it), leave the in-flight slot."""
        leg.d_resp.close()
        self._client.leave(leg.d_up)
        self._release(leg.p_up, leg.p_params, headers)

    async def _pump(self, out: web.StreamResponse, turn: Turn, leg: Leg, ledger: StreamLedger,
                    on_kv_params: Callable[[Leg, dict[str, Any]], Awaitable[None]] | None,
                    stall: float | None) -> tuple[MigrationReason, ProxyError] | None:
        """Forward one leg's events until its end (None) or its failure (why, and the error the
        client gets if it is not migrated); ``turn.done_sent`` once ``[DONE]`` is written.
        ``stall``: seconds without a byte after which the leg has failed (None: no limit)."""
        content = leg.d_resp.content
        events = SSEEvents()
        up = leg.d_up
        held, leg.held = leg.held, b""
        parsed, leg.held_parsed = leg.held_parsed, []  # popped as their payloads come
        while True:
            try:
                if held:
                    chunk, held = held, b""
                elif stall is None:
                    chunk = await content.readany()
                else:
                    chunk = await asyncio.wait_for(content.readany(), stall)
            except asyncio.TimeoutError as e:
                if stall is None:  # the upstream client's own read timeout (--timeout)
                    return MigrationReason.CONNECTION, self._client.failure(up, e)
                self._metrics.count_error(up.url, up.leg)
                return MigrationReason.STALL, ProxyError(
                    504, f"decode instance {up.url} sent nothing for {stall:g} s",
                    UPSTREAM_TIMEOUT)
            except aiohttp.ClientError as e:
                return MigrationReason.CONNECTION, self._client.failure(up, e)
            if leg.timer is not None and leg.timer.feed(chunk):
                leg.timer = None
            if not chunk:
                if ledger.done:
                    return None
                self._metrics.count_error(up.url, up.leg)
                return MigrationReason.EOF, ProxyError(
                    502, f"decode instance {up.url} ended the stream before its end",
                    UPSTREAM_ERROR)
            payloads = events.feed(chunk)
            # one write per chunk read, as the plain relay does; a keep-alive (the decoder had
            # nothing to send, the bytes above restarted the stall timer) is passed on too, so
            # that the client's own idle timeout sees a live stream; it came before the events
            # of the same chunk (sent only while nothing else was)
            batch: list[bytes] = [SSE_KEEPALIVE] if events.comments else []
            failed = None
            for payload in payloads:
                if payload == b"[DONE]":
                    ledger.done = True
                    batch.append(_DONE)
                    continue
                if parsed and parsed[0][0] == payload:
                    event, raw = parsed.pop(0)[1], payload
                else:
                    parsed, raw = [], None
                    try:
                        event = json.loads(payload)
                    except ValueError:
                        event = None
                if not isinstance(event, dict):
                    batch.append(b"data: " + payload + b"\n\n")
                    continue
                error = event.get("error")
                if isinstance(error, dict):
                    code = error.get("code")
                    if isinstance(code, int) and code >= 500:
                        self._metrics.count_error(up.url, up.leg)
                        failed = MigrationReason.UPSTREAM_ERROR, ProxyError(
                            code, f"decode instance {up.url}: {error.get('message')}",
                            error_type(code))
                        break
                    batch.append(b"data: " + payload + b"\n\n")
                    continue
                params = event.get("kv_transfer_params")
                if on_kv_params is not None and isinstance(params, dict):
                    await on_kv_params(leg, params)
                    event["kv_transfer_params"] = None
                    raw = None  # changed
                data = ledger.forward(event, raw)
                if data is not None:
                    batch.append(data)
            if batch:
                await out.write(b"".join(batch))
                turn.done_sent = ledger.done
            if failed is not None:
                return failed

    async def _open_legs(self, body: dict[str, Any], path: str, headers: dict[str, str],
                         turn: Turn, tried: set[str]) -> Leg:
        """A prefill leg and a decode leg (on a decoder not in ``tried``, which it is added to
        once reached) for a resumed body.

        Raises:
            ProxyError: 503 when no untried decoder is left or no instance can be reached,
                502/504 when a leg fails.
            UpstreamHTTPError: an instance answered an HTTP error.
        """
        d_order = [u for u in self._route(self._decoders, turn) if u.url not in tried]
        if not d_order:
            raise ProxyError(503, "no other decode instance to continue the stream on",
                             UPSTREAM_UNAVAILABLE)
        p_order = self._route(self._prefillers, turn)
        p_up, p_resp = await self._client.open(p_order, self._prefillers, path,
                                               _encode(prefill_leg_body(body)).encode(),
                                               headers, turn)
        p_raw = await self._client.read_body(p_up, p_resp, turn)
        self._client.check_status(p_up, p_resp, p_raw)
        try:
            p_params = json.loads(p_raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            raise self._client.invalid_response(p_up, "body is not a JSON object") from None
        if p_params is not None and not isinstance(p_params, dict):
            raise self._client.invalid_response(p_up, "kv_transfer_params is not an object")
        d_data = _encode(decode_leg_body(body, p_params)).encode()
        try:
            d_up, d_resp = await self._client.open(d_order, self._decoders, path, d_data,
                                                   headers, turn)
        except BaseException:
            self._release(p_up, p_params, headers)
            raise
        tried.add(d_up.url)  # reached: never tried again in this request, whatever it answers
        if d_resp.status != 200:
            d_raw = await self._client.read_body(d_up, d_resp, turn)
            self._release(p_up, p_params, headers)
            self._client.check_status(d_up, d_resp, d_raw)
            raise self._client.invalid_response(d_up, f"status {d_resp.status}")
        return Leg(p_up, p_params, d_up, d_resp)


def _message(raw: bytes) -> str:
    """The ``error.message`` of an OpenAI-style error body (the raw text otherwise)."""
    try:
        return str(json.loads(raw)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return raw.decode("utf-8", "replace")
