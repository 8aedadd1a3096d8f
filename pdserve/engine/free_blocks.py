"""The free-block queue of the paged KV cache: which free block an allocation takes next, i.e. the
prefix cache's eviction order (``--prefix-cache-eviction``).

Pure Python, no torch. :class:`~pdserve.engine.block_manager.KVCacheManager` pushes every block
whose reference count drops to zero (:meth:`FreeBlockQueue.push`), takes one back when a prefix
hit revives it (:meth:`FreeBlockQueue.discard`) and pops the next one to reuse for other tokens
(:meth:`FreeBlockQueue.pop`). A free block still registered in the prefix cache (*cached*) can be
hit until it is popped; a free block without a hash (*uncached*) is always popped first, since
nothing can ever hit it.

Two orders among cached blocks, by :class:`~pdserve.types.engine_config.EvictionPolicy`:

- ``LRU`` (vLLM's v1 ``FreeKVCacheBlockQueue``): least recently freed first. A request's blocks
  are pushed tail first, so a prompt's tail goes before its head, which more requests share.
- ``DEPTH_FIRST``: the deepest block first (its index in the block table that freed it; a
  block's index is the same in every table that holds it, as the chained hash fixes its
  position), ties by least recently freed, except that a block *cold* for a whole window is
  evicted before any other, least recently freed first. The clock counts pushed blocks, and the
  window is ``2 * num_blocks`` of them: a block not hit while requests released twice the cache's
  blocks is, in a steady state, one LRU would have evicted already. Under LRU a working set of
  conversations larger than the cache, revisited in turn, evicts each history just before it is
  needed again, so every later turn misses all of it (multi-turn chats through a proxy,
  round-robin agents).
  Depth first instead keeps the leading blocks of every live history and evicts their tails,
  so each later turn misses only its tail (``benchmarks/prefix_eviction.py`` measures both on
  such a loop and on a skewed workload; docs/benchmarks.md has the figures). SGLang's radix
  cache also evicts only the tips of cached prefixes, scored by its ``--radix-eviction-policy``
  (recency by default); here the score is depth first.
"""

from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict

from pdserve.types.engine_config import EvictionPolicy

__all__ = ["DepthFirstFreeBlocks", "EvictionPolicy", "FreeBlockQueue", "LRUFreeBlocks"]


class FreeBlockQueue(ABC):
    """The blocks with reference count zero, in the order allocations take them."""

    @abstractmethod
    def __len__(self) -> int:
        """Free blocks (cached and uncached)."""

    @abstractmethod
    def __contains__(self, block_id: int) -> bool:
        """Whether the block is free."""

    @abstractmethod
    def push(self, block_id: int, depth: int, cached: bool) -> None:
        """A block became free.

        Args:
            block_id: the block (not free now).
            depth: its index in the block table that freed it.
            cached: whether it is registered in the prefix cache (uncached blocks go first).
        """

    @abstractmethod
    def discard(self, block_id: int) -> None:
        """Take a free block out of the queue (a prefix hit holds it again).

        Raises:
            KeyError: the block is not free.
        """

    @abstractmethod
    def pop(self) -> int:
        """Remove and return the next block to reuse.

        Raises:
            IndexError: no block is free.
        """


class LRUFreeBlocks(FreeBlockQueue):
    """Least recently freed first; uncached blocks before all cached ones.

    Args:
        block_ids: the initially free blocks (uncached), in the order to use them.
    """

    def __init__(self, block_ids: range | list[int]):
        self._queue: OrderedDict[int, None] = OrderedDict((b, None) for b in block_ids)

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._queue

    def push(self, block_id: int, depth: int, cached: bool) -> None:
        self._queue[block_id] = None
        if not cached:
            self._queue.move_to_end(block_id, last=False)

    def discard(self, block_id: int) -> None:
        del self._queue[block_id]

    def pop(self) -> int:
        if not self._queue:
            raise IndexError("no free block")
        return self._queue.popitem(last=False)[0]


class DepthFirstFreeBlocks(FreeBlockQueue):
    """Uncached blocks first, then cached blocks cold for ``window`` pushes (least recently freed
    first), then the deepest cached block (ties: least recently freed).

    Args:
        block_ids: the initially free blocks (uncached), in the order to use them.
        window: pushes after which a cached block not hit counts as cold (>= 1); the engine
            uses ``2 * num_blocks`` (module docstring).

    Raises:
        ValueError: ``window < 1``.
    """

    def __init__(self, block_ids: range | list[int], window: int):
        if window < 1:
            raise ValueError(f"window must be at least 1, got {window}")
        self.window = window
        self._uncached: OrderedDict[int, None] = OrderedDict((b, None) for b in block_ids)
        self._cached: OrderedDict[int, int] = OrderedDict()  # block -> stamp, least recent first
        # (-depth, stamp, block); an entry is live while _cached maps its block to its stamp
        self._heap: list[tuple[int, int, int]] = []
        self._clock = 0

    def __len__(self) -> int:
        return len(self._uncached) + len(self._cached)

    def __contains__(self, block_id: int) -> bool:
        return block_id in self._cached or block_id in self._uncached

    def push(self, block_id: int, depth: int, cached: bool) -> None:
        self._clock += 1
        if not cached:
            self._uncached[block_id] = None
            self._uncached.move_to_end(block_id, last=False)
            return
        self._cached[block_id] = self._clock
        heapq.heappush(self._heap, (-depth, self._clock, block_id))
        if len(self._heap) > 2 * len(self._cached) + 64:
            self._compact()

    def discard(self, block_id: int) -> None:
        if block_id in self._uncached:
            del self._uncached[block_id]
        else:
            del self._cached[block_id]  # its heap entry goes stale

    def pop(self) -> int:
        if self._uncached:
            return self._uncached.popitem(last=False)[0]
        if not self._cached:
            raise IndexError("no free block")
        oldest, stamp = next(iter(self._cached.items()))
        if self._clock - stamp >= self.window:
            del self._cached[oldest]
            return oldest
        while True:
            _, stamp, block_id = heapq.heappop(self._heap)
            if self._cached.get(block_id) == stamp:
                del self._cached[block_id]
                return block_id

    def _compact(self) -> None:
        """Drop the stale heap entries (revived or popped blocks)."""
        self._heap = [e for e in self._heap if self._cached.get(e[2]) == e[1]]
        heapq.heapify(self._heap)
