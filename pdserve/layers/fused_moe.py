"""Mixture-of-experts feed-forward block: a top-k softmax router and SwiGLU experts whose weights
are stacked per expert, run by a torch op (CPU, reference) or the fused Triton grouped GEMM
(:mod:`pdserve.kernels.moe`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.layers.custom_op import CustomOp
from pdserve.layers.linear import Linear
from pdserve.layers.weights import copy_checked, new_parameter


@dataclass(frozen=True)
class MoEConfig:
    """The mixture-of-experts settings of a config (Qwen3-MoE names).

    Attributes:
        num_experts: experts per MoE layer.
        top_k: experts per token (``num_experts_per_tok``).
        moe_intermediate_size: each expert's SwiGLU width.
        norm_topk_prob: the ``top_k`` routing probabilities are renormalised to sum to 1.
        decoder_sparse_step: every this-many-th layer is an MoE layer (1 = all).
        mlp_only_layers: layer indices that keep a dense MLP.
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has experts (the rule of Hugging Face's
        ``Qwen3MoeDecoderLayer``)."""
        return (layer_idx not in self.mlp_only_layers and self.num_experts > 0
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def route_topk_softmax(router_logits: torch.Tensor, top_k: int, normalize: bool,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax routing, as Hugging Face ``Qwen3MoeTopKRouter``: softmax over all experts
    in float32, the ``top_k`` largest, renormalised to sum 1 when ``normalize``.

    Args:
        router_logits: ``[T, E]``.
        top_k: experts per token.
        normalize: ``norm_topk_prob``.
        dtype: dtype of the returned weights (the hidden states').

    Returns:
        ``(weights [T, top_k] in dtype, ids [T, top_k] int64)``.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class FusedMoE(CustomOp):
    """SwiGLU experts with stacked weights: ``w13`` = each expert's gate|up rows, ``w2`` = each
    expert's down projection.

    The expert weights are stored as ``[E, 2 * I, H]`` and ``[E, H, I]`` (the Hugging Face
    ``[out, in]`` layout per expert). Tensor parallelism can shard them like the dense MLP's
    merged gate|up (column-parallel, a slice of ``I`` of both the gate and the up rows) and down
    (row-parallel, the same slice of ``I`` on its input side, then an all-reduce of the summed
    output): :meth:`weight_loader` is the one place that would narrow by rank, exactly as
    :class:`pdserve.layers.linear.MergedLinear` does; routing is replicated on every rank.

    Args:
        num_experts: ``E``.
        hidden_size: ``H``.
        intermediate_size: ``I`` (each expert's ``moe_intermediate_size``).
        dtype, device: where the weights live.

    Attributes:
        w13_weight: ``[E, 2 * I, H]``; checkpoint shards ``2 * e`` (gate of expert ``e``) and
            ``2 * e + 1`` (up).
        w2_weight: ``[E, H, I]``; checkpoint shard ``e`` (down of expert ``e``).
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13_weight = new_parameter((num_experts, 2 * intermediate_size, hidden_size), dtype,
                                        device, self.weight_loader, 2 * num_experts)
        self.w2_weight = new_parameter((num_experts, hidden_size, intermediate_size), dtype,
                                       device, self.weight_loader, num_experts)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard_id: int | None = None) -> None:
        """Copy one expert's checkpoint matrix into its place of ``param``.

        Raises:
            ValueError: a shard id out of range or a shape mismatch.
        """
        if shard_id is None or not 0 <= shard_id < param.num_shards:
            raise ValueError(f"shard id {shard_id} outside 0..{param.num_shards - 1}")
        if param is self.w13_weight:
            expert, half = divmod(shard_id, 2)
            i = self.intermediate_size
            copy_checked(param.data[expert].narrow(0, half * i, i), loaded)
        else:
            copy_checked(param.data[shard_id], loaded)

    def forward_torch(self, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
        """The reference op (CPU, and CUDA without Triton): for each expert that has tokens,
        its SwiGLU over those tokens, scaled by their routing weights and added to their rows,
        as Hugging Face ``Qwen3MoeExperts`` computes it.

        Args:
            x: ``[T, H]``.
            topk_weights: ``[T, top_k]`` in ``x``'s dtype.
            topk_ids: ``[T, top_k]`` int expert ids.

        Returns:
            ``[T, H]``.
        """
        out = torch.zeros_like(x)
        flat = topk_ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        top_k = topk_ids.shape[1]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            pairs = order[start:start + count]
            start += count
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], self.w13_weight[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.w2_weight[expert])
            y = y * topk_weights.reshape(-1)[pairs, None]
            out.index_add_(0, tokens, y.to(out.dtype))
        return out

    def forward_triton(self, x: torch.Tensor, topk_weights: torch.Tensor,
                       topk_ids: torch.Tensor) -> torch.Tensor:
        """As :meth:`forward_torch` with :func:`pdserve.kernels.moe.fused_moe` (two grouped
        GEMM launches over tokens sorted by expert)."""
        from pdserve.kernels import moe as kernels

        return kernels.fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)


class SparseMoeBlock(nn.Module):
    """The mixture-of-experts MLP of Qwen3-MoE: router ``gate`` (``[E, H]``, no bias), top-k
    softmax routing (:func:`route_topk_softmax`), then the experts (:class:`FusedMoE`).

    Args:
        hidden_size: ``H``.
        moe: the layer's settings.
        dtype, device: where the weights live.
    """

    def __init__(self, hidden_size: int, moe: MoEConfig, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        self.moe = moe
        self.gate = Linear(hidden_size, moe.num_experts, False, dtype, device)
        self.experts = FusedMoE(moe.num_experts, hidden_size, moe.moe_intermediate_size, dtype,
                                device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        weights, ids = route_topk_softmax(self.gate(x), self.moe.top_k, self.moe.norm_topk_prob,
                                          x.dtype)
        return self.experts(x, weights, ids)
