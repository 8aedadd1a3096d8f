"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, and automatic prefix caching.

Pure Python, no torch. The model runner owns the KV cache tensor; this module only decides which
physical block ids a request uses (its *block table*).

Prefix caching (the scheme of vLLM's v1 ``KVCacheManager``): every FULL block of a request's token
sequence gets a chained hash ``h_i = H(h_{i-1}, tokens of block i)``, so equal hashes mean equal
whole prefixes, not only equal blocks. Once a full block's KV has been computed, the block is
registered under its hash. A later request whose prompt starts with the same tokens reuses the
block (its reference count rises) instead of recomputing it.

Freed blocks are not wiped: a block whose reference count drops to zero goes to the free-block
queue but keeps its hash, so it can still be hit until it is reused for other tokens. Blocks
*without* a hash are reused first, since nothing can ever hit them; among cached ones the order is
the eviction policy's (:mod:`pdserve.engine.free_blocks`: LRU by default, a prompt's tail before
its head). ``num_free_blocks`` therefore counts evictable cached blocks as free.

Hash choice: the first 8 bytes of ``sha256(parent_hash as 8 little-endian bytes || token ids as
little-endian int64)``, as an unsigned int. It is stable across processes, machines and Python
versions (Python's ``hash()`` is not guaranteed to be), so the KV connector can compare the block
hashes of two engine instances to find the longest common prefix. The root parent hash is 0.
:func:`block_hashes` is the one implementation: the KV connector and the proxy's KV-aware routing
(``pdserve/router/kv_routing.py``) import it.

KV events (:meth:`KVCacheManager.enable_events`): every hash that enters or leaves the prefix cache
is recorded as a KV event (:class:`pdserve.engine.kv_events.KVEventBuffer`); the engine core takes
them once per step (:meth:`KVCacheManager.take_events`) and publishes them.
"""

from __future__ import annotations

from itertools import chain
from typing import TYPE_CHECKING, Callable, Sequence

from pdserve.engine.free_blocks import (
    DepthFirstFreeBlocks, EvictionPolicy, FreeBlockQueue, LRUFreeBlocks,
)
from pdserve.engine.kv_events import KVEventBuffer
from pdserve.types.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pdserve.types.block_hash import ROOT_HASH, block_hashes

if TYPE_CHECKING:
    from pdserve.types.request import Request

class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation needs more blocks than are free (a bookkeeping bug upstream:
    callers check with :meth:`KVCacheManager.can_allocate` first)."""


class KVCacheManager:
    """Allocates KV cache blocks to requests, with reference counts and prefix caching.

    Args:
        num_blocks: physical blocks in the KV cache.
        block_size: tokens per block.
        enable_prefix_caching: register computed full blocks by chained hash and reuse them.
        on_evict: called as ``on_evict(block_id, block_hash)`` when a cached block is taken for
            other tokens, before anything overwrites it (the KV cache tiers keep its KV,
            :meth:`pdserve.engine.kv_tiers.TierManager.on_evict`); None: evicted KV is lost.
        eviction: which free cached block is reused first (:mod:`pdserve.engine.free_blocks`).

    Attributes:
        num_blocks: physical blocks.
        block_size: tokens per block.
        enable_prefix_caching: as given.
        eviction: as given.
        ref_counts: per block id, how many requests hold it.

    Raises:
        ValueError: ``num_blocks`` or ``block_size`` below 1.
        TypeError: ``eviction`` not an :class:`EvictionPolicy` (a config built by hand with the
            option's text instead of its member).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 on_evict: Callable[[int, int], None] | None = None,
                 eviction: EvictionPolicy = EvictionPolicy.LRU):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if not isinstance(eviction, EvictionPolicy):
            raise TypeError(f"eviction must be an EvictionPolicy, got {eviction!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._on_evict = on_evict
        self.eviction = eviction
        self.ref_counts: list[int] = [0] * num_blocks
        # Hash under which each block is registered in the prefix cache (None: not cached).
        self._block_hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # block hash -> block id
        # Blocks with ref count 0, in the order allocations take them.
        self._free: FreeBlockQueue = (
            DepthFirstFreeBlocks(range(num_blocks), window=2 * num_blocks)
            if eviction is EvictionPolicy.DEPTH_FIRST else LRUFreeBlocks(range(num_blocks)))
        self._req_blocks: dict[str, list[int]] = {}
        # Per request: the chained hashes computed so far and how many blocks are registered.
        self._req_hashes: dict[str, list[int]] = {}
        self._req_num_cached: dict[str, int] = {}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # tokens found
        self._events = KVEventBuffer()
        # Async scheduling: requests of the launched step(s) the device may still be
        # running, and the block lists of such requests freed meanwhile (held until released).
        self._in_flight: frozenset[str] = frozenset()
        self._deferred: list[tuple[str, list[int]]] = []

    # ---------------------------------------------------------------- KV events
    def enable_events(self) -> None:
        """Start recording prefix-cache changes as KV events (see :meth:`take_events`)."""
        self._events.enable()

    def take_events(self) -> list[KVEvent]:
        """The events recorded since the last call, in order (empty when events are off)."""
        return self._events.take()

    def cached_block_hashes(self) -> list[int]:
        """Every hash registered in the prefix cache now (a KV events snapshot)."""
        return list(self._cached)

    def _removed(self, h: int) -> None:
        self._events.add_hash(BlockRemoved, h)

    # ---------------------------------------------------------------- accounting
    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation can take now (unused blocks plus evictable cached blocks)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, 0..1."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (held or evictable)."""
        return len(self._cached)

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the live list; do not mutate)."""
        return self._req_blocks.get(request_id, [])

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of ``token_ids`` with this manager's block size."""
        return block_hashes(token_ids, self.block_size)

    def request_block_hashes(self, request: "Request", num_tokens: int) -> list[int]:
        """Chained hashes of the request's first ``num_tokens // block_size`` blocks (memoised
        until the request is freed; the returned list may be longer: do not mutate it)."""
        return self._request_hashes(request, num_tokens)[: num_tokens // self.block_size]

    def _request_hashes(self, request: "Request", num_tokens: int) -> list[int]:
        """Hashes of the first ``num_tokens // block_size`` blocks of the request (memoised)."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        num_full = num_tokens // self.block_size
        if len(hashes) < num_full:
            bs = self.block_size
            hashes.extend(block_hashes(request.token_ids(len(hashes) * bs, num_full * bs), bs,
                                       hashes[-1] if hashes else ROOT_HASH))
        return hashes

    # ---------------------------------------------------------------- prefix cache
    def get_computed_blocks(self, request: "Request") -> tuple[list[int], int]:
        """Longest prefix of the request's tokens whose KV is in the prefix cache.

        Never returns all the request's tokens: at least the last one must be computed so that
        the model produces logits for it.

        Args:
            request: a request that holds no blocks yet (new or preempted).

        Returns:
            ``(block_ids, num_tokens)``: the cached blocks in order and the tokens they cover
            (``len(block_ids) * block_size``). The blocks are not yet held: pass them to
            :meth:`allocate_slots` in the same scheduling step.
        """
        if not self.enable_prefix_caching:
            return [], 0
        blocks = self.cached_prefix(self._request_hashes(request, request.num_tokens - 1))
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def cached_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks registered under the leading ``hashes`` (stops at the first one not in the
        prefix cache). Not held: pass them to :meth:`allocate_slots` in the same step."""
        blocks: list[int] = []
        for h in hashes if self.enable_prefix_caching else ():
            block_id = self._cached.get(h)
            if block_id is None:
                break
            blocks.append(block_id)
        return blocks

    def cache_blocks(self, request: "Request", num_computed_tokens: int) -> None:
        """Register the request's full blocks whose KV is computed in the prefix cache.

        Call after the tokens' KV is really in the cache (after the forward pass or a completed
        KV load), so that no other request can hit a block before its KV exists.

        Args:
            request: the request.
            num_computed_tokens: tokens of the request whose KV is valid.
        """
        if not self.enable_prefix_caching:
            return
        request_id = request.request_id
        done = self._req_num_cached.get(request_id, 0)
        if num_computed_tokens // self.block_size <= done:
            return  # no block filled since the last call (most decode steps)
        blocks = self._req_blocks.get(request_id)
        if not blocks:
            return
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        if num_full <= done:
            return
        hashes = self._request_hashes(request, num_full * self.block_size)
        stored: list[int] = []
        for i in range(done, num_full):
            block_id = blocks[i]
            h = hashes[i]
            if self._block_hash[block_id] is not None:
                continue  # a prefix hit: already registered
            if h in self._cached:
                continue  # another block holds the same tokens; keep that one
            self._block_hash[block_id] = h
            self._cached[h] = block_id
            stored.append(h)
        self._req_num_cached[request_id] = num_full
        if stored and self._events.enabled:
            self._events.append(BlockStored(stored))

    def uncache_blocks(self, request: "Request", first_block_index: int) -> None:
        """Drop blocks ``first_block_index ..`` of the request from the prefix cache (their KV is
        invalid, e.g. a failed transfer) and forget the request's registration from there on."""
        request_id = request.request_id
        blocks = self._req_blocks.get(request_id, [])
        for block_id in blocks[first_block_index:]:
            h = self._block_hash[block_id]
            if h is not None and self._cached.get(h) == block_id:
                del self._cached[h]
                self._removed(h)
            self._block_hash[block_id] = None
        if self._req_num_cached.get(request_id, 0) > first_block_index:
            self._req_num_cached[request_id] = first_block_index

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only possible when no request holds blocks.

        Returns:
            True when the cache was reset.
        """
        if len(self._free) != self.num_blocks:
            return False
        self._cached.clear()
        self._block_hash = [None] * self.num_blocks
        self._events.append(AllBlocksCleared())
        return True

    # ---------------------------------------------------------------- allocation
    def num_blocks_needed(
        self, request: "Request", num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> int:
        """Free blocks an :meth:`allocate_slots` call with these arguments would consume
        (new blocks, plus prefix-hit blocks currently sitting evictable in the free queue)."""
        held = len(self._req_blocks.get(request.request_id, ()))
        total_tokens = (
            request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_new_tokens
        )
        required = -(-total_tokens // self.block_size)
        new = max(0, required - held - len(new_computed_blocks))
        revived = sum(1 for b in new_computed_blocks if self.ref_counts[b] == 0)
        return new + revived

    def allocate_slots(
        self, request: "Request", num_new_tokens: int, new_computed_blocks: Sequence[int] = ()
    ) -> list[int] | None:
        """Give the request enough blocks for ``num_new_tokens`` more tokens.

        The request's token positions after this call run up to ``request.num_computed_tokens
        + len(new_computed_blocks) * block_size + num_new_tokens - 1``.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have blocks.
            num_new_tokens: tokens to make room for (to compute, or to load from elsewhere).
            new_computed_blocks: prefix-cache hit from :meth:`get_computed_blocks`, appended
                first (only for a request that holds no blocks yet).

        Returns:
            The request's whole block table, or None (nothing changed) when not enough blocks
            are free.
        """
        request_id = request.request_id
        if not new_computed_blocks:  # fast path: a decode step that fits in the held blocks
            held = self._req_blocks.get(request_id)
            if held and request.num_computed_tokens + num_new_tokens <= len(held) * self.block_size:
                return held
        if new_computed_blocks and self._req_blocks.get(request_id):
            raise ValueError(f"request {request_id} already holds blocks; prefix hits apply to new requests")
        if self.num_blocks_needed(request, num_new_tokens, new_computed_blocks) > len(self._free):
            return None
        blocks = self._req_blocks.setdefault(request_id, [])
        for block_id in new_computed_blocks:
            if self.ref_counts[block_id] == 0:
                self._free.discard(block_id)
            self.ref_counts[block_id] += 1
            blocks.append(block_id)
        if new_computed_blocks:
            self._req_num_cached[request_id] = len(new_computed_blocks)
        total_tokens = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens += num_new_tokens
        required = -(-total_tokens // self.block_size)
        for _ in range(required - len(blocks)):
            blocks.append(self._take_free_block())
        request.block_ids = blocks
        return blocks

    def _take_free_block(self) -> int:
        if not self._free:
            raise NoFreeBlocksError("no free KV cache block")
        block_id = self._free.pop()
        h = self._block_hash[block_id]
        if h is not None:  # evict from the prefix cache
            if self._cached.get(h) == block_id:
                del self._cached[h]
                self._removed(h)
                if self._on_evict is not None:
                    self._on_evict(block_id, h)
            self._block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    def free(self, request: "Request") -> None:
        """Release the request's blocks (reference counts drop; blocks at zero become free but
        stay hittable while cached). Idempotent."""
        request_id = request.request_id
        blocks = self._req_blocks.pop(request_id, None)
        self._req_hashes.pop(request_id, None)
        self._req_num_cached.pop(request_id, None)
        request.block_ids = []
        if not blocks:
            return
        if request_id in self._in_flight:
            self._deferred.append((request_id, blocks))
            return
        self._release(blocks)

    def set_in_flight(self, request_ids: "set[str] | frozenset[str]") -> None:
        """Async scheduling: name the requests of the steps launched but not yet known to
        be complete on the device. :meth:`free` of such a request holds its blocks (they stay
        referenced, neither free nor reusable) until a later call no longer names it, since the
        device may still write that step's KV into them (an extra token of a request that
        finished one step earlier, or one aborted meanwhile). A KV load from another instance
        into a reused block would otherwise race with that write."""
        self._in_flight = frozenset(request_ids)
        if not self._deferred:
            return
        held = []
        for request_id, blocks in self._deferred:
            if request_id in self._in_flight:
                held.append((request_id, blocks))
            else:
                self._release(blocks)
        self._deferred = held

    @property
    def num_deferred_blocks(self) -> int:
        """Blocks of freed requests still held for a launched step (see :meth:`set_in_flight`)."""
        return sum(len(blocks) for _, blocks in self._deferred)

    def _release(self, blocks: list[int]) -> None:
        for depth in range(len(blocks) - 1, -1, -1):  # tail first
            block_id = blocks[depth]
            rc = self.ref_counts[block_id] - 1
            if rc < 0:
                raise AssertionError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = rc
            if rc == 0:
                self._free.push(block_id, depth, self._block_hash[block_id] is not None)

    def check_consistency(self) -> None:
        """Assert the internal invariants (tests).

        Raises:
            AssertionError: when reference counts, the free queue and the hash map disagree.
        """
        held: dict[int, int] = {}
        for blocks in chain(self._req_blocks.values(), (b for _, b in self._deferred)):
            for b in blocks:
                held[b] = held.get(b, 0) + 1
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == held.get(b, 0), f"block {b}: ref count mismatch"
            assert (self.ref_counts[b] == 0) == (b in self._free), f"block {b}: free queue mismatch"
        for h, b in self._cached.items():
            assert self._block_hash[b] == h, f"block {b}: hash map mismatch"
