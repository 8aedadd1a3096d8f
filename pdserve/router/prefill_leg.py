"""A prefill leg of the concurrent hand-off: sent together with the decode leg, read in the
background (the decode leg does not wait for it), given up by closing it or by releasing P's
blocks (:meth:`PrefillLeg.abandon`); and the parse of P's answer, which both hand-offs use."""

from __future__ import annotations

import asyncio
import json
import logging
from time import perf_counter
from typing import Any, Callable

from pdserve.utils import phase_trace
from pdserve.router.decode_guard import DecodeLegGuard
from pdserve.router.errors import ProxyError
from pdserve.router.handoff import PrefillRanks, names_endpoint
from pdserve.router.upstream_client import Turn, UpstreamClient, UpstreamHTTPError
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")


def parse_prefill_answer(client: UpstreamClient, up: Upstream, raw: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of P's (200) answer; None when it returned none.

    Raises:
        ProxyError: 502 (counted against ``up``) when the answer is not a JSON object or its
            params are not an object.
    """
    try:
        answer = json.loads(raw)
    except ValueError:
        raise client.invalid_response(up, "body is not JSON") from None
    params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
    if params is not None and not isinstance(params, dict):
        raise client.invalid_response(up, "kv_transfer_params is not an object")
    return params


class PrefillLeg:
    """One prefill leg of a concurrent attempt, in a task of its own.

    Args:
        client: the pooled client (the leg's request, failures counted).
        prefillers: P's pool (a refused connection marks P down there).
        guard: releases P's blocks when the leg is given up after P answered.
        up: the prefiller.
        ranks: its KV endpoints; ``rank`` is counted in flight while the leg runs.
        rank: the data-parallel rank the leg names.
        headers: the leg's headers (``X-Request-Id``, auth, the rank header); the release uses
            them too.
        request_id: the request's id (a scratch :class:`Turn`: P's wait overlaps D's, which
            alone counts as the request's upstream wait).
        observe: ``observe(seconds)`` with the hand-off time of a leg P answered (sent -> answer).
        on_stale: ``on_stale(up)`` when P's answer names another engine than ``ranks`` (it
            restarted since its endpoints were learned).
    """

    def __init__(self, client: UpstreamClient, prefillers: UpstreamPool, guard: DecodeLegGuard,
                 up: Upstream, ranks: PrefillRanks, rank: int, headers: dict[str, str],
                 request_id: str, observe: Callable[[float], None],
                 on_stale: Callable[[Upstream], None]):
        self.up = up
        self.rank = rank
        self._client = client
        self._prefillers = prefillers
        self._guard = guard
        self._ranks = ranks
        self._headers = headers
        self._turn = Turn(request_id, perf_counter())
        self._observe = observe
        self._on_stale = on_stale
        self.task: asyncio.Task | None = None

    def start(self, path: str, data: bytes) -> asyncio.Task:
        """Send the leg (``data``: its encoded body) in a new task; returns the task, whose
        result is P's params (see :attr:`params`)."""
        self.task = asyncio.get_running_loop().create_task(self._run(path, data))
        self.task.add_done_callback(_retrieve)
        return self.task

    @property
    def done(self) -> bool:
        """True once P answered, failed, or the leg was closed."""
        return self.task is not None and self.task.done()

    @property
    def failure(self) -> ProxyError | UpstreamHTTPError | None:
        """Why the finished leg failed (a refused connection: a ``ProxyError`` naming no
        upstream); None while it runs, after P's answer, or once closed.

        Raises:
            Exception: what else the leg raised (a bug: not taken for P's failure).
        """
        if not self.done or self.task.cancelled():
            return None
        exc = self.task.exception()
        if exc is None or isinstance(exc, (ProxyError, UpstreamHTTPError)):
            return exc
        raise exc

    @property
    def answered(self) -> bool:
        """True once P answered 200 with a usable body."""
        return self.done and not self.task.cancelled() and self.task.exception() is None

    @property
    def params(self) -> dict[str, Any] | None:
        """The ``kv_transfer_params`` P returned; None before its answer or without them."""
        return self.task.result() if self.answered else None

    def abandon(self) -> None:
        """Give the leg up: while it runs, close it (P's server aborts the request and frees
        its blocks); once P answered, release the blocks it holds for the decoder."""
        if self.task is None:
            return
        if not self.task.done():
            self.task.cancel()
        elif self.answered:
            self._guard.release(self.up, self.params, self._headers)

    async def _run(self, path: str, data: bytes) -> dict[str, Any] | None:
        self._ranks.enter(self.rank)
        t_sent = perf_counter()
        try:
            up, resp = await self._client.open([self.up], self._prefillers, path, data,
                                               self._headers, self._turn)
            raw = await self._client.read_body(up, resp, self._turn)
            phase_trace.mark("px.p_read")
            self._client.check_status(up, resp, raw)
            params = parse_prefill_answer(self._client, up, raw)
        finally:
            self._ranks.leave(self.rank)
        self._observe(perf_counter() - t_sent)
        if not names_endpoint(params, self._ranks.endpoint(self.rank)):
            logger.warning("prefill instance %s answered as engine %s, not the %s it listed: "
                           "asking it for its KV endpoints again", self.up.url,
                           params.get("remote_engine_id"), self._ranks.endpoint(self.rank).engine_id)
            self._on_stale(self.up)
        return params


def _retrieve(task: asyncio.Task) -> None:
    """Mark a finished leg's exception as seen (it is read through :attr:`PrefillLeg.failure`,
    or not at all when the decode leg answered first)."""
    if not task.cancelled():
        task.exception()
