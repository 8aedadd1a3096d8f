"""KV cache events of one engine: the engine core's publisher (``--kv-events-endpoint``).

What the events say, their wire format, the heartbeat and the snapshot endpoint that a subscriber
asks after a gap: :mod:`pdserve.types.kv_events`. :class:`KVEventPublisher` sends one batch per
engine step that changed the prefix cache on a ZMQ PUB socket, a heartbeat batch when nothing
changed for :data:`~pdserve.types.kv_events.HEARTBEAT_INTERVAL_S`, and answers snapshot requests
on a ZMQ REP socket.
"""

from __future__ import annotations

import logging
import time

import msgspec

from pdserve.types.kv_events import HEARTBEAT_INTERVAL_S, KVEvent, KVEventBatch, KVSnapshot

logger = logging.getLogger(__name__)

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
