"""Which part of a model a tensor-parallel rank owns (torch-free), and the start-up check that
a model divides over a TP size.

Megatron-LM's split (Shoeybi et al., 2019, "Megatron-LM"): attention by heads, the MLP's
intermediate dimension, the vocabulary by contiguous ranges. KV heads follow the ownership rule
shared with the KV connector (docs/architecture.md, "Tensor parallelism"): with ``H`` KV heads
and ``T`` ranks, rank ``r`` holds heads ``[r*H/T, (r+1)*H/T)`` when ``H >= T``, else the one
head ``r*H//T`` (each head replicated ``T/H`` times).
"""

from __future__ import annotations

# The start-up rule lives in a torch-free module (this package's __init__ imports torch), so the
# command lines can check it before any engine process starts.
from pdserve.model_files.tp_precheck import TPShardingError, check_tp_divisible

__all__ = ["TPShardingError", "check_tp_divisible", "kv_head_range", "shard_range"]


def shard_range(total: int, size: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of rank ``rank``'s equal, contiguous share of ``total`` items.

    Raises:
        TPShardingError: ``total`` is not divisible by ``size``.
    """
    if total % size:
        raise TPShardingError(f"{total} is not divisible by the TP size {size}")
    n = total // size
    return rank * n, n


def kv_head_range(num_kv_heads: int, size: int, rank: int) -> tuple[int, int]:
    """``(first_head, num_heads)`` of the KV heads rank ``rank`` holds (the ownership rule in
    the module docstring).

    Raises:
        TPShardingError: neither ``num_kv_heads % size == 0`` nor ``size % num_kv_heads == 0``.
    """
    if num_kv_heads >= size:
        if num_kv_heads % size:
            raise TPShardingError(f"{num_kv_heads} KV heads do not divide over TP size {size}")
        n = num_kv_heads // size
        return rank * n, n
    if size % num_kv_heads:
        raise TPShardingError(f"TP size {size} is not a multiple of the {num_kv_heads} KV heads")
    return rank * num_kv_heads // size, 1
