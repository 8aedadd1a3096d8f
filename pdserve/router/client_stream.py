"""The client's response of one streamed turn in the concurrent hand-off: its headers are sent as
soon as a decoder accepts the decode leg, D's opening chunks as they come, the rest of its body
from D's first token on.

Why: a client (httpx, the OpenAI SDK) sets up its side of a streamed response when the headers
arrive (about 0.3 ms on the development machine), and parses a chat stream's opening chunk,
which carries the prompt's ``prompt_token_ids`` when vLLM's ``return_token_ids`` is asked for
(about 2.2 ms for a 16k-token prompt on the GPU machine, docs/benchmarks.md); sent while P
prefills, both are off the critical path, as with one engine, whose response starts before its
prefill. Keep-alive comments before D's first token go on as they come too.

A failure before D's first token is still retried on other instances (docs/proxy.md). The
client has then had the headers and maybe an earlier leg's opening chunks; the turn's
:class:`~pdserve.router.stream_ledger.StreamLedger` records what went out, so a later leg's
opening is dropped for the choices already opened (its ``prompt_token_ids``, when both have
them, must be those the client has: else the stream ends with a 502 error event, since the
rest would continue another tokenization of the prompt), and its other chunks are relayed
through the ledger, which gives each the first leg's ``id`` and ``created``
(:meth:`ClientStream.continues`). When the turn cannot be served after the headers went out its
error reaches the client in the stream (an SSE ``data: {"error": ...}`` event, then ``data:
[DONE]``), as any failure after the first token does.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from pdserve.router.errors import UPSTREAM_ERROR, ProxyError
from pdserve.router.first_token import FirstEvent, FirstTokenWatch
from pdserve.router.stream_ledger import SSE_DONE, SSE_KEEPALIVE, StreamLedger, sse_event
from pdserve.utils import phase_trace


class ClientStream:
    """The client's SSE response of one streamed turn, opened at most once.

    Args:
        request: the client's request.
        request_id: the turn's ``X-Request-Id`` (sent back in the headers).

    Attributes:
        opened: the headers went out.
        ledger: what the client has received of the stream; set by the proxy once it has read
            the request (:meth:`StreamLedger.for_request`), before any decode leg.
        opener: the decode leg's response whose opening chunk went out first (None: none).
    """

    __slots__ = ("_request", "_request_id", "_out", "opened", "ledger", "opener")

    def __init__(self, request: web.Request, request_id: str):
        self._request = request
        self._request_id = request_id
        self._out: web.StreamResponse | None = None
        self.opened = False
        self.ledger: StreamLedger | None = None
        self.opener: Any = None

    def response(self, content_type: str = "text/event-stream") -> web.StreamResponse:
        """The turn's response (made on the first call; ``content_type`` is the decoder's)."""
        if self._out is None:
            self._out = web.StreamResponse(status=200, headers={
                "Content-Type": content_type, "Cache-Control": "no-cache",
                "X-Request-Id": self._request_id})
        return self._out

    async def open(self, content_type: str) -> None:
        """Send the headers (status 200) now; later calls do nothing. A client already gone is
        not an error here: the relay's first write finds it gone."""
        if self.opened:
            return
        self.opened = True
        phase_trace.mark("px.open")
        try:
            await self.response(content_type).prepare(self._request)
        except (ConnectionResetError, RuntimeError):
            pass  # the connection is closing; the handler is cancelled or the relay sees it

    async def send(self, data: bytes) -> None:
        """Write ``data`` (events before D's first token) to the opened stream now. A client
        already gone is not an error here, as in :meth:`open`."""
        try:
            await self.response().write(data)
        except (ConnectionResetError, RuntimeError):
            pass  # the relay's first write finds it gone (or the handler is cancelled)

    def continues(self, d_resp: Any) -> bool:
        """True when another decode leg's opening went out than ``d_resp``'s: the stream must
        be relayed through :attr:`ledger` (the first leg's ``id`` and ``created``)."""
        return self.opener is not None and self.opener is not d_resp

    async def fail(self, error_body: bytes) -> web.StreamResponse:
        """End an opened stream with ``error_body`` (an OpenAI-style error object) as an SSE
        event (:func:`~pdserve.router.stream_ledger.sse_event`: one line of compact JSON),
        then ``[DONE]``. Returns the response."""
        out = self.response()
        try:
            await out.write_eof(sse_event(error_body) + SSE_DONE)
        except ConnectionResetError:
            pass  # nobody left to tell
        return out


class LegOpening:
    """One decode leg's stream up to D's first token: its opening chunks and keep-alive comments
    go to the client as they come (each choice's opening once per turn:
    :meth:`StreamLedger.opening`), what follows is held for the relay.

    Args:
        client: the turn's stream (headers sent, ledger set).
        d_resp: the decode leg's response.
        url: the decoder's URL (named in errors).

    Attributes:
        held: once :meth:`feed` returned the first event: the stream from that event on, read so
            far (the relay sends it first).
        parsed: ``(payload, value)`` of the events in ``held`` already parsed as JSON.
    """

    __slots__ = ("_client", "_resp", "_url", "_watch", "_raw", "_taken", "_openings", "held",
                 "parsed")

    def __init__(self, client: ClientStream, d_resp: Any, url: str):
        self._client = client
        self._resp = d_resp
        self._url = url
        self._watch = FirstTokenWatch()
        self._raw = b""
        self._taken = 0  # events (or comments) taken out of the stream: held is no longer _raw
        self._openings = 0  # opening chunks taken (the first entries of the watch's parsed)
        self.held = b""
        self.parsed: list[tuple[bytes, Any]] = []

    async def feed(self, chunk: bytes) -> FirstEvent | None:
        """The stream's first event that is not an opening chunk, once ``chunk`` completes it
        (None before); the opening chunks and comments ``chunk`` completed are sent first.

        Raises:
            ProxyError: 502 (not retried: no one instance failed) when this leg's
                ``prompt_token_ids`` are not those of the opening chunk the client has.
        """
        watch, client = self._watch, self._client
        self._raw += chunk
        first = watch.feed(chunk)
        out = [SSE_KEEPALIVE] if watch.comments else []
        self._taken += len(watch.openings) + watch.comments
        self._openings += len(watch.openings)
        for payload, value in watch.openings:
            try:
                data = client.ledger.opening(value, payload)
            except ValueError as e:
                raise ProxyError(502, f"the request's retry on decode instance {self._url} "
                                      f"tokenized the prompt otherwise: {e}",
                                 UPSTREAM_ERROR) from None
            if data is not None:
                out.append(data)
                if client.opener is None:
                    client.opener = self._resp
        if out:
            phase_trace.mark("px.opening")
            await client.send(b"".join(out))
        if first is not None:
            self.held = watch.rest() if self._taken else self._raw
            self.parsed = watch.parsed[self._openings:]
        return first
