"""DeepSeek-MoE feed-forward block: routed experts (:class:`~pdserve.layers.fused_moe.FusedMoE`,
sharded over tensor-parallel ranks) chosen by DeepSeek-V2's group-limited softmax or
DeepSeek-V3's sigmoid router with its score correction bias, scaled by ``routed_scaling_factor``,
plus always-on shared experts."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.communication import tp_all_reduce
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import shard_range
from pdserve.layers.fused_moe import FusedMoE
from pdserve.layers.weights import LoadedWeight, copy_checked, narrow_weight, new_parameter


class RouterScoring(enum.Enum):
    """How router logits become expert scores."""

    #: DeepSeek-V2: softmax over the experts; experts picked by score.
    SOFTMAX = "softmax"
    #: DeepSeek-V3: sigmoid per expert; picked by score + ``e_score_correction_bias``, weighted
    #: by the score alone.
    SIGMOID = "sigmoid"


@dataclass(frozen=True)
class DeepseekMoEConfig:
    """The mixture-of-experts settings of a DeepSeek config.

    Attributes:
        num_experts: routed experts ``E`` (``n_routed_experts``).
        top_k: routed experts per token (``num_experts_per_tok``).
        moe_intermediate_size: each expert's SwiGLU width.
        num_shared_experts: ``n_shared_experts``: one shared SwiGLU MLP of
            ``num_shared_experts * moe_intermediate_size`` (0 = none).
        scoring: :class:`RouterScoring`.
        num_groups: ``n_group``: experts are split in this many equal groups (1 = no groups).
        topk_groups: ``topk_group``: tokens pick experts from this many groups only.
        norm_topk_prob: the ``top_k`` weights are renormalised to sum 1 (before scaling).
        routed_scaling_factor: multiplies the routed weights.
        first_k_dense_replace: layers ``0 .. first_k_dense_replace - 1`` keep a dense MLP.
        moe_layer_freq: of the others, every this-many-th layer has experts.
    """

    num_experts: int
    top_k: int
    moe_intermediate_size: int
    num_shared_experts: int
    scoring: RouterScoring
    num_groups: int = 1
    topk_groups: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether decoder layer ``layer_idx`` has experts (DeepSeek's rule)."""
        return (layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)


def route_deepseek(router_logits: torch.Tensor, moe: DeepseekMoEConfig,
                   correction_bias: torch.Tensor | None, dtype: torch.dtype
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's routing, as Hugging Face ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``.

    Scores are ``softmax`` (V2) or ``sigmoid`` (V3) of the float32 logits. With groups, a group
    is rated by its best score (V2) or the sum of its two best biased scores (V3), and each
    token picks its ``top_k`` experts from its ``topk_groups`` best groups only. The weights are
    the picked scores (unbiased), renormalised when ``norm_topk_prob``, times
    ``routed_scaling_factor``.

    Args:
        router_logits: ``[T, E]`` float32.
        moe: the settings.
        correction_bias: ``[E]`` float32 (V3's ``e_score_correction_bias``) or None.
        dtype: dtype of the returned weights.

    Returns:
        ``(weights [T, top_k] in dtype, ids [T, top_k] int64)``.
    """
    t, e = router_logits.shape
    if moe.scoring is RouterScoring.SOFTMAX:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores
    else:
        scores = router_logits.sigmoid()
        choice = scores if correction_bias is None else scores + correction_bias
    if moe.num_groups > 1:
        grouped = choice.view(t, moe.num_groups, e // moe.num_groups)
        if moe.scoring is RouterScoring.SOFTMAX:
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=moe.topk_groups, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1.0).bool()
        expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(t, e)
        fill = 0.0 if moe.scoring is RouterScoring.SOFTMAX else float("-inf")
        choice = choice.masked_fill(~expert_mask, fill)
    ids = torch.topk(choice, k=moe.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * moe.routed_scaling_factor).to(dtype), ids


class DeepseekRouter(nn.Module):
    """The router of a DeepSeek-MoE layer: ``weight`` ``[E, hidden]`` and, for sigmoid scoring,
    ``e_score_correction_bias`` ``[E]``, both float32 (as Hugging Face keeps them)."""

    def __init__(self, hidden_size: int, moe: DeepseekMoEConfig, device: torch.device):
        super().__init__()
        self.moe = moe
        self.weight = new_parameter((moe.num_experts, hidden_size), torch.float32, device)
        self.e_score_correction_bias = None
        if moe.scoring is RouterScoring.SIGMOID:
            self.e_score_correction_bias = new_parameter((moe.num_experts,), torch.float32,
                                                         device)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> ``(weights [T, top_k] in x's dtype, ids [T, top_k])``
        (:func:`route_deepseek`)."""
        logits = F.linear(x.float(), self.weight)
        return route_deepseek(logits, self.moe, self.e_score_correction_bias, x.dtype)


class ShardedExperts(FusedMoE):
    """:class:`FusedMoE` whose experts are split over the TP ranks as the dense MLP is: rank
    ``r`` holds rows ``[r*I/T, (r+1)*I/T)`` of every expert's gate and up projections and the
    same columns of its down projection, and the partial outputs are summed by an all-reduce
    (routing runs on every rank, on the same replicated input). At TP 1 it is :class:`FusedMoE`.

    Args:
        num_experts, hidden_size, dtype, device: as :class:`FusedMoE`.
        intermediate_size: each expert's width in the checkpoint (``moe_intermediate_size``).

    Raises:
        TPShardingError: ``intermediate_size`` does not split over the TP size.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 dtype: torch.dtype, device: torch.device):
        self.tp_size = get_tp_size()
        self.full_intermediate_size = intermediate_size
        self.row_start, local = shard_range(intermediate_size, self.tp_size, get_tp_rank())
        super().__init__(num_experts, hidden_size, local, dtype, device)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy this rank's slice of one expert's checkpoint matrix (gate / up ``[I, H]``: rows;
        down ``[H, I]``: columns) into its place of ``param``.

        Raises:
            ValueError: a shard id out of range or a shape mismatch.
        """
        if shard_id is None or not 0 <= shard_id < param.num_shards:
            raise ValueError(f"shard id {shard_id} outside 0..{param.num_shards - 1}")
        full, start, n = self.full_intermediate_size, self.row_start, self.intermediate_size
        if param is self.w13_weight:
            expert, half = divmod(shard_id, 2)
            copy_checked(param.data[expert].narrow(0, half * n, n),
                         narrow_weight(loaded, 0, full, start, n))
        else:
            copy_checked(param.data[shard_id], narrow_weight(loaded, 1, full, start, n))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor,
                topk_ids: torch.Tensor) -> torch.Tensor:
        """As :class:`FusedMoE` (its torch or Triton op), summed over the TP ranks:
        ``[T, H]``."""
        out = super().forward(x, topk_weights, topk_ids)
        return out if self.tp_size == 1 else tp_all_reduce(out)


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts: ``experts(x, route(x)) + shared_experts(x)``.

    Args:
        hidden_size: ``H``.
        moe: the settings.
        shared_experts: the shared SwiGLU MLP (width ``num_shared_experts *
            moe_intermediate_size``), or None without shared experts.
        dtype, device: where the expert weights live.
    """

    def __init__(self, hidden_size: int, moe: DeepseekMoEConfig, shared_experts: nn.Module | None,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.gate = DeepseekRouter(hidden_size, moe, device)
        self.experts = ShardedExperts(moe.num_experts, hidden_size, moe.moe_intermediate_size,
                                      dtype, device)
        self.shared_experts = shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
