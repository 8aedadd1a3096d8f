"""The client's response of one streamed turn in the concurrent hand-off: its headers are sent as
soon as a decoder accepts the decode leg, its body only from D's first token on.

Why: a client (httpx, the OpenAI SDK) sets up its side of a streamed response when the headers
arrive; sent with D's first token, that setup follows the hand-off (about 0.3 ms on the
development machine, docs/benchmarks.md), sent while P prefills it is off the critical path, as
it is with one engine, whose response starts before its prefill. Nothing of the body is sent
before D's first token, so a failure until then is still retried on other instances unseen; only
when the turn cannot be served after the headers went out does its error reach the client in the
stream (an SSE ``data: {"error": ...}`` event, then ``data: [DONE]``), as any failure after
the first token does (docs/proxy.md).
"""

from __future__ import annotations

from aiohttp import web

from pdserve.router.stream_ledger import SSE_DONE, sse_event
from pdserve.utils import phase_trace


class ClientStream:
    """The client's SSE response of one streamed turn, opened at most once.

    Args:
        request: the client's request.
        request_id: the turn's ``X-Request-Id`` (sent back in the headers).
    """

    __slots__ = ("_request", "_request_id", "_out", "opened")

    def __init__(self, request: web.Request, request_id: str):
        self._request = request
        self._request_id = request_id
        self._out: web.StreamResponse | None = None
        self.opened = False  # the headers went out

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

