"""KV cache events of one engine: the buffer its caches record them in, and their publisher.

:class:`KVEventBuffer` is the one event recorder: the prefix cache
(:class:`pdserve.engine.block_manager.KVCacheManager`) and the KV cache tiers
(:class:`pdserve.engine.kv_tiers.TierManager`) each own one, and the engine core takes both once
per step. What the events say, their wire format, the heartbeat and the snapshot endpoint that a
subscriber asks after a gap: :mod:`pdserve.types.kv_events`. :class:`KVEventPublisher` (the
engine core's, ``--kv-events-endpoint``) sends one batch per engine step that changed the prefix
cache on a ZMQ PUB socket, a heartbeat batch when nothing changed for
:data:`~pdserve.types.kv_events.HEARTBEAT_INTERVAL_S`, and answers snapshot requests on a ZMQ
REP socket.
"""

from __future__ import annotations

import logging
import time

import msgspec

from pdserve.types.kv_events import (HEARTBEAT_INTERVAL_S, BlockRemoved, BlockStored, KVEvent,
                                     KVEventBatch, KVSnapshot)

logger = logging.getLogger(__name__)


class KVEventBuffer:
    """KV events recorded since they were last taken, in the order they happened; records
    nothing until :meth:`enable` is called (KV events are off by default).

    Attributes:
        enabled: True once :meth:`enable` was called.
    """

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events: list[KVEvent] | None = None  # None: KV events off

    @property
    def enabled(self) -> bool:
        return self._events is not None

    def enable(self) -> None:
        """Start recording (idempotent: events recorded so far are kept)."""
        if self._events is None:
            self._events = []

    def take(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (empty when events are off)."""
        events = self._events
        if not events:
            return []
        self._events = []
        return events

    def append(self, event: KVEvent) -> None:
        """Record ``event`` as one event of its own (ignored when events are off)."""
        if self._events is not None:
            self._events.append(event)

    def add_hash(self, cls: type[BlockStored] | type[BlockRemoved], block_hash: int,
                 medium: str | None = None) -> None:
        """Record that block ``block_hash`` was stored in or removed from ``medium`` (``cls``:
        :class:`BlockStored` or :class:`BlockRemoved`; ``medium``: ``"CPU"``, ``"DISK"``, or
        None for the KV cache itself). The hash joins the last event when that one is of the
        same class and medium, else starts a new event (ignored when events are off)."""
        events = self._events
        if events is None:
            return
        last = events[-1] if events else None
        if last is not None and type(last) is cls and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            events.append(cls([block_hash], medium=medium))


class KVEventPublisher:
    """The engine core's side: a PUB socket for batches and a REP socket for snapshots.

    Args:
        endpoint: ZMQ endpoint the PUB socket binds (``tcp://*:5557``, ``ipc://...``).
        snapshot_endpoint: ZMQ endpoint the REP socket binds.
        block_size: tokens per block (sent in snapshots).

    Raises:
        zmq.ZMQError: an endpoint cannot be bound (address in use, bad form).
    """

    def __init__(self, endpoint: str, snapshot_endpoint: str, block_size: int):
        import zmq

        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self.snapshot_socket = self._ctx.socket(zmq.REP)
        self.snapshot_socket.setsockopt(zmq.LINGER, 0)
        try:
            self._pub.bind(endpoint)
            self.snapshot_socket.bind(snapshot_endpoint)
        except zmq.ZMQError:
            self.close()
            raise
        self.block_size = block_size
        self.epoch = time.time_ns()
        self.seq = 0
        self._last_sent = 0.0
        self._encoder = msgspec.msgpack.Encoder()
        logger.info("KV events on %s (snapshots on %s)", endpoint, snapshot_endpoint)

    def publish(self, events: list[KVEvent]) -> None:
        """Send ``events`` as one batch; with no events, a heartbeat when one is due."""
        now = time.monotonic()
        if not events and now - self._last_sent < HEARTBEAT_INTERVAL_S:
            return
        self.seq += 1
        self._last_sent = now
        self._pub.send(self._encoder.encode(KVEventBatch(self.epoch, self.seq, time.time(), events)))

    def serve_snapshot(self, block_hashes: list[int],
                       tier_block_hashes: dict[str, list[int]] | None = None) -> None:
        """Answer one pending snapshot request (call when :attr:`snapshot_socket` is readable)
        with ``block_hashes`` (the KV cache's) and ``tier_block_hashes`` (each tier's, by
        medium) as of the last published batch."""
        import zmq

        try:
            self.snapshot_socket.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        self.snapshot_socket.send(self._encoder.encode(
            KVSnapshot(self.epoch, self.seq, self.block_size, block_hashes,
                       tier_block_hashes or {})))

    def close(self) -> None:
        """Close both sockets (idempotent)."""
        self._pub.close(0)
        self.snapshot_socket.close(0)
        self._ctx.term()
