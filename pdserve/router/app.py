"""The disaggregation proxy's HTTP application (aiohttp server + pooled aiohttp client).

(Past ~450 lines, kept whole: it is the one place where a request's whole path is composed,
body checks -> state -> routing -> local prefill or the two legs -> relay -> state record; each
step lives in its own module, and splitting the composition would scatter that order.)

One generation request (``POST /v1/completions`` or ``/v1/chat/completions``) becomes two legs
(docs/proxy.md): a prefill leg to a P instance (``max_tokens=1``, non-streaming; its answer carries
``kv_transfer_params``) and a decode leg to a D instance, whose answer goes back to the client
byte for byte; a streamed answer is forwarded chunk by chunk as it arrives. With ``--handoff
concurrent`` (the default, :mod:`pdserve.router.concurrent_legs`) both legs are sent at once and
D learns P's blocks from P's side channel; with ``--handoff sequential`` (and for instances the
concurrent hand-off cannot use) the decode leg follows P's answer, with P's params. Both legs carry the same ``X-Request-Id``. Which instance serves each leg is decided in
:mod:`pdserve.router.kv_routing` (round-robin, least-loaded, KV-cache-aware, session affinity);
multi-turn state lives in a :mod:`pdserve.router.state_store` (memory or Redis).

Why aiohttp on both sides: on the 2-core development machine the same pass-through written with
FastAPI/uvicorn (h11) + httpx reached about 270 requests/s, FastAPI + an aiohttp client about
1,100-2,100, and aiohttp server + client 1,700-3,200 (docs/proxy.md has the figures).

Failure handling (status codes in docs/proxy.md): upstream failures as described in
:mod:`pdserve.router.upstream_client`; before the first token, retries on other instances,
the decode-only fallback and ``--enforce-disagg`` as in :mod:`pdserve.router.legs`, instances
taken out of rotation by their circuit breakers (:mod:`pdserve.router.health`); a failure after the stream to the client has started -> an
SSE ``data: {"error": ...}`` event, then ``data: [DONE]``; the client going away -> the open
upstream request is closed, which makes the instance's server abort it (during the prefill leg: P
aborts and frees the blocks, no decode leg is sent). Work D will not do is not left to P
(:mod:`pdserve.router.decode_guard`): no prefill while no decoder is reachable (503); P's blocks
released at once when the decode leg will not read them, and in multi-turn mode the blocks D keeps
for a request without a conversation (nobody will pull them through this proxy, and D would hold
them for ``decoder_kv_blocks_ttl``).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import uuid
from time import perf_counter
from typing import Any

from aiohttp import web

from pdserve.utils import phase_trace
from pdserve.types.openai_errors import MAX_BODY_BYTES
from pdserve.router.bodies import check_client_body, conversation_key, prefill_leg_body
from pdserve.router.client_body import read_json_body
from pdserve.router.client_stream import ClientStream
from pdserve.router.concurrent_legs import ConcurrentLegs
from pdserve.router.config import ProxyConfig
from pdserve.router.conversations import ConversationStore
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.fallback import DecodeOnlyFallback
from pdserve.router.handoff import HandoffMode, HandoffTargets
from pdserve.router.health import BreakerPolicy, UpstreamHealth
from pdserve.router.legs import DecodeAnswer, TurnLegs
from pdserve.router.retries import RetryPolicy
from pdserve.router.errors import (AUTHENTICATION, METHOD_NOT_ALLOWED, NOT_FOUND,
                                   UPSTREAM_ERROR, UPSTREAM_UNAVAILABLE, ProxyError, error_bytes)
from pdserve.router.kv_routing import (KVAwareRouter, PromptBlocks, PromptTokenizer,
                                       RoutingDecision, RoutingReason, affinity_allows,
                                       route_plain)
from pdserve.router.local_prefill import LocalPrefill
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.migration import Leg, StreamMigrator, migration_refusal
from pdserve.router.passthrough import PASS_THROUGH_ROUTES, forward
from pdserve.router.role_check import RoleCheck, RoleMismatch
from pdserve.router.state_store import MemoryStateStore, RedisStateStore
from pdserve.router.stream_ledger import StreamLedger
from pdserve.router.stream_relay import StreamRelay
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

_JSON = "application/json"
#: The longest header field (bytes) the server reads, above aiohttp's default (8190): an
#: over-long ``X-Session-ID`` reaches the handler, which answers the proxy's JSON 400
#: (:data:`pdserve.router.bodies.MAX_CONVERSATION_ID_CHARS`); aiohttp refuses a longer field
#: itself, with a plain-text 400.
MAX_HEADER_FIELD_BYTES = 64 * 1024
_encode = json.JSONEncoder(separators=(",", ":")).encode
_ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions"}
#: Bytes every ``kv_transfer_params`` object a decoder keeps blocks with contains.
_D_PARAMS_NEEDLE = b'"remote_request_id"'


class DisaggProxy:
    """Routes OpenAI requests through a prefill instance, then a decode instance.

    Args:
        config: validated settings (:class:`pdserve.router.config.ProxyConfig`).

    Attributes:
        prefillers, decoders: the instance pools (in-flight counts, routing).
        conversations: the in-process multi-turn table, or None (no ``--multi-turn``, or
            ``--state-store redis://...``).
        state_store: where multi-turn state is loaded from and recorded, or None.
        kv_router: the instances' KV indexes and the prompt tokenizer (``--routing kv-aware``,
            ``--local-prefill-max-tokens``), or None.
        local_prefill: which requests their decoder prefills itself
            (``--local-prefill-max-tokens``), or None.
        metrics: the Prometheus metrics served at ``/metrics``.

    Raises:
        pdserve.model_files.client_tokenizer.TokenizerLoadError: kv-aware routing or local
            prefill cannot load ``--tokenizer``.
    """

    def __init__(self, config: ProxyConfig):
        self.config = config
        available = self._in_rotation
        self.prefillers = UpstreamPool("prefill", config.prefillers, config.routing,
                                       available=available, panic=False)
        self.decoders = UpstreamPool("decode", config.decoders, config.routing,
                                     available=available)
        self.metrics = ProxyMetrics(config.prefillers, config.decoders)
        self.health = UpstreamHealth(
            self.prefillers.upstreams + self.decoders.upstreams,
            BreakerPolicy(config.breaker_failures, config.breaker_backoff),
            lambda up: self.client.probe(up, self._upstream_auth), self.metrics.upstream_healthy)
        self.conversations: ConversationStore | None = None
        self.state_store: MemoryStateStore | RedisStateStore | None = None
        if config.multi_turn and config.state_store == "memory":
            self.conversations = ConversationStore(config.max_conversations, config.conversation_ttl)
            self.state_store = MemoryStateStore(self.conversations)
        elif config.multi_turn:
            self.state_store = RedisStateStore(config.state_store, config.conversation_ttl,
                                               self.metrics.count_state_store_error)
        self.kv_router: KVAwareRouter | None = None
        if config.routing == "kv-aware" or config.local_prefill_max_tokens:
            self.kv_router = KVAwareRouter(config.prefillers + config.decoders,
                                           PromptTokenizer(config.tokenizer),
                                           config.kv_load_weight, config.kv_events_stale_after)
        self.local_prefill: LocalPrefill | None = None
        if config.local_prefill_max_tokens:
            self.local_prefill = LocalPrefill(config.local_prefill_max_tokens, self.kv_router,
                                              self.metrics.local_prefills)
        self._api_key = (f"Bearer {config.api_key}".encode() if config.api_key else None)
        self._upstream_auth = (f"Bearer {config.upstream_api_key}" if config.upstream_api_key else None)
        self.client = UpstreamClient(config.timeout, (self.prefillers, self.decoders),
                                     tuple(_ENDPOINTS), self.metrics, self.health)
        self.handoff_targets = HandoffTargets()
        self.role_check = RoleCheck((self.prefillers, self.decoders), lambda: self.client.session,
                                    self._upstream_auth, on_info=self.handoff_targets.learn)
        self.decode_guard = DecodeLegGuard(
            self.decoders, lambda up: self.client.probe(up, self._upstream_auth), self.metrics,
            lambda: self.client.session)
        retries = RetryPolicy(self.prefillers, self.decoders, self.health,
                              DecodeOnlyFallback(config.enforce_disagg,
                                                 self.metrics.decode_only_fallback),
                              self.metrics, config.max_retries)
        self.legs = TurnLegs(self.client, self.prefillers, self.decoders, self.decode_guard,
                             retries, self.metrics, self._route)
        self.concurrent: ConcurrentLegs | None = None
        if config.handoff is HandoffMode.CONCURRENT:
            self.concurrent = ConcurrentLegs(
                self.client, self.prefillers, self.decoders, self.handoff_targets,
                self.role_check.refresh, self.decode_guard, retries, self.legs, self.metrics,
                self._route)
        self.relay = StreamRelay(self.client, self.metrics, self.decode_guard,
                                 self._record_turn if self.state_store is not None else None)
        # also without migration: it relays a stream that continues an earlier leg's opening
        self.migrator = StreamMigrator(
            self.client, self.prefillers, self.decoders,
            lambda pool, turn: self._route(pool, None, None, turn), self.decode_guard.release,
            self._record_turn if self.state_store is not None else None, self.metrics,
            config.migration_limit, config.stall_timeout)

    def _in_rotation(self, up: Upstream) -> bool:
        return self.health.in_rotation(up)
    # ------------------------------------------------------------------ application
    def build_app(self) -> web.Application:
        """The aiohttp application (run it with ``handler_cancellation=True``, see :func:`serve`)."""
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              handler_args={"max_field_size": MAX_HEADER_FIELD_BYTES})
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/v1/models", self._models)
        for path, method in PASS_THROUGH_ROUTES.items():
            app.router.add_route(method, path, self._pass_through)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._not_found)
        app.on_startup.append(self._start_client)
        app.on_cleanup.append(self._close_client)
        return app

    async def _start_client(self, app: web.Application) -> None:
        await self.client.start()
        try:  # instances not up yet are asked at their first request
            await self.role_check.check()
        except RoleMismatch:
            await self.client.close()
            raise
        if self.kv_router is not None:
            self.kv_router.start(self.client.session, self._upstream_auth)

    async def _close_client(self, app: web.Application) -> None:
        if self.kv_router is not None:
            await self.kv_router.close()
        if self.state_store is not None:
            await self.state_store.close()
        if self.concurrent is not None:
            await self.concurrent.close()
        await self.role_check.close()
        await self.health.close()
        await self.client.close()

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

    def _route(self, pool: UpstreamPool, previous_url: str | None, prompt: PromptBlocks | None,
               turn: Turn) -> list[Upstream]:
        """:meth:`_decide`'s order to try (:data:`pdserve.router.legs.Route`)."""
        return self._decide(pool, previous_url, prompt, turn).order

    def _decide(self, pool: UpstreamPool, previous_url: str | None,
                prompt: PromptBlocks | None, turn: Turn) -> RoutingDecision:
        """Decide one leg's instance (order to try, best first); count and log the decision.

        ``previous_url``: the instance of the conversation's previous turn, if any.
        ``prompt``: the request's token ids and block hashes (kv-aware routing), or None.
        """
        previous = pool.get(previous_url)
        kv = self.kv_router if self.config.routing == "kv-aware" else None
        if self.config.session_affinity and pool is self.decoders and previous is not None:
            if affinity_allows(pool, previous):
                order = pool.order(previous)
                decision = (RoutingDecision(order, RoutingReason.AFFINITY)
                            if order and order[0] is previous
                            else route_plain(pool, None))
            else:  # too busy: routed as a new conversation would be
                decision = kv.route(pool, prompt) if kv is not None else route_plain(pool, None)
        elif kv is not None:
            decision = kv.route(pool, prompt)
        else:
            decision = route_plain(pool, previous)
        self.metrics.count_decision(pool.leg, decision.reason.value,
                                    decision.hit_blocks if kv is not None else None)
        if decision.order and logger.isEnabledFor(logging.DEBUG):
            up = decision.order[0]
            logger.debug("request %s: %s leg -> %s (%s; %d/%d prompt blocks cached there; "
                         "%d in flight)", turn.request_id, pool.leg, up.url, decision.reason.value,
                         decision.hit_blocks, decision.prompt_blocks, up.in_flight)
        return decision

    # ------------------------------------------------------------------ generation
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        turn = Turn(request.headers.get("X-Request-Id") or uuid.uuid4().hex, perf_counter())
        endpoint = _ENDPOINTS[request.path]
        client = ClientStream(request, turn.request_id)
        try:
            return await self._generate_turn(request, turn, client)
        except (ProxyError, UpstreamHTTPError) as e:
            turn.status = e.status
            body = e.body() if isinstance(e, ProxyError) else e.body
            if client.opened:  # the headers went out: the error goes in the stream
                return await client.fail(body)
            return _json_response(e.status, body, turn.request_id)
        except asyncio.CancelledError:
            turn.client_left()  # handler cancellation
            raise
        except Exception:
            turn.status = 500  # counted as what the client gets, not as a client that went away
            raise
        finally:
            self.metrics.count_request(endpoint, turn.status)

    async def _generate_turn(self, request: web.Request, turn: Turn,
                             client: ClientStream) -> web.StreamResponse:
        phase_trace.mark("px.in")
        if not self._authorized(request):
            raise ProxyError(401, "invalid or missing API key (send 'Authorization: Bearer KEY')",
                             AUTHENTICATION)
        body = await read_json_body(request, MAX_BODY_BYTES)
        phase_trace.mark("px.parsed")
        check_client_body(body)
        if not self.role_check.done:
            try:
                await self.role_check.check()
            except RoleMismatch as e:
                raise ProxyError(502, str(e), UPSTREAM_ERROR) from None
        store = self.state_store
        # the field is checked in every mode (the stateless one only drops it)
        conv_id = conversation_key(body, request.headers.get("X-Session-ID"))
        if store is None:
            conv_id = None
        state = await store.load(conv_id) if conv_id else None
        phase_trace.mark("px.state")
        headers = self._upstream_headers(request, turn.request_id)
        path = request.path
        prompt = None  # token ids and block hashes, shared by every routing of the request
        if self.kv_router is not None:
            token_ids = await self.kv_router.tokenizer.token_ids_async(_ENDPOINTS[path], body)
            prompt = PromptBlocks(token_ids) if token_ids is not None else None

        if not await self.decode_guard.decoders_reachable():
            raise ProxyError(503, "no decode instance is reachable ("
                             + ", ".join(u.url for u in self.decoders.upstreams)
                             + "); the request was not prefilled", UPSTREAM_UNAVAILABLE)

        stream = body.get("stream") is True
        migrate = self.migrator.limit > 0 and stream and migration_refusal(body) is None
        if stream:
            client.ledger = StreamLedger.for_request(body)
        previous = (state.prefiller_url, state.decoder_url) if state else (None, None)
        p_body = prefill_leg_body(body, state.kv_transfer_params if state else None)
        d_order = d_route = None
        if self.local_prefill is not None:
            d_route = self._decide(self.decoders, previous[1], prompt, turn)
            d_order = d_route.order
        if self.local_prefill is not None and self.local_prefill.take(d_route, prompt):
            phase_trace.mark("px.local_prefill")
            answer = None
            try:  # (the prefill leg's body serves a retry, which goes through a prefiller)
                answer = await self.legs.run(path, body, _encode(p_body).encode(), headers,
                                             turn, stream, previous, prompt,
                                             return_token_ids=migrate, orders=(None, d_order),
                                             local=True)
            finally:
                if state is not None and state.kv_transfer_params and (
                        answer is None or answer.p_up is None):
                    # the previous turn's blocks D holds for a prefiller's pull: none pulled
                    # them (freed, they stay in D's prefix cache, evictable)
                    prev_d = self.decoders.get(state.decoder_url)
                    if prev_d is not None:
                        self.decode_guard.release(prev_d, state.kv_transfer_params, headers)
        else:
            if state is not None and state.kv_transfer_params:
                self.metrics.kv_params_forwarded.inc()
            if self.concurrent is not None:
                phase_trace.mark("px.p_body_built")
                answer = await self.concurrent.run(path, body, p_body, headers, turn, stream,
                                                   previous, prompt, return_token_ids=migrate,
                                                   client=client if stream else None,
                                                   d_first=d_order)
            else:
                p_data = _encode(p_body).encode()
                phase_trace.mark("px.p_body_built")
                answer = await self.legs.run(path, body, p_data, headers, turn, stream,
                                             previous, prompt, return_token_ids=migrate,
                                             orders=(None, d_order))
        p_up, d_up, d_resp, d_raw = answer.p_up, answer.d_up, answer.d_resp, answer.raw
        phase_trace.mark("px.d_hdr")
        if d_raw is None:
            return await self._relay_stream(request, client, turn, answer, conv_id, headers, body,
                                            migrate)
        keep = conv_id is not None
        if keep or (self.state_store is not None and _D_PARAMS_NEEDLE in d_raw):
            try:
                d_answer = json.loads(d_raw)
            except ValueError:
                d_answer = None  # relayed as it is; there is just nothing to remember
            d_params = d_answer.get("kv_transfer_params") if isinstance(d_answer, dict) else None
            d_params = d_params if isinstance(d_params, dict) else None
            if keep:
                await self._record_turn(conv_id, p_up, d_up, d_params)
            elif d_params is not None:  # nobody will pull them through this proxy
                self.decode_guard.release(d_up, d_params, headers)
            if d_params is not None:  # the proxy kept or released them; the client gets null
                d_answer["kv_transfer_params"] = None
                d_raw = _encode(d_answer).encode()
        turn.status = d_resp.status
        resp = web.Response(body=d_raw, status=d_resp.status, headers={
            "Content-Type": d_resp.headers.get("Content-Type", _JSON),
            "X-Request-Id": turn.request_id})
        self.metrics.added_latency.observe(perf_counter() - turn.t0 - turn.upstream_wait)
        return resp

    async def _record_turn(self, conv_id: str, p_up: Upstream | None, d_up: Upstream,
                           d_params: dict[str, Any] | None) -> None:
        """Remember a finished turn (``p_up`` None: served decode-only)."""
        await self.state_store.record_turn(conv_id, p_up.url if p_up is not None else None,
                                           d_up.url, d_params)
        if self.conversations is not None:
            self.metrics.conversations.set(len(self.conversations))

    async def _relay_stream(self, request: web.Request, client: ClientStream, turn: Turn,
                            answer: DecodeAnswer, conv_id: str | None, headers: dict[str, str],
                            body: dict[str, Any], migrate: bool) -> web.StreamResponse:
        """Forward D's SSE stream chunk by chunk; in multi-turn mode record D's
        ``kv_transfer_params`` for the conversation (or release them on D when the request has
        none) and forward them as null (:class:`~pdserve.router.stream_relay.StreamRelay`).

        ``migrate``: the stream may be migrated mid-stream (``--migration-limit``;
        :class:`pdserve.router.migration.StreamMigrator` relays it, as it does, without
        migrating, a stream whose client has another leg's opening chunk:
        :meth:`~pdserve.router.client_stream.ClientStream.continues`).
        """
        d_resp = answer.d_resp
        # opened already when the concurrent hand-off's decoder accepted (ClientStream)
        out = client.response(d_resp.headers.get("Content-Type", "text/event-stream"))
        if migrate or client.continues(d_resp):
            leg = Leg(answer.p_up, answer.p_params, answer.d_up, d_resp, answer.held, answer.timer,
                      answer.held_parsed)
            return await self.migrator.relay(request, out, turn, leg, body, conv_id, headers,
                                             client.ledger, migrate)
        return await self.relay.relay(request, out, turn, answer.d_up, d_resp, answer.p_up,
                                      conv_id, headers, answer.held, answer.timer)

    # ------------------------------------------------------------------ other routes
    async def _models(self, request: web.Request) -> web.Response:
        """``GET /v1/models`` from the first decode (then prefill) instance that answers."""
        if not self._authorized(request):
            return _json_response(401, error_bytes("invalid or missing API key", AUTHENTICATION, 401))
        return await forward(self.client.session, self.decoders.upstreams + self.prefillers.upstreams,
                             "GET", "/v1/models", None, self._upstream_headers(request, None),
                             self.metrics)

    async def _pass_through(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``, ``/detokenize``, ``/version`` from the first prefill (then
        decode) instance that answers (:mod:`pdserve.router.passthrough`); outside ``/v1``, so
        without the API key, as on the engines."""
        body = await request.read() if request.method == "POST" else None
        return await forward(self.client.session, self.prefillers.upstreams + self.decoders.upstreams,
                             request.method, request.path, body,
                             self._upstream_headers(request, None), self.metrics)

    async def _health(self, request: web.Request) -> web.Response:
        """200 when a decode instance and a prefill instance answer their ``/health``
        (``status: ok``), or only a decode instance, without ``--enforce-disagg``
        (``status: degraded``: requests are served decode-only); else 503 (``unhealthy``).

        The body maps each instance URL to true/false per leg, and under ``breakers`` to its
        circuit breaker's state (``closed``, ``open``, ``half_open``).
        """
        ups = self.prefillers.upstreams + self.decoders.upstreams
        results = await asyncio.gather(*(self.client.probe(u, self._upstream_auth) for u in ups))
        report: dict[str, Any] = {"prefill": {}, "decode": {}}
        for up, ok in zip(ups, results):
            report[up.leg][up.url] = ok
        p_ok, d_ok = any(report["prefill"].values()), any(report["decode"].values())
        healthy = d_ok and (p_ok or not self.config.enforce_disagg)
        report["status"] = ("ok" if p_ok else "degraded") if healthy else "unhealthy"
        report["breakers"] = {"prefill": self.health.report(self.prefillers.upstreams),
                              "decode": self.health.report(self.decoders.upstreams)}
        return _json_response(200 if healthy else 503, _encode(report).encode())

    async def _metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _not_found(self, request: web.Request) -> web.Response:
        known = {"/v1/completions": "POST", "/v1/chat/completions": "POST", "/v1/models": "GET",
                 "/health": "GET", "/metrics": "GET", **PASS_THROUGH_ROUTES}
        allowed = known.get(request.path)
        if allowed is not None:
            return _json_response(405, error_bytes(
                f"method {request.method} not allowed on {request.path} (use {allowed})",
                METHOD_NOT_ALLOWED, 405), headers={"Allow": allowed})
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

