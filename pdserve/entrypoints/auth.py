"""Bearer-token authentication for ``/v1/*`` (``--api-key``), as a pure ASGI middleware.

Being middleware, it runs before the body is read, so an unauthenticated client learns nothing
about request validation. ``/health`` and ``/metrics`` stay open for probes and scrapers.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.entrypoints.errors import OpenAIError

PROTECTED_PREFIX = "/v1"


class APIKeyMiddleware:
    """Rejects ``/v1/*`` requests whose ``Authorization`` header is not ``Bearer <api_key>``
    with a 401 OpenAI error body."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (
            scope["path"] == PROTECTED_PREFIX or scope["path"].startswith(PROTECTED_PREFIX + "/")
        ) and scope.get("method") != "OPTIONS":
            header = b""
            for name, value in scope.get("headers", ()):
                if name == b"authorization":
                    header = value
                    break
            if not hmac.compare_digest(header, self._expected):
                err = OpenAIError(
                    "Invalid or missing API key: send 'Authorization: Bearer <key>'.", 401,
                    type_="AuthenticationError",
                )
                await JSONResponse(err.body(), status_code=401,
                                   headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
