"""Which heads, rows and vocabulary entries a TP rank owns, and the start-up check that names
the numbers that do not divide."""

from __future__ import annotations

import pytest

from pdserve.distributed.sharding import (
    TPShardingError,
    check_tp_divisible,
    kv_head_range,
    shard_range,
)


def test_shard_range():
    assert [shard_range(12, 3, r) for r in range(3)] == [(0, 4), (4, 4), (8, 4)]
    with pytest.raises(TPShardingError, match="10 is not divisible by the TP size 3"):
        shard_range(10, 3, 0)


def test_kv_heads_split_or_replicated():
    assert [kv_head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    # fewer KV heads than ranks: rank r holds head r*H//T, each head on T/H ranks
    assert [kv_head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_head_range(3, 6, r)[0] for r in range(6)] == [0, 0, 1, 1, 2, 2]
    with pytest.raises(TPShardingError):
        kv_head_range(3, 2, 0)
    with pytest.raises(TPShardingError):
        kv_head_range(2, 3, 0)


def test_check_names_every_number():
    check_tp_divisible(1, num_heads=9, num_kv_heads=3, vocab_size=7, intermediate_size=5)
    check_tp_divisible(3, num_heads=9, num_kv_heads=3, vocab_size=49152, intermediate_size=1536)
    with pytest.raises(TPShardingError) as e:
        check_tp_divisible(2, num_heads=9, num_kv_heads=3, vocab_size=49153,
                           intermediate_size=1537)
    msg = str(e.value)
    for part in ("tensor_parallel_size 2", "9 attention heads", "3 KV heads",
                 "vocabulary of 49153 tokens", "intermediate_size 1537"):
        assert part in msg
