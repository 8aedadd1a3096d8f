"""Fake prefill/decode instances for proxy tests: in-process aiohttp servers on free ports.

Each fake records every request it receives (path, headers, JSON body) and every request its
handler saw cancelled (the client — here the proxy — closed the connection). Behaviour is the
default P or D behaviour of docs/architecture.md ("Request flow of one P/D turn") unless a test installs its own ``handler``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

from aiohttp import web


@dataclass
class Received:
    """One request as a fake instance saw it."""

    path: str
    headers: dict[str, str]
    body: Any
    request_id: str | None


def prefill_params(name: str, request_id: str | None) -> dict[str, Any]:
    """The ``kv_transfer_params`` a fake P returns (shape of docs/architecture.md, "Request flow of one P/D turn", step 2)."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": f"engine-{name}",
            "remote_block_ids": [1, 2, 3], "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_request_id": f"{name}-{request_id}", "tp_size": 1}


def sse(obj: Any) -> bytes:
    """One SSE event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def sse_data(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, in order: parsed JSON, and the string ``[DONE]``;
    other blocks (``: keep-alive`` comments) are skipped."""
    out: list[Any] = []
    for block in raw.decode().split("\n\n"):
        if block.startswith("data: "):
            data = block[6:]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


Handler = Callable[["FakeInstance", web.Request, Received], Awaitable[web.StreamResponse]]


@dataclass
class FakeInstance:
    """A fake P (``role="prefill"``) or D (``role="decode"``) instance.

    Attributes:
        received: requests to the generation endpoints, in arrival order.
        cancelled: request ids whose handler was cancelled because the proxy disconnected.
        handler: replaces the default generation behaviour when set.
        decoder_params: D only: ``kv_transfer_params`` to return (per request, computed by this
            callable from the turn number); None = return none.
        health_status: status of ``GET /health``.
        chunks: D only, streaming: text pieces sent one per SSE event.
        released: P only: the ``kv_transfer_params`` of each ``POST /v1/kv_transfer/release``.
        info: the body of ``GET /pdserve/instance``; None: the route answers 404 (as a vLLM
            engine, which has no such route).
        info_asked: how many times ``GET /pdserve/instance`` was asked.
    """

    name: str
    role: str
    received: list[Received] = field(default_factory=list)
    cancelled: list[str | None] = field(default_factory=list)
    handler: Handler | None = None
    decoder_params: Callable[[int], dict[str, Any] | None] | None = None
    health_status: int = 200
    chunks: tuple[str, ...] = ("Hel", "lo", " world")
    url: str = ""
    released: list[Any] = field(default_factory=list)
    info: dict[str, Any] | None = None
    info_asked: int = 0
    _runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/kv_transfer/release", self._release)
        app.router.add_get("/pdserve/instance", self._info)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _release(self, request: web.Request) -> web.Response:
        self.released.append((await request.json())["kv_transfer_params"])
        return web.json_response({"released": True})

    async def _info(self, request: web.Request) -> web.Response:
        self.info_asked += 1
        if self.info is None:
            raise web.HTTPNotFound()
        return web.json_response(self.info)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.health_status, text="")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model",
                                                              "owned_by": self.name}]})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        rec = Received(request.path, dict(request.headers), json.loads(raw),
                       request.headers.get("X-Request-Id"))
        self.received.append(rec)
        try:
            if self.handler is not None:
                return await self.handler(self, request, rec)
            if self.role == "prefill":
                return await self._prefill(rec)
            return await self._decode(request, rec)
        except asyncio.CancelledError:
            self.cancelled.append(rec.request_id)
            raise

    async def _prefill(self, rec: Received) -> web.Response:
        return web.json_response({"id": f"cmpl-{rec.request_id}", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "H", "finish_reason": "length"}],
                                  "kv_transfer_params": prefill_params(self.name, rec.request_id)})

    def _params(self) -> dict[str, Any] | None:
        return self.decoder_params(len(self.received)) if self.decoder_params else None

    async def _decode(self, request: web.Request, rec: Received) -> web.StreamResponse:
        params = self._params()
        if not rec.body.get("stream"):
            return web.json_response({"id": f"cmpl-{rec.request_id}", "object": "text_completion",
                                      "choices": [{"index": 0, "text": "".join(self.chunks),
                                                   "finish_reason": "length"}],
                                      "served_by": self.name, "kv_transfer_params": params})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, piece in enumerate(self.chunks):
            last = i == len(self.chunks) - 1
            event = {"id": f"cmpl-{rec.request_id}", "choices": [
                {"index": 0, "text": piece, "finish_reason": "length" if last else None}]}
            if last:
                event["kv_transfer_params"] = params
            await resp.write(sse(event))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll ``predicate`` every 5 ms until true; raise AssertionError after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached within %.1f s" % timeout)
        await asyncio.sleep(0.005)
