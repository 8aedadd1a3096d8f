"""In-process HTTP helpers of the server tests: a real uvicorn serving an ASGI app in the test's
event loop (:func:`live_server`), polling until a condition holds (:func:`wait_until`), and the
parsing of an SSE body (:func:`parse_sse`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from typing import Any, AsyncIterator

import uvicorn


class _QuietServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # leave pytest's signal handlers alone
        yield


@contextlib.asynccontextmanager
async def live_server(app: Any) -> AsyncIterator[str]:
    """Serves ``app`` with a real uvicorn on a free port of 127.0.0.1 in this event loop;
    yields the base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = _QuietServer(uvicorn.Config(app, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        async with asyncio.timeout(10):
            await task
        sock.close()


async def wait_until(predicate: Any, timeout: float = 5.0) -> None:
    """Polls ``predicate()`` every 10 ms until it is true; fails after ``timeout`` seconds."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def parse_sse(text: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body: parsed JSON objects, and the string ``[DONE]``.

    Asserts the framing: every event is one ``data: ...`` line followed by a blank line.
    """
    events = []
    assert text.endswith("\n\n"), "an SSE body ends with a blank line"
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data event: {block!r}"
        assert "\n" not in block, f"one line per event expected: {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
