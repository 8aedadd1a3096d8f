"""Collectives over the tensor-parallel group; each returns its input unchanged at TP 1.

Every rank of the group must call the same collectives in the same order with tensors of the
same shape (the model's forward pass does, since all ranks run the same step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pdserve.distributed.parallel_state import (
    get_tp_cpu_group,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
)


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the TP ranks, in place (row-parallel outputs, vocab-parallel embeddings).

    Args:
        x: any shape; every rank passes the same shape and dtype.

    Returns:
        ``x`` itself, holding the sum of every rank's ``x``.
    """
    if get_tp_size() == 1:
        return x
    dist.all_reduce(x, group=get_tp_group())
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``, by rank (vocab-parallel logits).

    Args:
        x: ``[..., n, ...]`` with ``n`` the size of ``dim``; the same shape on every rank.

    Returns:
        ``[..., size * n, ...]`` (``x`` itself at TP 1).
    """
    size = get_tp_size()
    if size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)


def tp_gather(x: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
    """Concatenate every rank's ``x`` along ``dim`` on rank ``dst`` only.

    Returns:
        the concatenation on ``dst`` (``x`` itself at TP 1), None on the other ranks.
    """
    size = get_tp_size()
    if size == 1:
        return x
    rank = get_tp_rank()
    parts = [torch.empty_like(x) for _ in range(size)] if rank == dst else None
    dist.gather(x.contiguous(), parts, dst=dst, group=get_tp_group())
    return torch.cat(parts, dim=dim) if parts is not None else None


def tp_all_gather_object(obj: Any) -> list[Any]:
    """Every rank's picklable ``obj``, by rank, on every rank (over the gloo CPU group).

    This is the ``all_gather`` of :class:`pdserve.kv_transfer.base.TPRank`.

    Returns:
        ``[obj]`` at TP 1, else ``[obj of rank 0, obj of rank 1, ...]``.
    """
    size = get_tp_size()
    if size == 1:
        return [obj]
    out: list[Any] = [None] * size
    dist.all_gather_object(out, obj, group=get_tp_cpu_group())
    return out
