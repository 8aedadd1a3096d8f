"""The free-block queue's two eviction orders: an oracle test against the orders' definitions,
and the multi-turn loop that depth first is for, through the real KVCacheManager."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.block_manager import KVCacheManager
from pdserve.engine.free_blocks import DepthFirstFreeBlocks, LRUFreeBlocks
from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args
from pdserve.types.engine_config import EvictionPolicy
from pdserve.types.request import Request
from pdserve.types.sampling_params import SamplingParams


class _Reference:
    """Both orders as their definitions say, by scanning every free block (slow, obvious)."""

    def __init__(self, n: int, depth_first: bool, window: int = 0):
        self.depth_first, self.window = depth_first, window
        self.uncached = list(range(n))  # front first
        self.cached: dict[int, tuple[int, int]] = {}  # block -> (depth, stamp)
        self.clock = 0

    def push(self, b: int, depth: int, cached: bool) -> None:
        self.clock += 1
        if cached:
            self.cached[b] = (depth, self.clock)
        else:
            self.uncached.insert(0, b)

    def discard(self, b: int) -> None:
        if b in self.uncached:
            self.uncached.remove(b)
        else:
            del self.cached[b]

    def pop(self) -> int:
        if self.uncached:
            return self.uncached.pop(0)
        oldest = min(self.cached, key=lambda b: self.cached[b][1])
        if self.depth_first and self.clock - self.cached[oldest][1] < self.window:
            victim = min(self.cached, key=lambda b: (-self.cached[b][0], self.cached[b][1]))
        else:
            victim = oldest
        del self.cached[victim]
        return victim


@pytest.mark.parametrize("depth_first", [False, True], ids=["lru", "depth-first"])
@pytest.mark.parametrize("seed", range(6))
def test_pops_follow_the_definition_of_each_order(depth_first, seed):
    rng = random.Random(seed)
    n = rng.randint(3, 40)
    window = rng.randint(1, 3 * n)
    queue = DepthFirstFreeBlocks(range(n), window) if depth_first else LRUFreeBlocks(range(n))
    ref = _Reference(n, depth_first, window)
    held: list[int] = []
    for _ in range(3000):
        op = rng.random()
        free = list(ref.uncached) + list(ref.cached)
        if op < 0.45 and free:
            b = queue.pop()
            assert b == ref.pop()
            held.append(b)
        elif op < 0.85 and held:
            b = held.pop(rng.randrange(len(held)))
            depth, cached = rng.randint(0, 6), rng.random() < 0.8
            queue.push(b, depth, cached)
            ref.push(b, depth, cached)
        elif free:
            b = rng.choice(free)
            queue.discard(b)
            ref.discard(b)
            held.append(b)
        assert len(queue) == len(ref.uncached) + len(ref.cached)
        assert all(b in queue for b in ref.cached) and not any(b in queue for b in held)
    with pytest.raises(KeyError):
        queue.discard(held[0]) if held else queue.discard(n + 1)


def test_an_empty_queue_and_a_bad_window_are_refused():
    for queue in (LRUFreeBlocks([]), DepthFirstFreeBlocks([], window=4)):
        with pytest.raises(IndexError):
            queue.pop()
    with pytest.raises(ValueError):
        DepthFirstFreeBlocks([], window=0)
    with pytest.raises(TypeError, match="EvictionPolicy"):
        KVCacheManager(4, 2, eviction="lru")


def _loop_hits(policy: EvictionPolicy, conversations: int = 6, turns: int = 5) -> list[int]:
    """Conversations revisited in turn, each turn its history plus 2 new blocks, through a cache
    that holds half of their final length: the blocks of each later turn found cached."""
    bs, first = 4, 6  # tokens per block, blocks of a first turn
    final = first + 2 * (turns - 1)
    kvm = KVCacheManager(num_blocks=conversations * final // 2, block_size=bs,
                         eviction=policy)
    hits = []
    for t in range(turns):
        for c in range(conversations):
            tokens = [c * 1000 + i for i in range((first + 2 * t) * bs)] + [7]
            r = Request(request_id=f"{c}-{t}", prompt_token_ids=tokens,
                        sampling_params=SamplingParams())
            blocks, n = kvm.get_computed_blocks(r)
            assert kvm.allocate_slots(r, r.num_tokens - n, blocks) is not None
            r.num_computed_tokens = r.num_tokens
            kvm.cache_blocks(r, r.num_tokens)
            kvm.free(r)
            kvm.check_consistency()
            if t:
                hits.append(n // bs)
    return hits


def test_depth_first_keeps_the_head_of_every_history_where_lru_loses_them_all():
    lru = _loop_hits(EvictionPolicy.LRU)
    deep = _loop_hits(EvictionPolicy.DEPTH_FIRST)
    # once the histories outgrow the cache, LRU evicts each just before its turn comes back
    assert lru[12:] == [0] * 12 and sum(lru) < 40
    # depth first keeps the leading 5-6 of every history's 6-12 blocks
    assert min(deep) >= 5 and sum(deep) > 4 * sum(lru)


def test_a_cold_head_goes_before_a_recent_deep_block():
    queue = DepthFirstFreeBlocks([], window=3)
    queue.push(0, depth=0, cached=True)
    queue.push(1, depth=5, cached=True)
    queue.push(2, depth=5, cached=True)
    assert queue.pop() == 1  # block 0 freed 2 pushes ago: not cold; the deepest, oldest first
    queue.push(3, depth=1, cached=True)
    assert queue.pop() == 0  # 3 pushes ago: cold, so before the deeper blocks
    queue.push(4, depth=9, cached=False)
    assert [queue.pop(), queue.pop(), queue.pop()] == [4, 2, 3]  # uncached first


def test_the_option_reaches_the_engine_config():
    parser = build_parser()
    config = engine_config_from_args(
        parser.parse_args(["--prefix-cache-eviction", "Depth-First"]), None)
    assert config.prefix_cache_eviction is EvictionPolicy.DEPTH_FIRST
    assert engine_config_from_args(parser.parse_args([]), None).prefix_cache_eviction is \
        EvictionPolicy.LRU
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefix-cache-eviction", "mru"])
