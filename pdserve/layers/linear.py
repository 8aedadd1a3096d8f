"""Linear layers: a replicated one and the tensor-parallel ones of Megatron-LM (Shoeybi et al.,
2019): column-parallel (output features split over the TP ranks: the merged q|k|v and gate|up
projections, split by heads / rows) and row-parallel (input features split, partial outputs
summed by an all-reduce: o_proj, down_proj).

Each layer owns its weight (``[out_features, in_features]`` of its rank, as Hugging Face stores
it) and the ``weight_loader`` that copies a checkpoint tensor (or one shard of a merged weight)
in, narrowing it to the rank's slice there (reading only that slice when the checkpoint tensor
is a :class:`~pdserve.layers.weights.LazyWeight`). At TP 1 every layer holds the whole weight
and runs exactly the one ``F.linear`` of an unsharded layer.

With the model's Triton ops on (:class:`~pdserve.layers.custom_op.CustomOp`), a decode step of one
sequence (and of two, for weights no wider than long) goes to
:func:`pdserve.kernels.gemv.small_batch_linear`, which reads the weight faster than cuBLAS there
(:func:`pdserve.kernels.gemv.preferred`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.communication import tp_all_reduce
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import kv_head_range, shard_range
from pdserve.layers.custom_op import CustomOp
from pdserve.layers.weights import (
    LoadedWeight,
    copy_checked,
    default_weight_loader,
    narrow_weight,
    new_parameter,
)


class Linear(CustomOp):
    """``y = x W^T + b``, the whole weight on every rank (replicated).

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

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy a checkpoint tensor into ``param`` (see
        :func:`pdserve.layers.weights.default_weight_loader`)."""
        default_weight_loader(param, loaded, shard_id)

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, input_size]`` -> ``[T, output_size]``."""
        return F.linear(x, self.weight, self.bias)

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """As :meth:`forward_torch`; one or two rows by the small-batch kernel where
        :func:`pdserve.kernels.gemv.preferred` says so."""
        return self._project(x, self.bias)

    def _project(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x W^T (+ bias)`` by the op :attr:`use_triton` picks for ``x``'s row count."""
        if self.use_triton and x.dim() == 2 and _gemv().preferred(x.shape[0], *self.weight.shape):
            return _gemv().small_batch_linear(x, self.weight, bias)
        return F.linear(x, self.weight, bias)


class MergedLinear(Linear):
    """Several column-parallel linear layers with the same input, stacked along the output dim
    (q|k|v, gate|up): each rank holds its rows of every stacked projection.

    Projection ``i`` of ``output_sizes[i]`` features is split into equal contiguous row ranges
    over the TP ranks (:meth:`_rank_rows`; :class:`QKVLinear` splits by heads instead).

    Args:
        input_size: features in (whole on every rank).
        output_sizes: features out of each stacked projection in the checkpoint, in order
            (e.g. ``[q, k, v]``).
        bias, dtype, device: as :class:`Linear` (a bias is split like the rows).

    Attributes:
        output_sizes: this rank's features out of each projection (what :meth:`split` cuts).
        full_output_sizes: the checkpoint's (unsharded) sizes.

    Raises:
        TPShardingError: a projection does not split over the TP size.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool,
                 dtype: torch.dtype, device: torch.device):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.full_output_sizes = list(output_sizes)
        rows = [self._rank_rows(i, n) for i, n in enumerate(self.full_output_sizes)]
        self.row_starts = [start for start, _ in rows]
        self.output_sizes = [n for _, n in rows]
        super().__init__(input_size, sum(self.output_sizes), bias, dtype, device)

    def _rank_rows(self, index: int, full: int) -> tuple[int, int]:
        """``(first_row, num_rows)`` of projection ``index`` (``full`` rows) on this rank."""
        return shard_range(full, self.tp_size, self.tp_rank)

    @property
    def num_shards(self) -> int:
        """Checkpoint tensors per parameter: one per stacked projection."""
        return len(self.output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy this rank's rows of the checkpoint tensor of projection ``shard_id`` into its
        rows of ``param``.

        Raises:
            ValueError: no or an out-of-range shard id, or a shape mismatch.
        """
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard id {shard_id} outside 0..{len(self.output_sizes) - 1}")
        start = sum(self.output_sizes[:shard_id])
        n = self.output_sizes[shard_id]
        if self.tp_size > 1:
            loaded = narrow_weight(loaded, 0, self.full_output_sizes[shard_id],
                                   self.row_starts[shard_id], n)
        copy_checked(param.data.narrow(0, start, n), loaded)

    def project_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``x W^T (+ b)`` of this rank written into ``out`` (the same cuBLAS product as
        ``F.linear``, so the same bits), e.g. a CUDA graph's static buffer that attention reads
        afterwards. Column-parallel: no collective (a row-parallel layer would need its
        all-reduce, so it has no such method).

        Args:
            x: ``[T, input_size]``.
            out: ``[T, output_size]``, contiguous, ``x``'s dtype.

        Returns:
            ``out``.
        """
        if self.bias is None:
            return torch.mm(x, self.weight.t(), out=out)
        return torch.addmm(self.bias, x, self.weight.t(), out=out)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The stacked outputs ``[T, sum(output_sizes)]`` -> one view per projection."""
        return y.split(self.output_sizes, dim=-1)


class QKVLinear(MergedLinear):
    """The fused query|key|value projection of grouped-query attention, column-parallel by
    heads: rank ``r`` of ``T`` holds query heads ``[r*Q/T, (r+1)*Q/T)`` and the KV heads of
    :func:`pdserve.distributed.sharding.kv_head_range` (replicated when there are fewer KV heads
    than ranks).

    Args:
        hidden_size: features in.
        num_heads, num_kv_heads, head_dim: the model's attention geometry (outputs
            ``num_heads * head_dim`` queries and ``num_kv_heads * head_dim`` keys and values).
        bias, dtype, device: as :class:`Linear`.

    Attributes:
        num_heads, num_kv_heads: this rank's query and KV heads.
        q_size, kv_size: this rank's query and key (= value) features.

    Raises:
        TPShardingError: the heads do not split over the TP size.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool, dtype: torch.dtype, device: torch.device):
        size, rank = get_tp_size(), get_tp_rank()
        self.head_dim = head_dim
        self._q_heads = shard_range(num_heads, size, rank)
        self._kv_heads = kv_head_range(num_kv_heads, size, rank)
        self.num_heads, self.num_kv_heads = self._q_heads[1], self._kv_heads[1]
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias, dtype, device)

    def _rank_rows(self, index: int, full: int) -> tuple[int, int]:
        first, n = self._q_heads if index == 0 else self._kv_heads
        return first * self.head_dim, n * self.head_dim


class RowParallelLinear(Linear):
    """``y = all_reduce(x_r W_r^T) + b``: input features split over the TP ranks (rank ``r``
    holds columns ``[r*in/T, (r+1)*in/T)`` of the weight and gets the matching slice of the
    input from the column-parallel layer before it), partial outputs summed over the ranks. The
    bias is whole on every rank and added once, after the sum.

    Args:
        input_size: features in, of the whole layer (the checkpoint's).
        output_size, bias, dtype, device: as :class:`Linear`.

    Attributes:
        input_size: this rank's features in.

    Raises:
        TPShardingError: ``input_size`` does not split over the TP size.
    """

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device):
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.full_input_size = input_size
        self.col_start, local = shard_range(input_size, self.tp_size, self.tp_rank)
        super().__init__(local, output_size, bias, dtype, device)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy this rank's columns of the checkpoint weight (the whole bias) into ``param``.

        Raises:
            ValueError: a shard id, or a shape mismatch.
        """
        if self.tp_size > 1 and param is self.weight:
            loaded = narrow_weight(loaded, 1, self.full_input_size, self.col_start,
                                   self.input_size)
        default_weight_loader(param, loaded, shard_id)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, input_size]`` (this rank's slice) -> ``[T, output_size]`` (the sum)."""
        if self.tp_size == 1:
            return self._project(x, self.bias)
        y = tp_all_reduce(self._project(x, None))
        return y if self.bias is None else y + self.bias


def _gemv():
    """:mod:`pdserve.kernels.gemv`, imported on first use (it needs Triton, which a CPU-only
    install may lack; layers with :attr:`CustomOp.use_triton` off never import it)."""
    from pdserve.kernels import gemv

    return gemv
