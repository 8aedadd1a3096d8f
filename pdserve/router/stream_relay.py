"""Relaying a decoder's SSE stream to the client chunk by chunk, with D's returned
``kv_transfer_params`` recorded for the conversation (or released) and stripped (multi-turn)."""

from __future__ import annotations

import asyncio
from time import perf_counter
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.first_token import DecodeTimer
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.sse import KVParamsWatcher
from pdserve.router.stream_ledger import SSE_DONE, sse_event
from pdserve.router.upstream_client import Turn, UpstreamClient
from pdserve.router.upstreams import Upstream
from pdserve.utils import phase_trace

RecordTurn = Callable[[str, "Upstream | None", Upstream, "dict[str, Any] | None"], Awaitable[None]]


class StreamRelay:
    """Forwards one decode leg's stream as it comes (no parsing beyond the params watcher).

    Args:
        client: the pooled client (failure bodies, the in-flight slot of ``d_up``).
        metrics: the proxy's metrics (added latency before the first byte).
        decode_guard: releases D's params that nobody will pull (a request without a
            conversation).
        record_turn: multi-turn: records the turn's params for its conversation; None in the
            stateless mode, where D returns no params to watch for.
    """

    def __init__(self, client: UpstreamClient, metrics: ProxyMetrics, decode_guard: DecodeLegGuard,
                 record_turn: RecordTurn | None):
        self._client = client
        self._metrics = metrics
        self._guard = decode_guard
        self._record_turn = record_turn
        self._strip = record_turn is not None

    async def relay(self, request: web.Request, out: web.StreamResponse, turn: Turn,
                    d_up: Upstream, d_resp: aiohttp.ClientResponse, p_up: Upstream | None,
                    conv_id: str | None, headers: dict[str, str], held: bytes = b"",
                    timer: DecodeTimer | None = None) -> web.StreamResponse:
        """Relay D's stream into ``out`` (not prepared yet); a failure of D after the first
        byte ends the stream with an SSE error event and ``[DONE]``; a client that goes away
        closes D's response (D aborts the request). Returns ``out``.

        Args:
            held: the stream's start, already read from ``d_resp`` (sent first).
            timer: fed the chunks until D's first token (the decode hand-off time).
        """
        watcher = KVParamsWatcher(strip=True) if self._strip else None
        recorded = False
        content = d_resp.content
        finished = False
        try:
            await out.prepare(request)
            turn.status = 200
            self._metrics.added_latency.observe(perf_counter() - turn.t0 - turn.upstream_wait)
            last = b"\n\n"
            while True:
                try:
                    chunk, held = held or await content.readany(), b""
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    err = self._client.failure(d_up, e)
                    turn.status = err.status  # the request's metric counts the error
                    d_resp.close()
                    sep = b"" if last.endswith(b"\n\n") else b"\n\n"
                    await out.write_eof(sep + sse_event(err.body()) + SSE_DONE)
                    break
                phase_trace.mark("px.chunk")
                if timer is not None and timer.feed(chunk):
                    timer = None
                if not chunk:
                    finished = True
                    await out.write_eof(watcher.flush() if watcher is not None else b"")
                    break
                if watcher is not None:
                    chunk = watcher.feed(chunk)
                    if not recorded and watcher.kv_transfer_params is not None:
                        # Record D's params before the client can see the end of the turn: a
                        # client that sends its next turn as soon as it reads the final event
                        # must find them (else P would try the blocks it already pulled).
                        if conv_id:
                            await self._record_turn(conv_id, p_up, d_up,
                                                    watcher.kv_transfer_params)
                        else:
                            self._guard.release(d_up, watcher.kv_transfer_params, headers)
                        recorded = True
                if content.at_eof():  # D's last chunk: send it with the end of the response
                    finished = True
                    await out.write_eof(chunk + (watcher.flush() if watcher is not None else b""))
                elif chunk:
                    await out.write(chunk)
                    turn.done_sent = chunk.endswith(SSE_DONE)
                last = chunk or last
                if finished:
                    break
        except ConnectionResetError:
            turn.client_left()  # the finally clause aborts the decode, if still running
        finally:
            if finished:
                d_resp.release()
            else:
                d_resp.close()  # D's server sees the disconnect and aborts the request
            self._client.leave(d_up)
        if finished and conv_id and not recorded:
            await self._record_turn(conv_id, p_up, d_up, None)  # keeps the routing stickiness
        return out
