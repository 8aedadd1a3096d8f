"""Requests the proxy hands to one instance as they are (``GET /v1/models``, vLLM's
``POST /tokenize``, ``POST /detokenize``, ``GET /version``): every instance serves the same model
and tokenizer, so the first one that answers does."""

from __future__ import annotations

import asyncio
from typing import Sequence

import aiohttp
from aiohttp import web

from pdserve.router.errors import UPSTREAM_UNAVAILABLE, error_bytes, normalize_upstream_error
from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstream_client import connect_reason
from pdserve.router.upstreams import Upstream

__all__ = ["PASS_THROUGH_ROUTES", "forward"]

#: The routes handed on, path -> method (``/v1/models`` has its own handler for its API key).
PASS_THROUGH_ROUTES = {"/tokenize": "POST", "/detokenize": "POST", "/version": "GET"}
_JSON = "application/json"


async def forward(session: aiohttp.ClientSession, upstreams: Sequence[Upstream], method: str,
                  path: str, body: bytes | None, headers: dict[str, str],
                  metrics: ProxyMetrics) -> web.Response:
    """The answer of the first of ``upstreams`` that answers below 500, its status kept (an
    error body in the OpenAI shape); 503 naming every failure when none does.

    Args:
        session: the proxy's client session.
        upstreams: the instances to try, in order.
        method, path, body: the request to hand on (``body`` None for a GET).
        headers: the headers to send (content type, authorization).
        metrics: failed instances are counted there.
    """
    failures = []
    for up in upstreams:
        try:
            async with session.request(method, up.url + path, data=body,
                                       headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            metrics.count_error(up.url, up.leg)
            failures.append(f"{up.leg} instance {up.url} unreachable ({connect_reason(e)})")
            continue
        if status < 500:
            out = raw if status == 200 else normalize_upstream_error(status, raw, up.leg, up.url)
            return web.Response(status=status, body=out, headers={"Content-Type": _JSON})
        metrics.count_error(up.url, up.leg)
        failures.append(f"{up.leg} instance {up.url} failed with HTTP {status}")
    return web.Response(status=503, body=error_bytes("; ".join(failures), UPSTREAM_UNAVAILABLE, 503),
                        headers={"Content-Type": _JSON})
