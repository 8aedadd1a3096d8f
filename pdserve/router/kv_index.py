"""The proxy's view of which prefix-cache blocks each instance holds, kept from its KV events.

One :class:`InstanceKVIndex` per instance holds the set of chained block hashes the instance
has in its prefix cache, and those of each of its KV cache tiers (events with ``medium``
``"CPU"`` / ``"DISK"``; ``"GPU"`` or none is the KV cache itself). A :class:`KVEventSubscriber` task per instance fills it:

1. discovery: ``GET {instance}/kv_events`` names the PUB and snapshot endpoints (retried every
   :data:`DISCOVERY_RETRY_S` seconds while the instance has none or is down); a wildcard bind
   host (``*``, ``0.0.0.0``, ``::``) is replaced by the instance URL's host;
2. a SUB socket on the PUB endpoint; then a snapshot (ZMQ REQ to the snapshot endpoint) sets
   the hash set as of batch ``seq``; batches up to ``seq`` are skipped, later ones applied;
3. a batch whose number is not the last one + 1 (lost batches), or of another ``epoch`` (the
   engine restarted), triggers a new snapshot.

An index is *live* while it is synced and its last batch (engines send a heartbeat at least every
second, :data:`pdserve.engine.kv_events.HEARTBEAT_INTERVAL_S`) is at most ``stale_after``
seconds old; routing ignores indexes that are not live (docs/proxy.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable, Sequence
from urllib.parse import urlsplit

import aiohttp
import msgspec

from pdserve.types.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch,
                                      KVSnapshot)

logger = logging.getLogger("pdserve.router")

#: Seconds between discovery attempts (``GET /kv_events``) of an instance without events.
DISCOVERY_RETRY_S = 1.0
#: Seconds to wait for a snapshot answer before trying again.
SNAPSHOT_TIMEOUT_S = 2.0
#: Default seconds without any batch after which an index is not live (heartbeats come every ~1 s).
DEFAULT_STALE_AFTER_S = 5.0

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")
#: The medium of an engine's own KV cache in KV events (vLLM's name, whatever the device).
GPU = "GPU"
_TIER_ORDER = {"CPU": 0, "DISK": 1}


class InstanceKVIndex:
    """Cached block hashes of one instance.

    Attributes:
        url: the instance's base URL.
        hashes: chained block hashes in its prefix cache (medium ``"GPU"``).
        tier_hashes: medium (``"CPU"``, ``"DISK"``) -> chained block hashes in that tier.
        block_size: tokens per block (from its snapshot; 0 until synced).
        epoch, seq: the engine process and the last batch applied.
        synced: a snapshot was applied and no gap has been seen since.
        last_message: ``clock()`` time of the last batch or snapshot (s).
        resyncs: snapshots taken after the first one (gaps, restarts).
    """

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic):
        self.url = url
        self.hashes: set[int] = set()
        self.tier_hashes: dict[str, set[int]] = {}
        self.block_size = 0
        self.epoch = 0
        self.seq = 0
        self.synced = False
        self.last_message = float("-inf")
        self.resyncs = 0
        self._clock = clock

    def live(self, stale_after: float) -> bool:
        """True when the index is synced and heard from within ``stale_after`` seconds."""
        return self.synced and self._clock() - self.last_message <= stale_after

    def hit_blocks(self, prompt_hashes: Sequence[int]) -> int:
        """Leading blocks of a prompt (its chained hashes, in order) held by the instance."""
        n = 0
        hashes = self.hashes
        for h in prompt_hashes:
            if h not in hashes:
                break
            n += 1
        return n

    def hit_media(self, prompt_hashes: Sequence[int]) -> list[str]:
        """The medium of each leading block of a prompt that the instance holds: ``"GPU"``
        when its KV cache has it, else the first tier that does (``"CPU"`` before
        ``"DISK"``); stops at the first block held nowhere."""
        media: list[str] = []
        hashes = self.hashes
        tiers = sorted(self.tier_hashes.items(), key=lambda kv: _TIER_ORDER.get(kv[0], 9))
        for h in prompt_hashes:
            if h in hashes:
                media.append(GPU)
                continue
            medium = next((m for m, s in tiers if h in s), None)
            if medium is None:
                break
            media.append(medium)
        return media

    def apply_snapshot(self, snap: KVSnapshot) -> None:
        """Replace the hash set by ``snap`` (then batches after ``snap.seq`` apply)."""
        if self.synced or self.epoch:
            self.resyncs += 1
        self.hashes = set(snap.block_hashes)
        self.tier_hashes = {m: set(hs) for m, hs in snap.tier_block_hashes.items()}
        self.block_size = snap.block_size
        self.epoch = snap.epoch
        self.seq = snap.seq
        self.synced = True
        self.last_message = self._clock()

    def apply_batch(self, batch: KVEventBatch) -> bool:
        """Apply one batch.

        Returns:
            False when a snapshot is needed first (not synced, another epoch, or a gap); the
            batch is then not applied. A batch already covered by the snapshot is skipped.
        """
        if not self.synced or batch.epoch != self.epoch:
            self.synced = False
            return False
        if batch.seq <= self.seq:
            self.last_message = self._clock()
            return True  # covered by the snapshot
        if batch.seq != self.seq + 1:
            self.synced = False
            return False
        for ev in batch.events:
            if type(ev) is BlockStored:
                self._set(ev.medium).update(ev.block_hashes)
            elif type(ev) is BlockRemoved:
                self._set(ev.medium).difference_update(ev.block_hashes)
            elif type(ev) is AllBlocksCleared:
                self.hashes.clear()
        self.seq = batch.seq
        self.last_message = self._clock()
        return True


    def _set(self, medium: str | None) -> set[int]:
        if medium is None or medium == GPU:
            return self.hashes
        return self.tier_hashes.setdefault(medium, set())


def connectable(endpoint: str, instance_url: str) -> str:
    """``endpoint`` with a wildcard bind host replaced by the host of ``instance_url``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, sep, port = endpoint[len("tcp://"):].rpartition(":")
    if sep and host in _WILDCARD_HOSTS:
        inst_host = urlsplit(instance_url).hostname or "127.0.0.1"
        if ":" in inst_host:
            inst_host = f"[{inst_host}]"
        return f"tcp://{inst_host}:{port}"
    return endpoint


class KVEventSubscriber:
    """The task that keeps one :class:`InstanceKVIndex` up to date (see the module docstring).

    Args:
        index: the index to fill.
        session: an aiohttp session for discovery.
        auth: ``Authorization`` header value for discovery, or None.
    """

    def __init__(self, index: InstanceKVIndex, session: aiohttp.ClientSession, auth: str | None):
        self.index = index
        self._session = session
        self._auth = auth
        self._task: asyncio.Task | None = None
        self._ctx = None

    def start(self) -> None:
        """Start the task in the running event loop."""
        import zmq.asyncio

        self._ctx = zmq.asyncio.Context()
        self._task = asyncio.ensure_future(self._run())

    async def close(self) -> None:
        """Stop the task and close its sockets; the index stops being live."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.index.synced = False
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _discover(self) -> tuple[str, str]:
        url = self.index.url
        headers = {"Authorization": self._auth} if self._auth else None
        while True:
            try:
                async with self._session.get(url + "/kv_events", headers=headers,
                                             timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        info = await r.json()
                        return (connectable(info["endpoint"], url),
                                connectable(info["snapshot_endpoint"], url))
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
                pass
            await asyncio.sleep(DISCOVERY_RETRY_S)

    async def _snapshot(self, endpoint: str) -> KVSnapshot | None:
        import zmq

        sock = self._ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            await sock.send(b"")
            if not await sock.poll(SNAPSHOT_TIMEOUT_S * 1000):
                return None
            return msgspec.msgpack.decode(await sock.recv(), type=KVSnapshot)
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            logger.warning("KV events snapshot from %s failed: %s", endpoint, e)
            return None
        finally:
            sock.close(0)

    async def _run(self) -> None:
        import zmq

        index = self.index
        pub, snap_endpoint = await self._discover()
        logger.info("KV events of %s: %s (snapshots %s)", index.url, pub, snap_endpoint)
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub)
        decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        try:
            while True:
                if not index.synced:
                    snap = await self._snapshot(snap_endpoint)
                    if snap is None:
                        await asyncio.sleep(DISCOVERY_RETRY_S)
                        continue
                    index.apply_snapshot(snap)
                    logger.debug("KV index of %s synced at batch %d (%d blocks)", index.url,
                                 snap.seq, len(snap.block_hashes))
                try:
                    batch = decode(await sub.recv())
                except msgspec.DecodeError as e:
                    logger.warning("bad KV event batch from %s: %s", index.url, e)
                    continue
                if not index.apply_batch(batch):
                    logger.info("KV events of %s: gap or restart at batch %d; resyncing",
                                index.url, batch.seq)
        finally:
            sub.close(0)
