"""Transfer planning across TP sizes (pdserve/kv_transfer/nixl/tp_plan.py), checked on every
valid pairing of small head counts and TP sizes by applying the planned regions to flat arrays."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pdserve.types.kv_cache_kind import KVCacheKind

from pdserve.kv_transfer.nixl.tp_plan import (
    HeadRange,
    HeadRead,
    RankCache,
    TPLayoutError,
    descriptors_per_request,
    expected_notices,
    heads_per_rank,
    is_whole,
    layout_error,
    notice_targets,
    pairing_error,
    plan_reads,
    rank_heads,
    read_regions,
)

HEADS = (1, 2, 3, 4, 6, 8)
SIZES = (1, 2, 3, 4, 6, 8)
L, B, D = 2, 2, 3  # layers, block size, head dim (elements: head_bytes = B * D "bytes")
PAIRINGS = [(h, tp, td) for h, tp, td in itertools.product(HEADS, SIZES, SIZES)
            if layout_error(h, tp) is None and layout_error(h, td) is None]


def full_cache(num_blocks: int, heads: int) -> np.ndarray:
    """A TP-1 cache whose every element is its own flat index + 1 (never 0)."""
    return np.arange(num_blocks * L * 2 * heads * B * D, dtype=np.int64).reshape(
        num_blocks, L, 2, heads, B, D) + 1


def shard(cache: np.ndarray, total: int, tp: int, rank: int) -> np.ndarray:
    hr = rank_heads(total, tp, rank)
    return np.ascontiguousarray(cache[:, :, :, hr.start:hr.start + hr.count])


def test_ownership_rule():
    assert [rank_heads(8, 4, r) for r in range(4)] == [HeadRange(2 * r, 2) for r in range(4)]
    assert [rank_heads(2, 4, r).start for r in range(4)] == [0, 0, 1, 1]
    assert heads_per_rank(2, 8) == 1 and heads_per_rank(8, 2) == 4
    for bad in ((6, 4), (4, 3), (3, 2), (0, 1)):
        with pytest.raises(TPLayoutError):
            rank_heads(bad[0], bad[1], 0)
    with pytest.raises(TPLayoutError):
        rank_heads(4, 2, 2)


@pytest.mark.parametrize("h,tp,td", PAIRINGS)
def test_each_reader_head_read_once_from_an_owner_that_holds_it(h, tp, td):
    for j in range(td):
        mine = rank_heads(h, td, j)
        seen = []
        for r in plan_reads(h, tp, td, j):
            src = rank_heads(h, tp, r.src_rank)
            assert 0 <= r.src_head and r.src_head + r.count <= src.count
            for k in range(r.count):
                assert src.start + r.src_head + k == mine.start + r.dst_head + k
                seen.append(r.dst_head + k)
        assert sorted(seen) == list(range(mine.count)) and len(set(seen)) == len(seen)


@pytest.mark.parametrize("h,tp,td", PAIRINGS)
def test_regions_move_exactly_the_readers_head_slice(h, tp, td):
    # runs consecutive on both sides: (7, 8 <- 4, 5) and (3, 4 <- 0, 1); 2 <- 9 alone
    src_blocks = [4, 5, 9, 0, 1]
    dst_blocks = [7, 8, 2, 3, 4]
    full = full_cache(10, h)
    src_caches = [shard(full, h, tp, p).reshape(-1) for p in range(tp)]
    for j in range(td):
        dst = np.zeros_like(shard(full, h, td, j)).reshape(-1)
        dst_geo = RankCache(L, heads_per_rank(h, td), B * D)
        for r in plan_reads(h, tp, td, j):
            src_geo = RankCache(L, heads_per_rank(h, tp), B * D)
            regions = read_regions(r, src_geo, dst_geo, dst_blocks, src_blocks)
            for d_off, s_off, n in regions:
                assert not dst[d_off:d_off + n].any(), "a region is written twice"
                dst[d_off:d_off + n] = src_caches[r.src_rank][s_off:s_off + n]
            # merged as far as the layout allows
            if is_whole(r, src_geo.heads, dst_geo.heads):
                assert len(regions) == 3
            else:
                assert len(regions) == 5 * L * 2
        dst = dst.reshape(10, L, 2, heads_per_rank(h, td), B, D)
        want = shard(full, h, td, j)
        for db, sb in zip(dst_blocks, src_blocks):
            np.testing.assert_array_equal(dst[db], want[sb])
        untouched = [b for b in range(10) if b not in dst_blocks]
        assert not dst[untouched].any()


@pytest.mark.parametrize("t", SIZES)
def test_equal_tp_reads_rank_r_from_rank_r_in_whole_blocks(t):
    for h in HEADS:
        if layout_error(h, t) is not None:
            continue
        for r in range(t):
            (read,) = plan_reads(h, t, t, r)
            assert read == HeadRead(r, 0, 0, heads_per_rank(h, t))


def test_replicated_owner_heads_are_spread_and_read_once():
    # 2 KV heads on 4 owner ranks (each head twice): a TP-1 reader reads head 0 from rank 0 and
    # head 1 from rank 2, never both replicas
    assert plan_reads(2, 4, 1, 0) == [HeadRead(0, 0, 0, 1), HeadRead(2, 0, 1, 1)]
    assert [plan_reads(2, 4, 2, j) for j in range(2)] == [[HeadRead(0, 0, 0, 1)],
                                                          [HeadRead(3, 0, 0, 1)]]
    # a TP-4 reader of a TP-1 owner: ranks 0, 1 read head 0, ranks 2, 3 head 1
    assert [plan_reads(2, 1, 4, j) for j in range(4)] == [
        [HeadRead(0, 0, 0, 1)], [HeadRead(0, 0, 0, 1)], [HeadRead(0, 1, 0, 1)],
        [HeadRead(0, 1, 0, 1)]]


@pytest.mark.parametrize("h,tp,td", PAIRINGS)
def test_every_owner_rank_is_notified_and_rank_0_by_every_reader(h, tp, td):
    read = {r.src_rank for j in range(td) for r in plan_reads(h, tp, td, j)}
    for p in range(tp):
        n = expected_notices(h, tp, td, p)
        assert n >= 1
        readers = {j for j in range(td) if any(r.src_rank == p for r in plan_reads(h, tp, td, j))}
        if p == 0:
            assert n == td
        elif p in read:
            assert n == len(readers)
        else:
            assert n == 1
    for j in range(td):
        assert 0 in notice_targets(h, tp, td, j)


def test_descriptor_counts():
    # equal TP: one descriptor per rank for a contiguous run, one per block otherwise
    assert descriptors_per_request(8, 2, 2, num_layers=32, num_blocks=10) == 2
    assert descriptors_per_request(8, 2, 2, 32, 10, contiguous=False) == 20
    # TP 1 -> TP 2 and TP 2 -> TP 1: a head slice, one region per block x layer x K/V per read
    assert descriptors_per_request(8, 1, 2, 32, 10) == 2 * 10 * 32 * 2
    assert descriptors_per_request(8, 2, 1, 32, 10) == 2 * 10 * 32 * 2
    # 2 heads on TP 4 -> TP 2: one head per rank on both sides, whole blocks again
    assert descriptors_per_request(2, 4, 2, 32, 10) == 2


def test_pairing_error_names_the_reason():
    assert pairing_error(8, 2, 8, 4) is None
    assert "different numbers of KV heads" in pairing_error(8, 2, 4, 2)
    assert "6 KV heads cannot be split over 4 ranks" in pairing_error(6, 2, 6, 4)


def test_read_regions_rejects_mismatched_inputs():
    r = HeadRead(0, 0, 0, 1)
    with pytest.raises(ValueError):
        read_regions(r, RankCache(2, 1, 8), RankCache(2, 1, 8), [1, 2], [1])
    with pytest.raises(ValueError):
        read_regions(r, RankCache(2, 1, 8), RankCache(3, 1, 8), [1], [1])
    assert read_regions(r, RankCache(2, 1, 8), RankCache(2, 1, 8), [], []).shape == (0, 3)


LATENT = KVCacheKind.MLA_LATENT


@pytest.mark.parametrize("tp,td", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (3, 2)])
def test_a_latent_is_read_once_whole_from_one_owner_rank(tp, td):
    """A latent cache (one replicated entry per token) is read by every reader rank once, whole
    blocks, from owner rank ``j % tp``: per reader rank as many descriptors as one rank's read at
    TP 1 -> TP 1, and every owner rank is still told about the request."""
    one_rank = descriptors_per_request(1, 1, 1, 32, 10, kind=LATENT)
    assert one_rank == 1
    assert descriptors_per_request(1, 1, 1, 32, 10, contiguous=False, kind=LATENT) == 10
    for j in range(td):
        assert plan_reads(1, tp, td, j, LATENT) == [HeadRead(j % tp, 0, 0, 1)]
        assert is_whole(plan_reads(1, tp, td, j, LATENT)[0], 1, 1)
        assert descriptors_per_request(1, tp, td, 32, 10, kind=LATENT, dst_rank=j) == one_rank
        assert 0 in notice_targets(1, tp, td, j, LATENT)
    assert descriptors_per_request(1, tp, td, 32, 10, kind=LATENT) == td * one_rank
    for p in range(tp):
        assert expected_notices(1, tp, td, p, LATENT) >= 1
    # the owner's own heads field must say one head: a latent declared with the model's
    # attention heads would otherwise be planned as head slices
    with pytest.raises(TPLayoutError, match="one latent entry per token"):
        plan_reads(4, tp, td, 0, LATENT)
    assert "one latent entry per token" in pairing_error(4, tp, 4, td, LATENT)
    assert pairing_error(1, tp, 1, td, LATENT) is None
    with pytest.raises(TPLayoutError):
        plan_reads(1, tp, td, td, LATENT)
