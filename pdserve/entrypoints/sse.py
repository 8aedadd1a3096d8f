"""Server-sent events: the ``data: {...}`` framing, the keep-alive comment, and a streaming
response that notices a client disconnect even while it waits for the next token.

Starlette's ``StreamingResponse`` (ASGI spec >= 2.4) only notices a disconnect when a write fails,
so a request queued in the engine would keep running after its client left. Here the body is
streamed in one task while another waits for ``http.disconnect``; whichever ends first cancels the
other, and the body iterator is always closed, which aborts the engine requests behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
#: An SSE comment (a line starting with ``:``; clients ignore it, it is no event), sent by a
#: stream that has had nothing to send for ``job_runner.KEEPALIVE_INTERVAL_S`` seconds so that
#: readers with an idle timeout (the proxy's ``--stall-timeout``) see a live server.
KEEPALIVE = ": keep-alive\n\n"


def sse_event(data: dict[str, Any]) -> str:
    """One SSE event ``data: <json>\\n\\n``."""
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` response that stops (and closes its iterator) on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, content: Any, status_code: int = 200,
                 headers: dict[str, str] | None = None):
        super().__init__(content, status_code=status_code, headers={
            "Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not stream.done():
                logger.info("client disconnected during a stream; aborting its request")
            else:
                exc = stream.exception()
                if exc is not None and not isinstance(exc, OSError):
                    raise exc
        finally:
            for task in (stream, watcher):
                task.cancel()
            for task in (stream, watcher):
                with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                    await task
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
        if self.background is not None:
            await self.background()
