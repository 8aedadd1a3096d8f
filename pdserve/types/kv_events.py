"""KV cache events of one engine: what they say on the wire (the engine core publishes them,
:mod:`pdserve.engine.kv_events`; the proxy's KV-aware routing reads them).

An engine started with ``--kv-events-endpoint tcp://HOST:PORT`` tells subscribers (the proxy's
``--routing kv-aware``) which prefix-cache blocks it holds, by their chained block hashes
(:func:`pdserve.types.block_hash.block_hashes`, the same hashes its prefix cache looks up):

* :class:`BlockStored`: blocks were registered in the prefix cache (their KV is computed);
* :class:`BlockRemoved`: blocks left the prefix cache (evicted for reuse, or invalidated);
* :class:`AllBlocksCleared`: the whole prefix cache was reset.

With KV cache tiers (``--kv-offloading-size``) the same events with ``medium`` ``"CPU"`` or
``"DISK"`` say which blocks a tier holds (:mod:`pdserve.engine.kv_tiers`).

Wire format (msgpack via msgspec): the engine core sends one :class:`KVEventBatch` per engine
step that changed the cache, on a ZMQ PUB socket bound at the endpoint, and an empty batch at
least every :data:`HEARTBEAT_INTERVAL_S` seconds so that a subscriber can tell a quiet engine
from a lost stream. Batches carry a sequence number that rises by one per batch, from 1; a
subscriber that sees a gap (a batch lost by PUB/SUB, a late join, an engine restart) asks the
snapshot endpoint (ZMQ REP, default: the same host, port + 1) for a :class:`KVSnapshot`: every
cached hash, as of batch ``seq``. It then applies only batches after ``seq``. The scheme follows
vLLM's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` on ZMQ PUB with a
replay endpoint).
"""

from __future__ import annotations

from typing import Union

import msgspec

#: Seconds after which the core publishes an empty batch when nothing changed (liveness).
HEARTBEAT_INTERVAL_S = 1.0


class BlockStored(msgspec.Struct, tag=True, array_like=True):
    """Blocks registered in the prefix cache. ``block_hashes``: chained hashes, in prefix order;
    ``medium``: where they are now (vLLM's field: ``"GPU"`` the engine's KV cache, ``"CPU"``
    the host-memory tier, ``"DISK"`` the disk tier; None means ``"GPU"``)."""

    block_hashes: list[int]
    medium: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, array_like=True):
    """Blocks that left the prefix cache, or the tier ``medium`` (as in :class:`BlockStored`)
    (``block_hashes``: their chained hashes)."""

    block_hashes: list[int]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, array_like=True):
    """The whole prefix cache was reset."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True):
    """The events of one engine step.

    Attributes:
        epoch: identifies the publishing engine process (its start time in ns); a new epoch
            means the engine restarted and its sequence began again.
        seq: batch number, 1, 2, 3, ... per engine process (a heartbeat is a batch too).
        ts: the engine's ``time.time()`` when the batch was sent (s).
        events: in the order they happened (empty for a heartbeat).
    """

    epoch: int
    seq: int
    ts: float
    events: list[KVEvent]


class KVSnapshot(msgspec.Struct, array_like=True):
    """Every block hash in an engine's prefix cache after batch ``seq`` (the answer of the
    snapshot endpoint to any request). ``epoch``: as in :class:`KVEventBatch`;
    ``block_size``: tokens per block of that engine; ``block_hashes``: those of the engine's
    KV cache (``"GPU"``); ``tier_block_hashes``: those of each KV cache tier by medium
    (``"CPU"``, ``"DISK"``; empty without tiers)."""

    epoch: int
    seq: int
    block_size: int
    block_hashes: list[int]
    tier_block_hashes: dict[str, list[int]] = {}


def default_snapshot_endpoint(endpoint: str) -> str:
    """``tcp://HOST:PORT`` -> ``tcp://HOST:PORT+1``.

    Raises:
        ValueError: ``endpoint`` is not ``tcp://HOST:PORT`` (give the snapshot endpoint then).
    """
    head, sep, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not sep or not port.isdigit():
        raise ValueError(f"cannot derive a snapshot endpoint from {endpoint!r}: give "
                         "--kv-events-snapshot-endpoint")
    return f"{head}:{int(port) + 1}"
