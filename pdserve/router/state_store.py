"""Where the multi-turn proxy keeps its conversation table: in-process memory, or Redis.

The table maps ``conversation_id`` -> which prefill and decode instances served the last turn,
and the decoder's returned ``kv_transfer_params`` (where D keeps the turn's KV blocks).

* :class:`MemoryStateStore` (the default): :class:`pdserve.router.conversations.ConversationStore`
  in this process (LRU- and TTL-bounded; the params single-use there too).
* :class:`RedisStateStore` (``--state-store redis://HOST:PORT/DB``): shared by every proxy
  replica on that Redis. Per conversation two keys: ``pdserve:conv:{id}`` (the instances, JSON,
  expiring ``--conversation-ttl`` seconds after the last turn) and ``pdserve:conv:{id}:kv`` (D's
  params, JSON, expiring with D's ``remote_blocks_expiry_time`` when sooner). The params are
  single-use: :meth:`RedisStateStore.load` reads the instances and takes the params in one
  atomic server-side script (GET + GET + DEL), so two replicas racing on the same conversation
  never both hand out the same D blocks; the loser recomputes. Redis unreachable or slow
  (:data:`REDIS_TIMEOUT_S`): the turn is served as recompute, the failure is counted (the
  ``on_error`` callback, ``pdserve:proxy_state_store_errors_total``) and logged at most once per
  :data:`LOG_INTERVAL_S`; for :data:`RETRY_AFTER_S` after a failure the store is skipped (and
  each skip counted) so that requests do not queue on a dead server. A request never fails
  because of the store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from pdserve.router.conversations import (ConversationState, ConversationStore,
                                          params_life_s)

logger = logging.getLogger("pdserve.router")

#: Seconds a Redis connect or command may take before the turn goes on without the store.
REDIS_TIMEOUT_S = 0.5
#: Seconds the store is skipped after a failure.
RETRY_AFTER_S = 1.0
#: Seconds between two log lines about an unreachable store.
LOG_INTERVAL_S = 60.0
#: Key prefix of the conversation table in Redis.
KEY_PREFIX = "pdserve:conv:"

# Atomically: the instances of the last turn, and D's params taken (deleted) if present.
_LOAD_SCRIPT = """
local route = redis.call('GET', KEYS[1])
local kv = redis.call('GET', KEYS[2])
if kv then redis.call('DEL', KEYS[2]) end
return {route, kv}
"""


def check_state_store_url(url: str) -> str:
    """Validate ``--state-store``: ``memory`` or ``redis://HOST[:PORT][/DB]``.

    Raises:
        ValueError: any other form (the message says which is expected).
    """
    if url == "memory":
        return url
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise ValueError(f"--state-store {url!r}: expected 'memory' or redis://HOST:PORT/DB")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise ValueError(f"--state-store {url!r}: the database must be a number, got {db!r}")
    try:
        parts.port
    except ValueError as e:
        raise ValueError(f"--state-store {url!r}: {e}") from None
    return url


class MemoryStateStore:
    """The conversation table in this process (see :class:`ConversationStore`).

    Args:
        table: the table (``DisaggProxy.conversations``).
    """

    def __init__(self, table: ConversationStore):
        self.table = table

    async def load(self, conversation_id: str) -> ConversationState | None:
        """The conversation's state, its params taken (single-use)."""
        return self.table.take(conversation_id)

    async def record_turn(self, conversation_id: str, prefiller_url: str | None,
                          decoder_url: str | None, kv_transfer_params: dict[str, Any] | None) -> None:
        """Store a finished turn (None: the conversation has no params)."""
        self.table.record_turn(conversation_id, prefiller_url, decoder_url, kv_transfer_params)

    async def close(self) -> None:
        """Nothing to release."""


class RedisStateStore:
    """The conversation table in Redis, shared by proxy replicas (see the module docstring).

    Args:
        url: ``redis://HOST:PORT/DB``.
        ttl: seconds a conversation's entry lives after its last turn.
        on_error: called with the operation name (``"load"`` / ``"record"``) per failed or
            skipped operation.
        wall_clock: Unix time in seconds (injectable for tests).
    """

    def __init__(self, url: str, ttl: float, on_error: Callable[[str], None],
                 wall_clock: Callable[[], float] = time.time):
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        self.url = url
        self.ttl = ttl
        self._on_error = on_error
        self._wall_clock = wall_clock
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False)
        self._load = self._redis.register_script(_LOAD_SCRIPT)
        self._skip_until = 0.0
        self._last_log = float("-inf")

    def _available(self, op: str) -> bool:
        if time.monotonic() < self._skip_until:
            self._on_error(op)
            return False
        return True

    def _failed(self, op: str, exc: BaseException) -> None:
        now = time.monotonic()
        self._skip_until = now + RETRY_AFTER_S
        self._on_error(op)
        if now - self._last_log >= LOG_INTERVAL_S:
            self._last_log = now
            logger.warning("state store %s unreachable (%s: %s); serving turns as recompute "
                           "(logged once per minute)", self.url, type(exc).__name__, exc)

    async def load(self, conversation_id: str) -> ConversationState | None:
        """The instances of the conversation's last turn, and D's params taken (single-use).

        Returns None when the conversation is unknown or the store cannot be reached.
        """
        import redis.exceptions

        if not self._available("load"):
            return None
        key = KEY_PREFIX + conversation_id
        try:
            route_raw, kv_raw = await asyncio.wait_for(self._load(keys=[key, key + ":kv"]),
                                                       REDIS_TIMEOUT_S * 2)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
            self._failed("load", e)
            return None
        if route_raw is None and kv_raw is None:
            return None
        try:
            route = json.loads(route_raw) if route_raw is not None else {}
            params = json.loads(kv_raw) if kv_raw is not None else None
        except ValueError:
            logger.warning("state store: unreadable entry for conversation %r ignored",
                           conversation_id)
            return None
        return ConversationState(route.get("p"), route.get("d"),
                                 params if isinstance(params, dict) else None,
                                 float("inf"), float("inf"))

    async def record_turn(self, conversation_id: str, prefiller_url: str | None,
                          decoder_url: str | None, kv_transfer_params: dict[str, Any] | None) -> None:
        """Store a finished turn: the instances (``ttl``), and D's params (until
        ``min(ttl, remote_blocks_expiry_time)``; None or already expired params leave the
        conversation none)."""
        import redis.exceptions

        if not self._available("record"):
            return
        key = KEY_PREFIX + conversation_id
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(key, json.dumps({"p": prefiller_url, "d": decoder_url}),
                 px=max(1, int(self.ttl * 1000)))
        life_s = 0.0
        if kv_transfer_params is not None:
            life_s = min(self.ttl, params_life_s(kv_transfer_params, self._wall_clock()))
        if life_s > 0:
            pipe.set(key + ":kv", json.dumps(kv_transfer_params), px=max(1, int(life_s * 1000)))
        else:
            pipe.delete(key + ":kv")
        try:
            await asyncio.wait_for(pipe.execute(), REDIS_TIMEOUT_S * 2)
        except (redis.exceptions.RedisError, OSError, asyncio.TimeoutError) as e:
            self._failed("record", e)

    async def close(self) -> None:
        """Close the connection pool."""
        try:
            await self._redis.aclose()
        except Exception:  # noqa: BLE001 - closing a broken connection must not fail shutdown
            pass
