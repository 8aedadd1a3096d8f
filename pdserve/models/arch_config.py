"""The architecture hyper-parameters of a decoder model, parsed from a Hugging Face
``config.json`` (:class:`ArchConfig`), and the rotary frequencies they give."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.layers import rotary
from pdserve.layers.fused_moe import MoEConfig


@dataclass
class ArchConfig:
    """The architecture hyper-parameters the model needs (parsed from a HF ``config.json``).

    Attributes:
        architecture: a name of :data:`pdserve.models.registry.SUPPORTED_ARCHITECTURES`.
        hidden_size, intermediate_size: widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention geometry (grouped-query when
            ``num_kv_heads < num_heads``).
        vocab_size: rows of the embedding / LM head.
        max_position_embeddings: the model's context length in tokens.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        rope_scaling: ``None`` (default rotary) or a dict with a ``rope_type`` of
            :data:`pdserve.layers.rotary.SUPPORTED_ROPE_TYPES` and its parameters.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias, mlp_bias: linear layers carry biases.
        qkv_bias: the query/key/value projection carries a bias, the output one not (Qwen2).
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        initializer_range: std of random weights (dummy load format).
        eos_token_ids: end-of-sequence ids from the config and generation config.
        moe: the mixture-of-experts settings (Qwen3-MoE), None for a dense model.
        sliding_window: None, or the attention window ``W`` in tokens of the layers that slide
            (each token attends its last ``W`` positions, itself included).
        layer_types: per layer ``"sliding_attention"`` or ``"full_attention"``; None = every
            layer slides when ``sliding_window`` is set (Mistral).
        rope_local_theta: rotary base of the sliding layers when it differs from ``rope_theta``
            (Gemma 3's local layers; their rotary is unscaled).
        query_pre_attn_scalar: softmax scale ``query_pre_attn_scalar ** -0.5`` instead of
            ``head_dim ** -0.5`` (Gemma 3).
        final_logit_softcapping: None, or ``c``: logits become ``c * tanh(logits / c)``.
    """

    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    initializer_range: float = 0.02
    eos_token_ids: list[int] = field(default_factory=list)
    qkv_bias: bool = False
    moe: MoEConfig | None = None
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    final_logit_softcapping: float | None = None

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (None = full causal attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


def rope_inv_freq(cfg: ArchConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32) of ``cfg``
    (:func:`pdserve.layers.rotary.rope_inv_freq`).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    return rotary.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                cfg.max_position_embeddings)
