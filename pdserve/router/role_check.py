"""The check that each instance serves the leg it is given: the proxy asks every instance its
P/D role once (``GET /pdserve/instance``, :mod:`pdserve.entrypoints.instance_info`) and refuses a
prefiller that is a decoder (``kv_consumer``), a decoder that is a prefiller (``kv_producer``),
one instance in both lists, or instances that serve different models (a request names one
model, and both of its legs must serve it), naming the flags to fix (docs/proxy.md, "Role
check").

An instance that does not answer the route (a vLLM engine, an older pdserve) is taken as
configured; one not reachable yet is asked again on the next request. Every answer also goes
to ``on_info`` (the concurrent hand-off learns a prefiller's KV endpoints from it,
:mod:`pdserve.router.handoff`); :meth:`RoleCheck.refresh` asks one instance again in the
background (its engine restarted: another engine id).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Sequence

import aiohttp

from pdserve.types.instance_info import INSTANCE_INFO_PATH
from pdserve.router.upstreams import Upstream, UpstreamPool

__all__ = ["ROLE_PROBE_TIMEOUT_S", "RoleCheck", "RoleMismatch"]

logger = logging.getLogger("pdserve.router")

#: Seconds one instance may take to answer its role.
ROLE_PROBE_TIMEOUT_S = 5.0
#: Seconds between two background questions to one instance (:meth:`RoleCheck.refresh`).
REFRESH_INTERVAL_S = 1.0
#: The ``kv_role`` values that cannot serve a leg.
_WRONG_ROLE = {"prefill": "kv_consumer", "decode": "kv_producer"}
_FLAGS = {"prefill": "--prefiller-hosts/--prefiller-ports",
          "decode": "--decoder-hosts/--decoder-ports"}
_OTHER = {"prefill": "decode", "decode": "prefill"}


class RoleMismatch(Exception):
    """An instance is given for a leg its role cannot serve (the message names the flags)."""


class _Unknown:
    """The role of an instance not asked yet, or not reachable when asked."""


class RoleCheck:
    """Asks each instance its role until every one has answered; remembers a mismatch.

    Args:
        pools: the prefill and decode pools.
        session: returns the proxy's aiohttp session (it exists from the app's start-up on).
        auth: the ``Authorization`` header sent to the instances, or None.
        on_info: ``on_info(upstream, info)`` with every answer (None: the instance has no such
            route); None: nobody listens.
        clock: monotonic seconds (rate of :meth:`refresh`).
    """

    def __init__(self, pools: Sequence[UpstreamPool],
                 session: Callable[[], aiohttp.ClientSession], auth: str | None,
                 on_info: Callable[[Upstream, dict[str, Any] | None], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self._session = session
        self._auth = auth
        self._on_info = on_info
        self._clock = clock
        self._refreshing: dict[str, asyncio.Task] = {}
        self._refreshed: dict[str, float] = {}  # url -> clock() of its last background question
        self._pending: list[Upstream] = [up for pool in pools for up in pool.upstreams]
        self._engine_ids: dict[str, Upstream] = {}  # engine id -> the first instance that had it
        self._model: tuple[str, Upstream] | None = None  # the first served model named, and where
        self._mismatch: RoleMismatch | None = None
        self._asking = asyncio.Lock()  # concurrent requests wait for one round of questions

    @property
    def done(self) -> bool:
        """True when every instance has answered and none was refused (requests then skip
        :meth:`check`)."""
        return not self._pending and self._mismatch is None

    async def check(self) -> None:
        """Asks the instances that have not answered yet.

        Raises:
            RoleMismatch: an instance's role cannot serve its leg, or one engine is in both
                lists (raised again on every later call).
        """
        async with self._asking:
            if self._mismatch is not None:
                raise self._mismatch
            if not self._pending:
                return
            pending = list(self._pending)
            answers = await asyncio.gather(*(self._ask(up) for up in pending))
            for up, info in zip(pending, answers):
                if info is _Unknown:
                    continue
                self._pending.remove(up)
                if info is not None:
                    self._judge(up, info)
                if self._on_info is not None and self._mismatch is None:
                    self._on_info(up, info)
                if self._mismatch is not None:
                    logger.error("%s", self._mismatch)
                    raise self._mismatch

    def refresh(self, up: Upstream) -> None:
        """Ask ``up`` again in the background and hand its answer to ``on_info`` (nothing when
        it cannot be reached); at most one question in flight per instance and one every
        :data:`REFRESH_INTERVAL_S`. Roles are not judged again."""
        now = self._clock()
        if up.url in self._refreshing or now - self._refreshed.get(up.url, -REFRESH_INTERVAL_S) \
                < REFRESH_INTERVAL_S:
            return
        self._refreshed[up.url] = now
        task = asyncio.get_running_loop().create_task(self._refresh(up))
        self._refreshing[up.url] = task
        task.add_done_callback(lambda _: self._refreshing.pop(up.url, None))

    async def _refresh(self, up: Upstream) -> None:
        info = await self._ask(up)
        if info is not _Unknown and self._on_info is not None:
            logger.info("asked %s again for its KV endpoints", up.url)
            self._on_info(up, info)

    async def close(self) -> None:
        """Cancel the background questions."""
        tasks = list(self._refreshing.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _judge(self, up: Upstream, info: dict) -> None:
        role = info.get("kv_role")
        if role == _WRONG_ROLE[up.leg]:
            what = "decoder" if role == "kv_consumer" else "prefiller"
            self._mismatch = RoleMismatch(
                f"{up.url} is given as a {up.leg} instance ({_FLAGS[up.leg]}), but it is a "
                f"{what} (kv_role {role}); give it with {_FLAGS[_OTHER[up.leg]]} instead, or "
                f"restart it with --kv-transfer-config.kv_role "
                f"{'kv_producer' if up.leg == 'prefill' else 'kv_consumer'}")
            return
        model = info.get("model")
        if isinstance(model, str):
            first = self._model = self._model or (model, up)
            if first[0] != model:
                self._mismatch = RoleMismatch(
                    f"{first[1].url} ({first[1].leg}) serves the model {first[0]!r} but {up.url} "
                    f"({up.leg}) serves {model!r}: every request names one model and both of its "
                    "legs must serve it; start every instance with the same model (or the same "
                    "--served-model-name)")
                return
        engine_id = info.get("engine_id")
        if not isinstance(engine_id, str):
            return
        seen = self._engine_ids.setdefault(engine_id, up)
        if seen is not up and seen.leg != up.leg:
            self._mismatch = RoleMismatch(
                f"one instance is given as both prefiller ({_FLAGS['prefill']}) and decoder "
                f"({_FLAGS['decode']}): {seen.url} and {up.url} are the same engine "
                f"{engine_id}; a decoder cannot pull KV from itself, so give each instance in "
                "one list only")

    async def _ask(self, up: Upstream) -> dict | None | type[_Unknown]:
        """The instance's answer; None when it has no such route; :class:`_Unknown` when it
        cannot be reached."""
        timeout = aiohttp.ClientTimeout(total=ROLE_PROBE_TIMEOUT_S)
        headers = {"Authorization": self._auth} if self._auth else None
        try:
            async with self._session().get(up.url + INSTANCE_INFO_PATH, timeout=timeout,
                                           headers=headers) as resp:
                if resp.status != 200:
                    return None if resp.status in (404, 405) else _Unknown
                info = await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return _Unknown
        except ValueError:  # not JSON: not pdserve's route
            return None
        return info if isinstance(info, dict) else None
