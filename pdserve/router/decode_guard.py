"""Work the decode leg will not use is not done, or not kept, by P.

* Before the prefill leg: when every decode instance failed its last connection and none answers
  a ``/health`` probe now, the request is refused (503) without prefilling.
* After the prefill leg: when the decode leg will not read P's blocks (D answered an error, no
  decoder could be reached, the client went away between the legs), P is asked in the background
  to free them at once (``POST /v1/kv_transfer/release`` with the ``kv_transfer_params`` P
  returned; pdserve/kv_transfer/nixl/release.py) instead of at the end of its lease. A failed
  call only means the lease runs out as before.
* After the decode leg, in multi-turn mode: the blocks D keeps for a request without a
  conversation are released on D the same way (the proxy will never pull them).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Awaitable, Callable

import aiohttp
from yarl import URL

from pdserve.router.metrics import ProxyMetrics
from pdserve.router.upstreams import Upstream, UpstreamPool

logger = logging.getLogger("pdserve.router")

#: P's endpoint that frees a prefill lease the decode leg will not read.
RELEASE_PATH = "/v1/kv_transfer/release"

_encode = json.JSONEncoder(separators=(",", ":")).encode


class DecodeLegGuard:
    """The proxy's checks around the decode leg (see the module docstring).

    Args:
        decoders: the decode instances.
        probe: ``await probe(upstream)`` -> True when the instance answers ``/health`` with 200.
        metrics: counts skipped prefills and releases.
        session: returns the proxy's HTTP client session.
    """

    def __init__(self, decoders: UpstreamPool, probe: Callable[[Upstream], Awaitable[bool]],
                 metrics: ProxyMetrics, session: Callable[[], aiohttp.ClientSession]):
        self._decoders = decoders
        self._probe = probe
        self._metrics = metrics
        self._session = session
        self._tasks: set[asyncio.Task] = set()  # releases in flight
        self._urls: dict[str, URL] = {}

    async def decoders_reachable(self) -> bool:
        """False when every decode instance failed its last connection and none answers a
        health probe now (prefilling would be wasted); counted. Costs nothing while any
        decoder's last connection succeeded."""
        if not self._decoders.all_failed():
            return True
        ups = self._decoders.upstreams
        results = await asyncio.gather(*(self._probe(u) for u in ups))
        for up, ok in zip(ups, results):
            if ok:
                self._decoders.mark_up(up)
        if not any(results):
            self._metrics.prefills_skipped.inc()
        return any(results)

    def release(self, owner: Upstream, params: dict[str, Any] | None,
                headers: dict[str, str]) -> None:
        """Ask the instance that returned ``params`` (P for its decode leg, or D for the next
        turn), in the background, to free the blocks it keeps for them (nothing when it returned
        no params)."""
        if not params or params.get("remote_request_id") is None:
            return
        data = _encode({"kv_transfer_params": params}).encode()
        task = asyncio.get_running_loop().create_task(self._post(owner, data, headers))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _post(self, p_up: Upstream, data: bytes, headers: dict[str, str]) -> None:
        url = self._urls.get(p_up.url)
        if url is None:
            url = self._urls[p_up.url] = URL(p_up.url + RELEASE_PATH)
        outcome = "failed"
        try:
            async with self._session().post(url, data=data, headers=headers) as resp:
                answer = await resp.json(content_type=None) if resp.status == 200 else None
            if isinstance(answer, dict):
                outcome = "released" if answer.get("released") else "not_held"
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            logger.debug("releasing a prefill lease on %s failed: %s", p_up.url, e)
        self._metrics.kv_releases.labels(outcome=outcome).inc()
