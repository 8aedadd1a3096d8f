"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention (q/k norm) with a mixture-of-experts
MLP (:class:`pdserve.layers.fused_moe.SparseMoeBlock`) in the layers the config names, a dense
SwiGLU MLP in the others.

The math follows Hugging Face ``transformers``' ``modeling_qwen3_moe.py``. Checkpoints name each
expert's matrices ``mlp.experts.{e}.{gate,up,down}_proj.weight``; they are loaded into the
stacked ``mlp.experts.w13_weight`` / ``w2_weight`` through their ``weight_loader``.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.layers.fused_moe import SparseMoeBlock
from pdserve.models.arch_config import ArchConfig
from pdserve.models.llama import CausalLM, DecoderLayer

# HF expert projection -> (our stacked parameter, shard = expert * per_expert + offset)
_EXPERT_PROJ = {"gate_proj": ("w13_weight", 2, 0), "up_proj": ("w13_weight", 2, 1),
                "down_proj": ("w2_weight", 1, 0)}


class Qwen3MoeDecoderLayer(DecoderLayer):
    """A Qwen3 decoder layer whose MLP is a :class:`SparseMoeBlock` where
    ``cfg.moe.is_moe_layer(layer_idx)``."""

    def make_mlp(self, cfg: ArchConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> nn.Module:
        """The experts block in MoE layers, else the dense MLP (``intermediate_size``)."""
        if cfg.moe is not None and cfg.moe.is_moe_layer(layer_idx):
            return SparseMoeBlock(cfg.hidden_size, cfg.moe, dtype, device)
        return super().make_mlp(cfg, layer_idx, dtype, device)


class Qwen3MoeCausalLM(CausalLM):
    """Qwen3-MoE causal language model over a paged KV cache (same interface as
    :class:`pdserve.models.llama.CausalLM`).

    Raises:
        ValueError: ``cfg.moe`` is None.
    """

    decoder_layer_cls = Qwen3MoeDecoderLayer

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_positions: int):
        if cfg.moe is None:
            raise ValueError(f"{cfg.architecture} needs the mixture-of-experts settings")
        super().__init__(cfg, dtype, device, block_size, max_positions)

    @staticmethod
    def _param_name(short: str) -> tuple[str, int | None]:
        """Per-expert checkpoint names -> the stacked expert parameter and shard; every other
        name as :meth:`CausalLM._param_name`."""
        parts = short.split(".")
        # layers.{l}.mlp.experts.{e}.{proj}.weight
        if len(parts) == 7 and parts[3] == "experts" and parts[5] in _EXPERT_PROJ \
                and parts[4].isdigit() and parts[6] == "weight":
            target, per_expert, offset = _EXPERT_PROJ[parts[5]]
            return ".".join(parts[:4] + [target]), int(parts[4]) * per_expert + offset
        return CausalLM._param_name(short)
