"""Fake prefillers and decoders that speak the concurrent hand-off (docs/proxy.md, "the wire
contract"), for proxy tests: a prefill leg with a ``transfer_id`` publishes the params P keeps
under that id when it finishes (as P's side channel answers a pending claim); a pending decode
leg waits for them and fails as a real decoder would when they never come."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from tests.support.router_fakes import FakeInstance, Received, prefill_params, sse

#: Side-channel port of a fake prefiller's rank 0 (rank r: + r), as :func:`prefill_params` names.
BASE_PORT = 5600


def engine_id(name: str, rank: int, ranks: int) -> str:
    """A fake prefiller's engine id of ``rank`` (``_dp<rank>`` with several ranks)."""
    return f"engine-{name}_dp{rank}" if ranks > 1 else f"engine-{name}"


def info_for(ranks: int = 1, tp_size: int = 1):
    """``instance_info`` for ``make_cluster``: prefillers list ``ranks`` KV endpoints, decoders
    are pdserve ``kv_consumer`` instances."""

    def info(inst: FakeInstance) -> dict[str, Any]:
        if inst.role == "decode":
            return {"model": "m", "kv_role": "kv_consumer", "engine_id": f"engine-{inst.name}",
                    "chat_template": True}
        return {"model": "m", "kv_role": "kv_producer", "engine_id": f"engine-{inst.name}",
                "chat_template": True, "tp_size": tp_size,
                "kv_endpoints": [{"engine_id": engine_id(inst.name, r, ranks),
                                  "host": "127.0.0.1", "port": BASE_PORT + r}
                                 for r in range(ranks)]}

    return info


class SideChannels:
    """The prefillers' side channels, shared by the fakes of one test.

    Attributes:
        held: transfer id -> the params a prefill leg kept the blocks with.
        claims: the transfer ids decoders waited for, in order.
    """

    def __init__(self, wait_s: float = 2.0):
        self.held: dict[str, dict[str, Any]] = {}
        self.claims: list[str] = []
        self._events: dict[str, asyncio.Event] = {}
        self._wait_s = wait_s

    def hold(self, transfer_id: str, params: dict[str, Any]) -> None:
        self.held[transfer_id] = params
        self._event(transfer_id).set()

    async def claim(self, transfer_id: str) -> dict[str, Any] | None:
        """The held params, once P holds them; None after the wait (the load fails)."""
        self.claims.append(transfer_id)
        try:
            await asyncio.wait_for(self._event(transfer_id).wait(), self._wait_s)
        except asyncio.TimeoutError:
            return None
        return self.held[transfer_id]

    def _event(self, transfer_id: str) -> asyncio.Event:
        return self._events.setdefault(transfer_id, asyncio.Event())

    # ------------------------------------------------------------------ handlers
    async def prefill(self, inst: FakeInstance, request: web.Request,
                      rec: Received) -> web.Response:
        """P: prefill, keep the blocks under the leg's transfer id, answer (rank from the
        ``X-data-parallel-rank`` header, 0 without it)."""
        rank = int(rec.headers.get("X-data-parallel-rank", "0"))
        ranks = len(inst.info["kv_endpoints"]) if inst.info else 1
        params = dict(prefill_params(inst.name, rec.request_id),
                      remote_engine_id=engine_id(inst.name, rank, ranks),
                      remote_port=BASE_PORT + rank)
        transfer_id = (rec.body.get("kv_transfer_params") or {}).get("transfer_id")
        if transfer_id:
            self.hold(transfer_id, params)
        return web.json_response({"id": f"cmpl-{rec.request_id}", "object": "text_completion",
                                  "choices": [{"index": 0, "text": "H",
                                               "finish_reason": "length"}],
                                  "kv_transfer_params": params})

    async def decode(self, inst: FakeInstance, request: web.Request,
                     rec: Received) -> web.StreamResponse:
        """D: a pending leg waits at P's side channel (a chat stream sends its opening chunk
        first), then decodes; a claim never answered is a failed KV load (503, or an in-band
        503 event once the stream started)."""
        kv = rec.body.get("kv_transfer_params") or {}
        chat = request.path.endswith("chat/completions")
        stream = rec.body.get("stream") is True
        resp = None
        if stream and chat:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(sse({"id": f"chatcmpl-{inst.name}", "choices": [
                {"index": 0, "delta": {"role": "assistant", "content": ""},
                 "finish_reason": None}]}))
        if kv.get("remote_transfer_id") and await self.claim(kv["remote_transfer_id"]) is None:
            error = {"error": {"message": "KV load: the prefiller did not answer in time",
                               "type": "upstream_unavailable", "param": None, "code": 503}}
            if resp is None:
                return web.json_response(error, status=503)
            await resp.write(sse(error) + b"data: [DONE]\n\n")
            return resp
        if resp is None:
            return await inst._decode(request, rec)
        for i, piece in enumerate(inst.chunks):
            last = i == len(inst.chunks) - 1
            await resp.write(sse({"id": f"chatcmpl-{inst.name}", "choices": [
                {"index": 0, "delta": {"content": piece},
                 "finish_reason": "length" if last else None}]}))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def install(self, prefillers: list[FakeInstance], decoders: list[FakeInstance]) -> None:
        """Make these fakes speak the hand-off."""
        for p in prefillers:
            p.handler = self.prefill
        for d in decoders:
            d.handler = self.decode
