"""Linear layers: a plain one and a merged one (several projections stacked along the output
dim, e.g. q|k|v or gate|up, so one matmul replaces several).

Each layer owns its weight (``[out_features, in_features]``, as Hugging Face stores it) and the
``weight_loader`` that copies a checkpoint tensor (or one shard of a merged weight) in; a
tensor-parallel column/row-parallel variant narrows by rank in that same loader.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.weights import copy_checked, default_weight_loader, new_parameter


class Linear(nn.Module):
    """``y = x W^T + b``.

    Args:
        input_size, output_size: features in and out.
        bias: whether the layer has a bias.
        dtype, device: where the parameters live.

    Attributes:
        weight: ``[output_size, input_size]``.
        bias: ``[output_size]`` or None.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.weight = new_parameter((output_size, input_size), dtype, device,
                                    self.weight_loader, self.num_shards)
        if bias:
            self.bias = new_parameter((output_size,), dtype, device, self.weight_loader,
                                      self.num_shards)
        else:
            self.register_parameter("bias", None)

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors per parameter (1 for a plain linear layer)."""
        return 1

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into ``param`` (see
        :func:`pdserve.layers.weights.default_weight_loader`)."""
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, input_size]`` -> ``[T, output_size]``."""
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several linear layers with the same input, stacked along the output dim.

    Args:
        input_size: features in.
        output_sizes: features out of each stacked projection, in order (e.g. ``[q, k, v]``).
        bias, dtype, device: as :class:`Linear`.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, dtype, device)

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors per parameter: one per stacked projection."""
        return len(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy the checkpoint tensor of projection ``shard_id`` into its rows of ``param``.

        Raises:
            ValueError: no or an out-of-range shard id, or a shape mismatch.
        """
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id} outside 0..{len(self.output_sizes) - 1}")
        start = sum(self.output_sizes[:shard_id])
        copy_checked(param.data.narrow(0, start, self.output_sizes[shard_id]), loaded)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stacked outputs ``[T, sum(output_sizes)]`` -> one view per projection."""
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The fused query|key|value projection of grouped-query attention.

    Args:
        hidden_size: features in.
        num_heads, num_kv_heads, head_dim: attention geometry (outputs ``num_heads * head_dim``
            queries and ``num_kv_heads * head_dim`` keys and values).
        bias, dtype, device: as :class:`Linear`.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, dtype: torch.dtype, device: torch.device):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias, dtype,
                         device)
