"""Client disconnects: cancel a request's work (and so abort its engine requests) when the HTTP
client goes away first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Awaitable, TypeVar

from fastapi import Request

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the HTTP client disconnects (its ASGI ``http.disconnect`` message).

    Only valid once the request body has been read (FastAPI reads it before the handler runs).
    """
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T | None:
    """Runs ``work``; cancels it (aborting its engine requests) if the client disconnects first.

    Returns:
        the result of ``work``, or None when the client went away.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        logger.info("client disconnected; aborting its request")
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        return None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await watcher
