"""The disaggregation proxy's HTTP application (aiohttp server + pooled aiohttp client).

One generation request (``POST /v1/completions`` or ``/v1/chat/completions``) becomes two legs
(DESIGN.md §2): a prefill leg to a P instance (``max_tokens=1``, non-streaming; its answer carries
``kv_transfer_params``) and a decode leg to a D instance (the client's body plus P's params), whose
answer goes back to the client byte for byte; a streamed answer is forwarded chunk by chunk as it
arrives. Both legs carry the same ``X-Request-Id``.

Why aiohttp on both sides: on the 2-core development machine the same pass-through written with
FastAPI/uvicorn (h11) + httpx reached about 270 requests/s, FastAPI + an aiohttp client about
1,100-2,100, and aiohttp server + client 1,700-3,200 (docs/proxy.md has the figures).

Failure handling (status codes in docs/proxy.md):

* an instance that cannot be connected to (nothing was sent) -> the next instance of the same leg
  is tried; when none can be reached -> 503 naming each instance tried;
* an instance that times out -> 504; that drops the connection or answers garbage -> 502; such
  requests are not retried (the instance may have acted on them);
* an instance's own HTTP error (4xx/5xx) -> passed to the client with its status, never retried;
* a failure after the stream to the client has started -> an SSE ``data: {"error": ...}`` event,
  then ``data: [DONE]``;
* the client going away -> the open upstream request is closed, which makes the instance's server
  abort it (during the prefill leg: P aborts and frees the blocks, no decode leg is sent);
* work D will not do is not left to P (:mod:`pdserve.router.decode_guard`): no prefill while
  no decoder is reachable (503); P's blocks released at once when the decode leg will not read
  them.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import uuid
from time import perf_counter
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from pdserve.router.bodies import (check_client_body, conversation_key, decode_leg_body,
                                   prefill_leg_body)
from pdserve.router.config import ProxyConfig
from pdserve.router.conversations import ConversationStore
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.errors import (AUTHENTICATION, INVALID_REQUEST, NOT_FOUND, UPSTREAM_ERROR,
                                   UPSTREAM_TIMEOUT, UPSTREAM_UNAVAILABLE, ProxyError, error_bytes,
                                   normalize_upstream_error)
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.sse import KVParamsWatcher
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

#: Largest client request body accepted (bytes); long multi-turn histories are large.
MAX_BODY_BYTES = 64 * 1024 * 1024
#: Upper bound on the TCP connect timeout to an instance (s); --timeout applies when smaller.
CONNECT_TIMEOUT_S = 10.0
#: Seconds an idle pooled connection to an instance is kept. Below uvicorn's default keep-alive
#: (5 s) so the proxy never sends a request on a connection the server is about to close.
UPSTREAM_KEEPALIVE_S = 3.0
#: Timeout of one /health probe of an instance (s).
HEALTH_PROBE_TIMEOUT_S = 5.0

_JSON = "application/json"
_encode = json.JSONEncoder(separators=(",", ":")).encode
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
_SSE_DONE = b"data: [DONE]\n\n"


class _UpstreamHTTPError(Exception):
    """An instance answered with HTTP >= 400; ``body`` is the (OpenAI-shaped) body to relay."""

    def __init__(self, status: int, body: bytes):
        super().__init__(status)
        self.status = status
        self.body = body


class _Turn:
    """Per-request bookkeeping: id, timing (s, ``perf_counter``) and the answered status."""

    __slots__ = ("request_id", "t0", "upstream_wait", "status")

    def __init__(self, request_id: str, t0: float):
        self.request_id = request_id
        self.t0 = t0
        self.upstream_wait = 0.0
        self.status = 499  # until something is answered: the client went away


class DisaggProxy:
    """Routes OpenAI requests through a prefill instance, then a decode instance.

    Args:
        config: validated settings (:class:`pdserve.router.config.ProxyConfig`).

    Attributes:
        prefillers, decoders: the instance pools (in-flight counts, routing).
        conversations: multi-turn state, or None without ``--multi-turn``.
        metrics: the Prometheus metrics served at ``/metrics``.
    """

    def __init__(self, config: ProxyConfig):
        self.config = config
        self.prefillers = UpstreamPool("prefill", config.prefillers, config.routing)
        self.decoders = UpstreamPool("decode", config.decoders, config.routing)
        self.conversations = (ConversationStore(config.max_conversations, config.conversation_ttl)
                              if config.multi_turn else None)
        self.metrics = ProxyMetrics(config.prefillers, config.decoders)
        self.session: aiohttp.ClientSession | None = None
        self._api_key = (f"Bearer {config.api_key}".encode() if config.api_key else None)
        self._upstream_auth = (f"Bearer {config.upstream_api_key}" if config.upstream_api_key else None)
        # Parsed upstream URLs per (instance, path): parsing a URL string per request costs more
        # than the rest of building the request.
        self._urls = {(up.url, path): URL(up.url + path)
                      for pool in (self.prefillers, self.decoders) for up in pool.upstreams
                      for path in _ENDPOINTS}
        self.decode_guard = DecodeLegGuard(self.decoders, self._probe, self.metrics,
                                           lambda: self.session)

    # ------------------------------------------------------------------ application
    def build_app(self) -> web.Application:
        """The aiohttp application (run it with ``handler_cancellation=True``, see :func:`serve`)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        app.on_startup.append(self._start_client)
        app.on_cleanup.append(self._close_client)
        return app

    async def _start_client(self, app: web.Application) -> None:
        timeout = aiohttp.ClientTimeout(total=None,
                                        sock_connect=min(self.config.timeout, CONNECT_TIMEOUT_S),
                                        sock_read=self.config.timeout)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S,
                                         ttl_dns_cache=300)
        # No cookie jar: the proxy must not carry one client's cookies to another's request (and
        # skipping cookie handling saves CPU per request).
        self.session = aiohttp.ClientSession(connector=connector, timeout=timeout,
                                             cookie_jar=aiohttp.DummyCookieJar())

    async def _close_client(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    # ------------------------------------------------------------------ helpers
    def _authorized(self, request: web.Request) -> bool:
        if self._api_key is None:
            return True
        given = request.headers.get("Authorization", "").encode()
        return hmac.compare_digest(given, self._api_key)

    def _upstream_headers(self, request: web.Request, request_id: str | None) -> dict[str, str]:
        headers = {"Content-Type": _JSON}
        if request_id is not None:
            headers["X-Request-Id"] = request_id
        auth = self._upstream_auth or request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        return headers

    def _enter(self, up: Upstream) -> None:
        up.in_flight += 1
        self.metrics.in_flight_child[(up.leg, up.url)].inc()

    def _leave(self, up: Upstream) -> None:
        up.in_flight -= 1
        self.metrics.in_flight_child[(up.leg, up.url)].dec()

    def _failure(self, up: Upstream, exc: BaseException) -> ProxyError:
        """Count and describe an upstream failure after the request may have reached it."""
        self.metrics.count_error(up.url, up.leg)
        if isinstance(exc, asyncio.TimeoutError):
            err = ProxyError(504, f"{up.leg} instance {up.url} timed out after "
                             f"{self.config.timeout:g} s", UPSTREAM_TIMEOUT)
        else:
            err = ProxyError(502, f"{up.leg} instance {up.url} failed: "
                             f"{type(exc).__name__}: {exc}".rstrip(": "), UPSTREAM_ERROR)
        logger.warning("%s", err.message)
        return err

    async def _open(self, pool: UpstreamPool, path: str, data: bytes, headers: dict[str, str],
                    preferred: Upstream | None, turn: _Turn) -> tuple[Upstream, aiohttp.ClientResponse]:
        """POST ``data`` to an instance of ``pool`` and return it with its response (headers read).

        The instance's in-flight count is raised; the caller must lower it (``_leave``) and
        release or close the response.

        Raises:
            ProxyError: 503 when no instance accepted a connection, 502/504 on other failures.
        """
        unreachable = []
        for up in pool.order(preferred):
            self._enter(up)
            t = perf_counter()
            try:
                resp = await self.session.post(self._urls[(up.url, path)], data=data, headers=headers)
            except (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError) as e:
                # Nothing was sent: safe to try the next instance of the same leg.
                turn.upstream_wait += perf_counter() - t
                self._leave(up)
                pool.mark_down(up)
                self.metrics.count_error(up.url, up.leg)
                reason = _connect_reason(e)
                logger.warning("%s instance %s unreachable (%s)", up.leg, up.url, reason)
                unreachable.append(f"{up.leg} instance {up.url} unreachable ({reason})")
                continue
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self._leave(up)
                raise self._failure(up, e) from e
            except BaseException:
                self._leave(up)
                raise
            turn.upstream_wait += perf_counter() - t
            pool.mark_up(up)
            return up, resp
        raise ProxyError(503, "; ".join(unreachable), UPSTREAM_UNAVAILABLE)

    async def _read_body(self, up: Upstream, resp: aiohttp.ClientResponse, turn: _Turn) -> bytes:
        """Read a whole upstream body, then release the connection and the in-flight slot.

        Raises:
            ProxyError: 502/504 when reading fails.
        """
        t = perf_counter()
        try:
            raw = await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            resp.close()
            raise self._failure(up, e) from e
        except BaseException:
            resp.close()  # client went away: closing makes the instance abort the request
            raise
        finally:
            turn.upstream_wait += perf_counter() - t
            self._leave(up)
        resp.release()
        return raw

    def _check_status(self, up: Upstream, resp: aiohttp.ClientResponse, raw: bytes) -> None:
        if resp.status >= 400:
            if resp.status >= 500:
                self.metrics.count_error(up.url, up.leg)
            raise _UpstreamHTTPError(resp.status,
                                     normalize_upstream_error(resp.status, raw, up.leg, up.url))

    def _invalid_response(self, up: Upstream, what: str) -> ProxyError:
        self.metrics.count_error(up.url, up.leg)
        err = ProxyError(502, f"{up.leg} instance {up.url} returned an invalid response: {what}",
                         UPSTREAM_ERROR)
        logger.warning("%s", err.message)
        return err

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        turn = _Turn(request.headers.get("X-Request-Id") or uuid.uuid4().hex, perf_counter())
        endpoint = _ENDPOINTS[request.path]
        try:
            return await self._generate_turn(request, turn)
        except ProxyError as e:
            turn.status = e.status
            return _json_response(e.status, e.body(), turn.request_id)
        except _UpstreamHTTPError as e:
            turn.status = e.status
            return _json_response(e.status, e.body, turn.request_id)
        except asyncio.CancelledError:
            turn.status = 499  # the client went away (handler cancellation)
            raise
        finally:
            self.metrics.count_request(endpoint, turn.status)

    async def _generate_turn(self, request: web.Request, turn: _Turn) -> web.StreamResponse:
        if not self._authorized(request):
            raise ProxyError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                             AUTHENTICATION)
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ProxyError(413, f"request body larger than {MAX_BODY_BYTES} bytes",
                             INVALID_REQUEST) from None
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ProxyError(400, f"request body is not valid JSON: {e}", INVALID_REQUEST) from None
        check_client_body(body)
        store = self.conversations
        conv_id = None
        if store is not None:
            conv_id = conversation_key(body, request.headers.get("X-Session-ID"))
        state = store.get(conv_id) if conv_id else None
        headers = self._upstream_headers(request, turn.request_id)
        path = request.path

        if not await self.decode_guard.decoders_reachable():
            raise ProxyError(503, "no decode instance is reachable ("
                             + ", ".join(u.url for u in self.decoders.upstreams)
                             + "); the request was not prefilled", UPSTREAM_UNAVAILABLE)

        # Prefill leg.
        p_body = prefill_leg_body(body, state.kv_transfer_params if state else None)
        p_up, p_resp = await self._open(self.prefillers, path, _encode(p_body).encode(), headers,
                                        self.prefillers.get(state.prefiller_url) if state else None,
                                        turn)
        p_raw = await self._read_body(p_up, p_resp, turn)
        self._check_status(p_up, p_resp, p_raw)
        try:
            p_answer = json.loads(p_raw)
        except ValueError:
            raise self._invalid_response(p_up, "body is not JSON") from None
        p_params = p_answer.get("kv_transfer_params") if isinstance(p_answer, dict) else None
        if p_params is not None and not isinstance(p_params, dict):
            raise self._invalid_response(p_up, "kv_transfer_params is not an object")

        # Decode leg.
        d_data = _encode(decode_leg_body(body, p_params)).encode()
        try:
            d_up, d_resp = await self._open(self.decoders, path, d_data, headers,
                                            self.decoders.get(state.decoder_url) if state else None,
                                            turn)
        except BaseException:  # no decoder reachable, or the client went away between the legs
            self.decode_guard.release(p_up, p_params, headers)
            raise
        if body.get("stream") is True and d_resp.status == 200:
            return await self._relay_stream(request, turn, d_up, d_resp, p_up, conv_id)
        d_raw = await self._read_body(d_up, d_resp, turn)
        if d_resp.status >= 400:  # D refused the request: it will not read P's blocks
            self.decode_guard.release(p_up, p_params, headers)
        self._check_status(d_up, d_resp, d_raw)
        if conv_id:
            try:
                d_answer = json.loads(d_raw)
            except ValueError:
                d_answer = None  # relayed as it is; there is just nothing to remember
            d_params = d_answer.get("kv_transfer_params") if isinstance(d_answer, dict) else None
            self._record_turn(conv_id, p_up, d_up, d_params if isinstance(d_params, dict) else None)
        turn.status = d_resp.status
        resp = web.Response(body=d_raw, status=d_resp.status, headers={
            "Content-Type": d_resp.headers.get("Content-Type", _JSON),
            "X-Request-Id": turn.request_id})
        self.metrics.added_latency.observe(perf_counter() - turn.t0 - turn.upstream_wait)
        return resp

    def _record_turn(self, conv_id: str, p_up: Upstream, d_up: Upstream,
                     d_params: dict[str, Any] | None) -> None:
        self.conversations.record_turn(conv_id, p_up.url, d_up.url, d_params)
        self.metrics.conversations.set(len(self.conversations))

    async def _relay_stream(self, request: web.Request, turn: _Turn, d_up: Upstream,
                            d_resp: aiohttp.ClientResponse, p_up: Upstream,
                            conv_id: str | None) -> web.StreamResponse:
        """Forward D's SSE stream chunk by chunk; watch it for ``kv_transfer_params`` if needed."""
        out = web.StreamResponse(status=200, headers={
            "Content-Type": d_resp.headers.get("Content-Type", "text/event-stream"),
            "Cache-Control": "no-cache",
            "X-Request-Id": turn.request_id})
        watcher = KVParamsWatcher() if conv_id else None
        recorded = False
        content = d_resp.content
        finished = False
        try:
            await out.prepare(request)
            turn.status = 200
            self.metrics.added_latency.observe(perf_counter() - turn.t0 - turn.upstream_wait)
            last = b"\n\n"
            while True:
                try:
                    chunk = await content.readany()
                except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                    err = self._failure(d_up, e)
                    d_resp.close()
                    sep = b"" if last.endswith(b"\n\n") else b"\n\n"
                    await out.write_eof(sep + b"data: " + err.body() + b"\n\n" + _SSE_DONE)
                    break
                if not chunk:
                    finished = True
                    await out.write_eof()
                    break
                if watcher is not None and not recorded:
                    # Record D's params before the client can see the end of the turn: a
                    # client that sends its next turn as soon as it reads the final event
                    # must find them (else P would try the blocks it already pulled).
                    watcher.feed(chunk)
                    if watcher.kv_transfer_params is not None:
                        self._record_turn(conv_id, p_up, d_up, watcher.kv_transfer_params)
                        recorded = True
                if content.at_eof():  # D's last chunk: send it with the end of the response
                    finished = True
                    await out.write_eof(chunk)
                else:
                    await out.write(chunk)
                last = chunk
                if finished:
                    break
        except ConnectionResetError:
            turn.status = 499  # the client went away; the finally clause aborts the decode
        finally:
            if finished:
                d_resp.release()
            else:
                d_resp.close()  # D's server sees the disconnect and aborts the request
            self._leave(d_up)
        if finished and conv_id and not recorded:
            self._record_turn(conv_id, p_up, d_up, None)  # keeps the routing stickiness
        return out

    # ------------------------------------------------------------------ other routes
    async def _models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` from the first decode (then prefill) instance that answers."""
        if not self._authorized(request):
            return _json_response(401, error_bytes("invalid or missing API key", AUTHENTICATION, 401))
        headers = self._upstream_headers(request, None)
        failures = []
        for up in self.decoders.upstreams + self.prefillers.upstreams:
            try:
                async with self.session.get(up.url + "/v1/models", headers=headers) as resp:
                    raw = await resp.read()
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                self.metrics.count_error(up.url, up.leg)
                failures.append(f"{up.leg} instance {up.url} unreachable ({_connect_reason(e)})")
                continue
            if status < 500:
                body = raw if status == 200 else normalize_upstream_error(status, raw, up.leg, up.url)
                return _json_response(status, body)
            self.metrics.count_error(up.url, up.leg)
            failures.append(f"{up.leg} instance {up.url} failed with HTTP {status}")
        return _json_response(503, error_bytes("; ".join(failures), UPSTREAM_UNAVAILABLE, 503))

    async def _probe(self, up: Upstream) -> bool:
        timeout = aiohttp.ClientTimeout(total=min(self.config.timeout, HEALTH_PROBE_TIMEOUT_S))
        headers = {"Authorization": self._upstream_auth} if self._upstream_auth else None
        try:
            async with self.session.get(up.url + "/health", timeout=timeout, headers=headers) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _health(self, request: web.Request) -> web.Response:
        """200 when at least one prefill and one decode instance answer their ``/health``, else 503.

        The body maps each instance URL to true/false per leg.
        """
        ups = self.prefillers.upstreams + self.decoders.upstreams
        results = await asyncio.gather(*(self._probe(u) for u in ups))
        report: dict[str, Any] = {"prefill": {}, "decode": {}}
        for up, ok in zip(ups, results):
            report[up.leg][up.url] = ok
        healthy = any(report["prefill"].values()) and any(report["decode"].values())
        report["status"] = "ok" if healthy else "unhealthy"
        return _json_response(200 if healthy else 503, _encode(report).encode())

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _not_found(self, request: web.Request) -> web.Response:
        known = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET",
                 "/health": "GET", "/metrics": "GET"}
        allowed = known.get(request.path)
        if allowed is not None:
            return _json_response(405, error_bytes(
                f"method {request.method} not allowed on {request.path} (use {allowed})",
                INVALID_REQUEST, 405), headers={"Allow": allowed})
        return _json_response(404, error_bytes(f"no route {request.method} {request.path}",
                                               NOT_FOUND, 404))


def _json_response(status: int, body: bytes, request_id: str | None = None,
                   headers: dict[str, str] | None = None) -> web.Response:
    h = {"Content-Type": _JSON}
    if request_id is not None:
        h["X-Request-Id"] = request_id
    if headers:
        h.update(headers)
    return web.Response(status=status, body=body, headers=h)


def _connect_reason(exc: BaseException) -> str:
    if isinstance(exc, asyncio.TimeoutError):
        return "connect timed out"
    os_error = getattr(exc, "os_error", None)
    errno = getattr(os_error, "errno", None)
    if errno:
        return os.strerror(errno)
    return str(exc) or type(exc).__name__
