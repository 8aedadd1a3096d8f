"""Request-body size limit of the engine server, as a pure ASGI middleware: a body over
:data:`pdserve.types.openai_errors.MAX_BODY_BYTES` (the proxy's limit too) is a 413 OpenAI error
before the app reads or parses it.

A request that declares its ``Content-Length`` is judged by it; a chunked one is read here, up
to the limit, and handed on whole.
"""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.entrypoints.errors import OpenAIError
from pdserve.types.openai_errors import body_too_large


class BodySizeLimitMiddleware:
    """Answers 413 (``RequestTooLargeError``) to HTTP requests whose body exceeds
    ``max_bytes``; other requests reach ``app`` unchanged (a chunked body as one message).

    Args:
        app: the ASGI app.
        max_bytes: the largest body accepted, in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = OpenAIError(body_too_large(self.max_bytes), 413)
        await JSONResponse(err.body(), status_code=413, headers={"Connection": "close"})(
            scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared: int | None = None
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = None
                break
        if declared is not None:
            if declared > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return whole
            return await receive()

        await self.app(scope, replay, send)
