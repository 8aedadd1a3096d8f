"""Gemma 3 text decoder (``Gemma3ForCausalLM``) built from the layers of :mod:`pdserve.layers`
over the paged KV cache, and the parsing of its Hugging Face config.

The math follows Hugging Face ``transformers``' ``Gemma3ForCausalLM``:

- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the weight dtype);
- interleaved sliding-window ("local") and global layers (``layer_types``, or every
  ``sliding_window_pattern``-th layer global); local layers attend the last ``sliding_window``
  positions and use their own rotary base (``rope_local_base_freq``, unscaled), global layers use
  ``rope_theta`` with the config's rope scaling;
- Gemma's RMSNorm ``x / rms(x) * (1 + w)`` (:class:`pdserve.layers.norm.GemmaRMSNorm`) before
  and after both the attention and the MLP (four norms per layer), and per-head on queries and
  keys before the rotary embedding;
- GeGLU MLP with the tanh GELU; softmax scale ``query_pre_attn_scalar ** -0.5``;
- optional final logit soft-capping ``c * tanh(logits / c)``.

Weight loading, dummy weights and the choice of torch or Triton ops are those of
:class:`pdserve.models.llama.CausalLM` (same parameter naming scheme, fused ``qkv_proj`` and
``gate_up_proj``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.attention.selector import select_attention_backend
from pdserve.layers import rotary
from pdserve.layers.activation import GeluTanhAndMul
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pdserve.layers.norm import GemmaRMSNorm
from pdserve.layers.rotary import QKRotation, RotaryEmbedding
from pdserve.models.arch_config import ArchConfig
from pdserve.models.llama import CausalLM, DecoderLayer, LayerState, LlamaAttention

ARCHITECTURE = "Gemma3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"
# Defaults of transformers' Gemma3TextConfig for keys a config.json may omit.
_DEFAULT_SLIDING_WINDOW_PATTERN = 6
_DEFAULT_THETA_GLOBAL, _DEFAULT_THETA_LOCAL = 1_000_000.0, 10_000.0
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _rope_params(hf: dict[str, Any]) -> tuple[float, dict | None, float]:
    """``(global theta, global rope_scaling or None, local theta)`` from either the
    ``rope_parameters`` dict keyed by layer type (transformers >= 5) or the older
    ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys.

    Raises:
        ValueError: a scaled rotary on the sliding layers (not in any released Gemma 3).
    """
    params = hf.get("rope_parameters") or {}
    full = dict(params.get(FULL) or {})
    local = dict(params.get(SLIDING) or {})
    if hf.get("rope_scaling"):
        full = {**hf["rope_scaling"], **full}
    theta = float(full.get("rope_theta", hf.get("rope_theta", _DEFAULT_THETA_GLOBAL)))
    local_theta = float(local.get("rope_theta",
                                  hf.get("rope_local_base_freq", _DEFAULT_THETA_LOCAL)))
    if (local.get("rope_type", local.get("type", "default")) or "default") != "default":
        raise ValueError("Gemma 3 with a scaled rotary embedding on its sliding-window layers "
                         "is not supported")
    rope_type = full.get("rope_type", full.get("type", "default")) or "default"
    scaling = None if rope_type == "default" else {**full, "rope_type": rope_type}
    return theta, scaling, local_theta


def gemma3_arch_config(hf: dict[str, Any], eos: list[int]) -> ArchConfig:
    """Parse a Gemma 3 text ``config.json`` dict into an :class:`ArchConfig`.

    Args:
        hf: the config (``model_type`` ``gemma3_text``); absent keys take the defaults of
            transformers' ``Gemma3TextConfig``.
        eos: end-of-sequence ids (config and generation config).

    Raises:
        ValueError: a missing required key, or a feature this engine lacks, named: attention
            logit soft-capping, bidirectional attention, an activation other than tanh GELU,
            unknown layer types.
    """
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in hf:
            raise ValueError(f"config.json lacks required key {key!r}")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("Gemma 3 with attn_logit_softcapping is not supported")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention=true is not supported")
    act = str(hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh")
    if act not in _GELU_TANH:
        raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3 "
                         "(only gelu_pytorch_tanh)")
    num_layers = int(hf["num_hidden_layers"])
    layer_types = hf.get("layer_types")
    if layer_types is None:
        pattern = int(hf.get("sliding_window_pattern") or _DEFAULT_SLIDING_WINDOW_PATTERN)
        layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    layer_types = list(layer_types)
    if len(layer_types) != num_layers or set(layer_types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {num_layers} entries of {SLIDING!r} or "
                         f"{FULL!r}, got {layer_types!r}")
    window = hf.get("sliding_window", 4096)
    if window is not None and int(window) < 1:
        raise ValueError(f"sliding_window must be positive, got {window}")
    theta, scaling, local_theta = _rope_params(hf)
    num_heads = int(hf["num_attention_heads"])
    softcap = hf.get("final_logit_softcapping")
    return ArchConfig(
        architecture=ARCHITECTURE,
        hidden_size=int(hf["hidden_size"]),
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or 256),
        vocab_size=int(hf.get("vocab_size", 262_208)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 131_072)),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        eos_token_ids=eos,
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


class Gemma3Attention(LlamaAttention):
    """Grouped-query attention with Gemma's per-head q/k norm, the layer's rotary embedding and
    window (None on global layers); the KV write, attention and output projection of
    :class:`~pdserve.models.llama.LlamaAttention`."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # LlamaAttention.__init__ would build Llama's norms
        d = cfg.head_dim
        self.layer_idx = layer_idx
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d,
                                  cfg.attention_bias, dtype, device)
        # this rank's heads (all of them at TP 1)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias,
                                        dtype, device)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = rotary_emb
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.backend = None  # set by CausalLM.set_attention_backend

    def project_qkv(self, hidden: torch.Tensor, qkv_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[T, hidden_size]`` (normalised) -> normed queries
        ``[T, num_heads, head_dim]`` and keys, and values ``[T, num_kv_heads, head_dim]`` (the
        rotary embedding is applied in :meth:`attend`); the projection is written into
        ``qkv_out`` when given (the values stay a view of it, the normed queries and keys are new
        tensors)."""
        t = hidden.shape[0]
        q, k, v = self.split_qkv(hidden, qkv_out)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        return q, k, v.view(t, self.num_kv_heads, self.head_dim)

    def rotation(self, positions: torch.Tensor) -> QKRotation:
        """The rotary embedding at ``positions`` ``[T]`` (Gemma's q/k norms, ``1 + weight``, are
        applied in :meth:`project_qkv`)."""
        return QKRotation(self.rotary_emb, positions)


class Gemma3MLP(nn.Module):
    """GeGLU MLP: fused gate|up projection, ``gelu_tanh(gate) * up``, down projection."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        i, h = cfg.intermediate_size, cfg.hidden_size
        self.gate_up_proj = MergedLinear(h, [i, i], False, dtype, device)
        self.act = GeluTanhAndMul()
        self.down_proj = RowParallelLinear(i, h, False, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class Gemma3DecoderLayer(DecoderLayer):
    """One Gemma 3 layer: ``h += post_norm(attn(pre_norm(h)))``, then
    ``h += post_ff_norm(mlp(pre_ff_norm(h)))`` (the stages and ``forward`` of
    :class:`~pdserve.models.llama.DecoderLayer`, with the stream as the state)."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)  # DecoderLayer.__init__ would build Llama's norms and MLP
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.self_attn = Gemma3Attention(cfg, layer_idx, rotary_emb, dtype, device)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)
        self.mlp = Gemma3MLP(cfg, dtype, device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype, device)

    def attention_inputs(self, state: LayerState, qkv_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LayerState]:
        """The pre-attention norm and the query/key/value projection of the stream
        ``state = (hidden,)``; contract of :meth:`pdserve.models.llama.DecoderLayer.attention_inputs`
        (the state handed on is the stream)."""
        q, k, v = self.self_attn.project_qkv(self.input_layernorm(state[0]), qkv_out)
        return q, k, v, state

    def attention_output(self, o: torch.Tensor, state: LayerState) -> LayerState:
        """``h += post_norm(o_proj(o))``, then ``h += post_ff_norm(mlp(pre_ff_norm(h)))``:
        the next layer's ``(stream,)``."""
        hidden = state[0] + self.post_attention_layernorm(self.self_attn.project_out(o))
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return (hidden + self.post_feedforward_layernorm(mlp),)


class Gemma3ForCausalLM(CausalLM):
    """Gemma 3 causal language model over a paged KV cache.

    Same constructor arguments, forward contract and weight loading as
    :class:`pdserve.models.llama.CausalLM` (whose layers it replaces with
    :class:`Gemma3DecoderLayer`); ``cfg`` comes from :func:`gemma3_arch_config`.
    """

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_positions: int):
        nn.Module.__init__(self)  # CausalLM.__init__ would build Llama layers
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        # transformers keeps sqrt(hidden_size) in float32 and casts it to the weight dtype.
        self.register_buffer("embed_scale", torch.tensor(cfg.hidden_size ** 0.5).to(dtype),
                             persistent=False)
        global_rope = RotaryEmbedding(max_positions, rotary.rope_inv_freq(
            cfg.head_dim, cfg.rope_theta, cfg.rope_scaling), device)
        local_rope = RotaryEmbedding(max_positions, rotary.rope_inv_freq(
            cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta, None), device)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i, local_rope if cfg.layer_sliding_window(i) else global_rope,
                               dtype, device)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device,
                              tie_to=self.embed_tokens if cfg.tie_word_embeddings else None)
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        attn = self.layers[0].self_attn
        self.set_attention_backend(select_attention_backend(
            device, attn.num_heads, attn.num_kv_heads, cfg.head_dim, block_size, scale))

    def embed(self, input_ids: torch.Tensor) -> LayerState:
        """``(embeddings * sqrt(hidden_size),)``: the stream into the first layer."""
        return (self.embed_tokens(input_ids) * self.embed_scale,)

    def compute_logits(self, state: LayerState,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Final norm and LM head of the stream's rows ``logits_indices``, soft-capped when the
        model says so (then float32)."""
        hidden = state[0] if logits_indices is None else state[0][logits_indices]
        logits = self.lm_head(self.norm(hidden))
        cap = self.cfg.final_logit_softcapping
        if cap is not None:  # float32: the capped values are not rounded to the model dtype
            logits = torch.tanh(logits.float() / cap) * cap
        return logits

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """As :meth:`CausalLM.init_dummy_weights`, with Gemma's norm weights 0 (a scale of
        ``1 + 0``)."""
        super().init_dummy_weights(seed)
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.weight.zero_()
