"""KVCacheManager: reference counts, chained-hash prefix caching, eviction, free accounting (each
test on the ``kvm`` fixture runs under both eviction policies)."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from pdserve.engine.block_manager import KVCacheManager
from pdserve.types.engine_config import EvictionPolicy
from pdserve.types.block_hash import block_hashes, hash_block
from pdserve.types.request import Request
from pdserve.types.sampling_params import SamplingParams

BS = 4


def req(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens), sampling_params=SamplingParams())


def compute_all(kvm: KVCacheManager, r: Request) -> list[int]:
    """Allocate the request's whole sequence (with its prefix hit) and register it as computed."""
    blocks, n = kvm.get_computed_blocks(r)
    r.num_computed_tokens = 0
    table = kvm.allocate_slots(r, r.num_tokens - n, blocks)
    assert table is not None
    r.num_computed_tokens = r.num_tokens
    kvm.cache_blocks(r, r.num_tokens)
    return table


@pytest.fixture(params=list(EvictionPolicy), ids=lambda p: p.value)
def kvm(request):
    m = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True,
                       eviction=request.param)
    yield m
    m.check_consistency()


def test_block_hashes_are_chained_and_cover_full_blocks_only():
    a = list(range(10))
    h = block_hashes(a, BS)
    assert len(h) == 2  # 10 tokens: two full blocks, partial tail has no hash
    assert h == block_hashes(a[:8], BS) == block_hashes(a + [99], BS)[:2]
    # Same second block after a different first block: different hash (whole prefix counts).
    b = [7, 7, 7, 7] + a[4:8]
    assert block_hashes(b, BS)[1] != h[1]
    assert h[1] == hash_block(h[0], a[4:8])


def test_block_hashes_equal_chained_hash_block_over_long_prompts():
    # block_hashes packs all tokens at once; every hash must still be hash_block's chain.
    rng = random.Random(5)
    tokens = [rng.randrange(0, 2**40) for _ in range(16 * 300 + 7)]
    for parent in (0, 2**64 - 1, 12345):
        expected, h = [], parent
        for start in range(0, len(tokens) - 15, 16):
            h = hash_block(h, tokens[start:start + 16])
            expected.append(h)
        assert block_hashes(tokens, 16, parent) == expected
    assert block_hashes(tokens[:15], 16) == []


@pytest.mark.slow
def test_block_hashes_are_stable_across_processes():
    code = "from pdserve.engine.block_manager import block_hashes; print(block_hashes(list(range(12)), 4))"
    outs = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                check=True, timeout=60).stdout)
    assert outs == {str(block_hashes(list(range(12)), 4)) + "\n"}


def test_allocate_grow_and_free_restore_all_blocks(kvm):
    r = req("a", list(range(6)))
    table = kvm.allocate_slots(r, 6)
    assert len(table) == 2 and r.block_ids is table
    assert kvm.num_free_blocks == 6
    r.num_computed_tokens = 6
    r.output_token_ids += [1, 2, 3]  # grows into a third block only when needed
    assert kvm.allocate_slots(r, 2) == table and len(table) == 2
    assert kvm.allocate_slots(r, 3) == table and len(table) == 3
    assert kvm.usage == pytest.approx(3 / 8)
    kvm.free(r)
    assert kvm.num_free_blocks == 8 and r.block_ids == []
    kvm.free(r)  # idempotent
    assert kvm.num_free_blocks == 8


def test_allocation_failure_changes_nothing(kvm):
    r = req("a", list(range(40)))
    assert kvm.allocate_slots(r, 40) is None  # needs 10 blocks, 8 exist
    assert kvm.num_free_blocks == 8 and kvm.get_block_ids("a") == []


def test_prefix_hit_shares_blocks_and_counts_references(kvm):
    a = req("a", list(range(10)))
    ta = compute_all(kvm, a)
    b = req("b", list(range(8)) + [50, 51, 52])
    blocks, n = kvm.get_computed_blocks(b)
    assert blocks == ta[:2] and n == 8
    tb = kvm.allocate_slots(b, b.num_tokens - n, blocks)
    assert tb[:2] == ta[:2] and tb[2] not in ta
    assert kvm.ref_counts[ta[0]] == 2 and kvm.ref_counts[ta[2]] == 1
    kvm.free(a)
    assert kvm.ref_counts[ta[0]] == 1
    kvm.free(b)
    assert kvm.num_free_blocks == 8


def test_hit_never_covers_the_whole_prompt(kvm):
    a = req("a", list(range(8)))  # exactly two blocks
    compute_all(kvm, a)
    kvm.free(a)
    again = req("b", list(range(8)))
    blocks, n = kvm.get_computed_blocks(again)
    assert n == 4 and len(blocks) == 1  # the last token (in block 2) must be computed


def test_different_first_block_gets_no_hit(kvm):
    a = req("a", list(range(12)))
    compute_all(kvm, a)
    b = req("b", [99] + list(range(1, 12)))
    assert kvm.get_computed_blocks(b) == ([], 0)
    kvm.free(a)


def test_blocks_are_registered_only_once_computed(kvm):
    a = req("a", list(range(12)))
    kvm.allocate_slots(a, 12)  # allocated, nothing computed yet
    assert kvm.get_computed_blocks(req("b", list(range(12)))) == ([], 0)
    a.num_computed_tokens = 5
    kvm.cache_blocks(a, 5)  # only block 0 is full and computed
    assert kvm.get_computed_blocks(req("c", list(range(12))))[1] == 4
    kvm.free(a)


def test_freed_cached_blocks_count_as_free_and_are_evicted_lru(kvm):
    a = req("a", list(range(9)))  # blocks: [0..3] [4..7] [8]
    ta = compute_all(kvm, a)
    kvm.free(a)
    assert kvm.num_free_blocks == 8 and kvm.num_cached_blocks == 2
    # Uncached block (the partial tail) is reused first; then the cached tail before the head.
    x = req("x", [500] * 4)
    tx = kvm.allocate_slots(x, 4)
    assert tx == [ta[2]]
    assert kvm.num_cached_blocks == 2
    y = req("y", [600] * 4)
    # The five never-used blocks sit ahead of the cached ones in the free queue.
    fill = kvm.allocate_slots(y, 4 * 5)
    assert not set(fill) & set(ta[:2])
    assert kvm.num_cached_blocks == 2
    z = req("z", [700] * 4)
    tz = kvm.allocate_slots(z, 4)
    assert tz == [ta[1]]  # the tail of a's prefix is evicted before its head
    assert kvm.num_cached_blocks == 1
    b = req("b", list(range(9)))
    assert kvm.get_computed_blocks(b) == ([ta[0]], 4)
    for r in (x, y, z):
        kvm.free(r)
    assert kvm.num_free_blocks == 8


def test_hit_on_evictable_block_takes_it_out_of_the_free_queue(kvm):
    a = req("a", list(range(9)))
    ta = compute_all(kvm, a)
    kvm.free(a)
    b = req("b", list(range(9)))
    blocks, n = kvm.get_computed_blocks(b)
    assert kvm.num_blocks_needed(b, b.num_tokens - n, blocks) == 3  # 2 revived + 1 new
    kvm.allocate_slots(b, b.num_tokens - n, blocks)
    assert kvm.num_free_blocks == 5
    assert kvm.ref_counts[ta[0]] == 1
    kvm.free(b)
    assert kvm.num_free_blocks == 8


def test_duplicate_content_keeps_the_first_registration(kvm):
    a, b = req("a", list(range(5))), req("b", list(range(5)))
    ta = kvm.allocate_slots(a, 5)
    tb = kvm.allocate_slots(b, 5)  # computed concurrently: neither hit the other
    for r in (a, b):
        r.num_computed_tokens = 5
        kvm.cache_blocks(r, 5)
    assert kvm.get_computed_blocks(req("c", list(range(5))))[0] == [ta[0]]
    kvm.free(a)
    kvm.free(b)
    assert kvm.num_cached_blocks == 1 and tb[0] != ta[0]


def test_uncache_blocks_removes_invalid_kv_from_the_cache(kvm):
    a = req("a", list(range(13)))
    compute_all(kvm, a)
    kvm.uncache_blocks(a, 1)
    assert kvm.get_computed_blocks(req("b", list(range(13))))[1] == 4
    kvm.free(a)


def test_prefix_caching_off_never_hits():
    kvm = KVCacheManager(8, BS, enable_prefix_caching=False)
    a = req("a", list(range(12)))
    compute_all(kvm, a)
    kvm.free(a)
    assert kvm.get_computed_blocks(req("b", list(range(12)))) == ([], 0)
    assert kvm.num_cached_blocks == 0 and kvm.num_free_blocks == 8


def test_reset_prefix_cache_only_when_idle(kvm):
    a = req("a", list(range(9)))
    compute_all(kvm, a)
    assert not kvm.reset_prefix_cache()
    kvm.free(a)
    assert kvm.reset_prefix_cache() and kvm.num_cached_blocks == 0
