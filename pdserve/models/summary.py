"""The start-up summary of a loaded model: family, parameter count and KV-cache geometry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.models.arch_config import ArchConfig
from pdserve.models.deepseek import DeepseekArchConfig

#: Architecture -> the family name printed at start-up.
FAMILIES = {
    "LlamaForCausalLM": "Llama",
    "MistralForCausalLM": "Mistral",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "Qwen3MoeForCausalLM": "Qwen3-MoE",
    "DeepseekV2ForCausalLM": "DeepSeek-V2",
    "DeepseekV3ForCausalLM": "DeepSeek-V3",
}


@dataclass(frozen=True)
class ModelSummary:
    """What the loader reports about a model.

    Attributes:
        family: e.g. ``Qwen2`` (the architecture name for a family not in :data:`FAMILIES`).
        num_params: parameters (a tied LM head counted once).
        active_params: parameters used per token (differs from ``num_params`` for
            mixture-of-experts models: only ``top_k`` of the experts run).
        num_layers, num_kv_heads, head_dim: KV-cache geometry.
        kv_bytes_per_token: K and V of one token over all layers, in bytes.
        rope: the rotary scaling type (``default`` when unscaled).
    """

    family: str
    num_params: int
    active_params: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_bytes_per_token: int
    rope: str

    def line(self) -> str:
        """One log line, e.g. ``Qwen2: 494.0M parameters, KV 24 layers x 2 heads x 64 (...)``."""
        active = ("" if self.active_params == self.num_params
                  else f" ({_count(self.active_params)} active per token)")
        return (f"{self.family}: {_count(self.num_params)} parameters{active}, KV "
                f"{self.num_layers} layers x {self.num_kv_heads} heads x {self.head_dim} = "
                f"{self.kv_bytes_per_token / 1024:.1f} KiB per token, rope {self.rope}")


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def summarize(arch: ArchConfig, model: nn.Module, kv_dtype: torch.dtype) -> ModelSummary:
    """The :class:`ModelSummary` of ``model`` (built from ``arch``) with a KV cache of
    ``kv_dtype``."""
    total = sum(p.numel() for p in model.parameters())  # shared (tied) tensors once
    active = total
    moe = arch.deepseek_moe if isinstance(arch, DeepseekArchConfig) else arch.moe
    if moe is not None:
        per_expert = 3 * arch.hidden_size * moe.moe_intermediate_size
        moe_layers = sum(moe.is_moe_layer(i) for i in range(arch.num_layers))
        active = total - moe_layers * (moe.num_experts - moe.top_k) * per_expert
    elem = torch.empty((), dtype=kv_dtype).element_size()
    rope = (arch.rope_scaling or {}).get("rope_type", "default")
    return ModelSummary(
        family=FAMILIES.get(arch.architecture, arch.architecture), num_params=total,
        active_params=active, num_layers=arch.num_layers, num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        kv_bytes_per_token=2 * arch.num_layers * arch.num_kv_heads * arch.head_dim * elem,
        rope=rope)
