"""Weight loading hooks of the layers: the default loader and the attributes every parameter
carries (``weight_loader``, ``num_shards``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

WeightLoader = Callable[[nn.Parameter, torch.Tensor, "int | None"], None]


def copy_checked(target: torch.Tensor, loaded: torch.Tensor) -> None:
    """Copy ``loaded`` into ``target`` (cast to its dtype and device).

    Raises:
        ValueError: ``shape (..), expected (..)`` when the shapes differ.
    """
    if tuple(loaded.shape) != tuple(target.shape):
        raise ValueError(f"shape {tuple(loaded.shape)}, expected {tuple(target.shape)}")
    target.copy_(loaded)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor,
                          shard_id: int | None = None) -> None:
    """Copy a whole, unsharded tensor into ``param`` (``shard_id`` must be None).

    Raises:
        ValueError: a shape mismatch or a shard id for an unsharded parameter.
    """
    if shard_id is not None:
        raise ValueError(f"shard {shard_id} given for an unsharded parameter")
    copy_checked(param.data, loaded)


def new_parameter(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                  weight_loader: WeightLoader = default_weight_loader,
                  num_shards: int = 1) -> nn.Parameter:
    """An uninitialised, frozen parameter with its loading attributes.

    Args:
        shape: the full (fused) shape.
        dtype, device: where it lives.
        weight_loader: ``loader(param, tensor, shard_id)`` that copies one checkpoint tensor in.
        num_shards: how many checkpoint tensors fill it (3 for q|k|v, 2 for gate|up, else 1).
    """
    param = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    param.weight_loader = weight_loader
    param.num_shards = num_shards
    return param
