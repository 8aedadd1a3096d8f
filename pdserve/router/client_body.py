"""Reading a client's request body at the proxy's edge: its announced size, its content type,
the bytes, and the JSON they hold, each refused with the proxy's OpenAI-style error."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from aiohttp import web

from pdserve.router.errors import INVALID_REQUEST, REQUEST_TOO_LARGE, ProxyError
from pdserve.types.openai_errors import body_too_large, not_json_content_type

#: Bodies up to this size (bytes) are parsed on the event loop; larger ones in a worker thread
#: (a 60 MB body took ~0.4 s to parse, and held every other request meanwhile).
PARSE_INLINE_BYTES = 1 << 20


async def read_json_body(request: web.Request, limit: int) -> Any:
    """The parsed JSON of ``request``'s body (any JSON value; :func:`~pdserve.router.bodies.
    check_client_body` checks its shape). ``limit``: the application's ``client_max_size``
    (bytes).

    Raises:
        ProxyError: 413 for a body over ``limit`` bytes (judged by its ``Content-Length``
            before reading, else by aiohttp while reading), 400 for a
            ``Content-Type`` that is not JSON (the engines' answer) or a body that is not JSON
            (nested too deeply included).
    """
    if (request.content_length or 0) > limit:  # judged by its header, unread
        raise ProxyError(413, body_too_large(limit), REQUEST_TOO_LARGE)
    not_json = not_json_content_type(request.headers.get("Content-Type"))
    if not_json is not None:
        raise ProxyError(400, not_json, INVALID_REQUEST)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise ProxyError(413, body_too_large(limit), REQUEST_TOO_LARGE) from None
    try:
        return (json.loads(raw) if len(raw) <= PARSE_INLINE_BYTES
                else await asyncio.to_thread(json.loads, raw))
    except ValueError as e:
        raise ProxyError(400, f"request body is not valid JSON: {e}", INVALID_REQUEST) from None
    except RecursionError:  # json's decoder recurses once per level of nesting
        raise ProxyError(400, "request body is not valid JSON: nested too deeply",
                         INVALID_REQUEST) from None
