"""Llama-family decoder (Llama, Mistral-like, SmolLM2) and Qwen3, written for a paged KV cache.

The math follows the Hugging Face ``transformers`` implementations of ``LlamaForCausalLM`` and
``Qwen3ForCausalLM`` (RMSNorm in float32, rotate-half rotary embedding, SwiGLU MLP); Qwen3 adds
an RMSNorm over ``head_dim`` on each query and key head before the rotary embedding. Weights are
stored fused (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up) so that one matmul replaces
three (two); :meth:`CausalLM.load_weights` maps Hugging Face parameter names onto the fused
tensors.

The forward pass takes the flattened tokens of a mixed batch (prefill chunks and decodes), their
positions, the KV cache and an :class:`~pdserve.model.attention.AttentionMetadata`, and returns
logits only for the tokens that are sampled.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import (
    AttentionMetadata,
    TorchAttentionBackend,
    TritonAttentionBackend,
    make_attention_backend,
)


@dataclass
class ArchConfig:
    """The architecture hyper-parameters the model needs (parsed from a HF ``config.json``).

    Attributes:
        architecture: ``LlamaForCausalLM``, ``MistralForCausalLM`` or ``Qwen3ForCausalLM``.
        hidden_size, intermediate_size: widths.
        num_layers: decoder layers.
        num_heads, num_kv_heads, head_dim: attention geometry (grouped-query when
            ``num_kv_heads < num_heads``).
        vocab_size: rows of the embedding / LM head.
        max_position_embeddings: the model's context length in tokens.
        rms_norm_eps: RMSNorm epsilon.
        rope_theta: rotary base.
        rope_scaling: ``None`` (default rotary) or a dict with ``rope_type`` ``linear`` or
            ``llama3`` and its parameters.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        attention_bias, mlp_bias: linear layers carry biases.
        qk_norm: per-head RMSNorm on queries and keys (Qwen3).
        initializer_range: std of random weights (dummy load format).
        eos_token_ids: end-of-sequence ids from the config and generation config.
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


def rope_inv_freq(cfg: ArchConfig) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32), with optional scaling.

    ``default``: ``theta ** (-2i / head_dim)`` (Su et al., RoFormer). ``linear``: divided by
    ``factor``. ``llama3``: the frequency-dependent rescaling published with Llama 3.1 (low
    frequencies divided by ``factor``, high ones kept, a smooth ramp in between, with
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        wavelen = 2 * math.pi / inv_freq
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: default, linear, "
                     "llama3)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and cast back (as in HF Llama)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding.

    Args:
        x: ``[T, heads, head_dim]``.
        cos, sin: ``[T, 1, head_dim // 2]`` in ``x``'s dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: attention (fused QKV, GQA) then SwiGLU MLP."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        h, d = cfg.hidden_size, cfg.head_dim
        self.layer_idx = layer_idx
        self.q_size = cfg.num_heads * d
        self.kv_size = cfg.num_kv_heads * d
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = nn.Parameter(torch.empty(h, **kw), requires_grad=False)
        self.qkv_proj = nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, h, **kw),
                                     requires_grad=False)
        self.qkv_bias = (nn.Parameter(torch.empty(self.q_size + 2 * self.kv_size, **kw),
                                      requires_grad=False) if cfg.attention_bias else None)
        self.o_proj = nn.Parameter(torch.empty(h, self.q_size, **kw), requires_grad=False)
        self.o_bias = (nn.Parameter(torch.empty(h, **kw), requires_grad=False)
                       if cfg.attention_bias else None)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.empty(d, **kw), requires_grad=False)
            self.k_norm = nn.Parameter(torch.empty(d, **kw), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.empty(h, **kw), requires_grad=False)
        i = cfg.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = nn.Parameter(torch.empty(2 * i, h, **kw), requires_grad=False)
        self.gate_up_bias = (nn.Parameter(torch.empty(2 * i, **kw), requires_grad=False)
                             if cfg.mlp_bias else None)
        self.down_proj = nn.Parameter(torch.empty(h, i, **kw), requires_grad=False)
        self.down_bias = (nn.Parameter(torch.empty(h, **kw), requires_grad=False)
                          if cfg.mlp_bias else None)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                attn: TorchAttentionBackend) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        t = hidden.shape[0]
        x = rms_norm(hidden, self.input_layernorm, self.eps)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm, self.eps)
            k = rms_norm(k, self.k_norm, self.eps)
        q = apply_rotary(q, cos, sin)
        k = apply_rotary(k, cos, sin)
        o = attn.forward(self.layer_idx, q, k, v.contiguous(), kv_cache, meta)
        hidden = hidden + F.linear(o.reshape(t, self.q_size), self.o_proj, self.o_bias)
        x = rms_norm(hidden, self.post_attention_layernorm, self.eps)
        gate_up = F.linear(x, self.gate_up_proj, self.gate_up_bias)
        gate, up = gate_up.split([self.intermediate_size, self.intermediate_size], dim=-1)
        return hidden + F.linear(F.silu(gate) * up, self.down_proj, self.down_bias)

    def forward_fused(self, hidden: torch.Tensor, residual: torch.Tensor | None,
                      positions: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                      attend, kernels) -> tuple[torch.Tensor, torch.Tensor]:
        """The CUDA path of :meth:`forward` with the Triton kernels of
        :mod:`pdserve.model.triton_attention` (``kernels``): RMSNorm fused with the residual
        add, Qwen3's q/k norm fused with the rotary embedding (in place on the QKV output),
        SwiGLU in one pass. Launch shapes depend only on ``T``; nothing synchronises with the
        host, so it can be captured in a CUDA graph.

        Args:
            hidden: ``[T, hidden_size]``: this layer's input delta (the embeddings for layer 0).
            residual: ``[T, hidden_size]`` residual stream, or None for layer 0 (then ``hidden``
                is the stream). Updated in place.
            positions: ``[T]`` int64 positions.
            rope_cos, rope_sin: ``[max_positions, head_dim // 2]`` float32 tables.
            attend: ``attend(layer_idx, q, k, v) -> [T, num_heads, head_dim]``; writes K/V into
                the cache and attends (q, k, v are views into the QKV projection output).
            kernels: the :mod:`pdserve.model.triton_attention` module.

        Returns:
            ``(mlp_out, residual)``; the layer's output is their sum (added by the next norm).
        """
        t = hidden.shape[0]
        if residual is None:
            residual = hidden
            x = kernels.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            x = kernels.rms_norm(hidden, self.input_layernorm, self.eps, residual=residual)
        qkv = F.linear(x, self.qkv_proj, self.qkv_bias)
        q = qkv[:, :self.q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, self.q_size:self.q_size + self.kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].view(t, self.num_kv_heads, self.head_dim)
        kernels.rotary_embedding(q, positions, rope_cos, rope_sin, self.q_norm, self.eps)
        kernels.rotary_embedding(k, positions, rope_cos, rope_sin, self.k_norm, self.eps)
        o = attend(self.layer_idx, q, k, v)
        attn_out = F.linear(o.reshape(t, self.q_size), self.o_proj, self.o_bias)
        x = kernels.rms_norm(attn_out, self.post_attention_layernorm, self.eps, residual=residual)
        gate_up = F.linear(x, self.gate_up_proj, self.gate_up_bias)
        return F.linear(kernels.silu_and_mul(gate_up), self.down_proj, self.down_bias), residual


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# HF name inside a layer -> (our parameter, index of the shard inside the fused tensor or None)
_LAYER_MAP = {
    "self_attn.q_proj.weight": ("qkv_proj", 0),
    "self_attn.k_proj.weight": ("qkv_proj", 1),
    "self_attn.v_proj.weight": ("qkv_proj", 2),
    "self_attn.q_proj.bias": ("qkv_bias", 0),
    "self_attn.k_proj.bias": ("qkv_bias", 1),
    "self_attn.v_proj.bias": ("qkv_bias", 2),
    "self_attn.o_proj.weight": ("o_proj", None),
    "self_attn.o_proj.bias": ("o_bias", None),
    "self_attn.q_norm.weight": ("q_norm", None),
    "self_attn.k_norm.weight": ("k_norm", None),
    "input_layernorm.weight": ("input_layernorm", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", None),
    "mlp.gate_proj.weight": ("gate_up_proj", 0),
    "mlp.up_proj.weight": ("gate_up_proj", 1),
    "mlp.gate_proj.bias": ("gate_up_bias", 0),
    "mlp.up_proj.bias": ("gate_up_bias", 1),
    "mlp.down_proj.weight": ("down_proj", None),
    "mlp.down_proj.bias": ("down_bias", None),
}
# Buffers some checkpoints carry that the model recomputes.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CausalLM(nn.Module):
    """Llama / Mistral / Qwen3 causal language model over a paged KV cache.

    Args:
        cfg: architecture.
        dtype: parameter and activation dtype.
        device: where parameters live.
        block_size: KV cache block size in tokens.
        max_positions: size of the rotary table (positions ``0 .. max_positions - 1``).

    Parameters are allocated uninitialised; fill them with :meth:`load_weights` or
    :meth:`init_dummy_weights`.
    """

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_positions: int):
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw),
                                         requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = nn.Parameter(torch.empty(cfg.hidden_size, **kw), requires_grad=False)
        self.lm_head = (self.embed_tokens if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size, **kw),
                                     requires_grad=False))
        self.attn = make_attention_backend(device, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                           block_size, cfg.head_dim ** -0.5)
        # CUDA with the Triton attention backend: the fused-kernel path (forward_fused).
        self.kernels = None
        if isinstance(self.attn, TritonAttentionBackend):
            from pdserve.model import triton_attention

            self.kernels = triton_attention
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * rope_inv_freq(cfg)[None]
        self.register_buffer("rope_cos", freqs.cos().to(device), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(device), persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids (prefill tokens first, then decode tokens).
            positions: ``[T]`` int64 absolute positions.
            kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``.
            meta: attention metadata of the step.
            logits_indices: ``[S]`` int64 indices into the batch of the tokens to sample.

        Returns:
            ``[S, vocab_size]`` float32 logits.
        """
        if self.kernels is not None:
            def attend(layer_idx, q, k, v):
                return self.attn.forward(layer_idx, q, k, v, kv_cache, meta)

            return self._forward_fused(input_ids, positions, attend, logits_indices)
        hidden = F.embedding(input_ids, self.embed_tokens)
        cos = self.rope_cos[positions].to(self.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(self.dtype).unsqueeze(1)
        for layer in self.layers:
            hidden = layer(hidden, cos, sin, kv_cache, meta, self.attn)
        hidden = rms_norm(hidden[logits_indices], self.norm, self.cfg.rms_norm_eps)
        return F.linear(hidden, self.lm_head).float()

    def _forward_fused(self, input_ids: torch.Tensor, positions: torch.Tensor, attend,
                       logits_indices: torch.Tensor | None) -> torch.Tensor:
        """Embedding, the layers' :meth:`DecoderLayer.forward_fused` and the LM head (rows
        ``logits_indices``, all rows when None) -> ``[S, vocab]`` float32 logits."""
        kernels = self.kernels
        hidden = F.embedding(input_ids, self.embed_tokens)
        residual = None
        for layer in self.layers:
            hidden, residual = layer.forward_fused(hidden, residual, positions, self.rope_cos,
                                                   self.rope_sin, attend, kernels)
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        x = kernels.rms_norm(hidden, self.norm, self.cfg.rms_norm_eps, residual=residual)
        return F.linear(x, self.lm_head).float()

    @property
    def supports_decode_graphs(self) -> bool:
        """True when :meth:`decode_forward` can run (CUDA with the Triton backend)."""
        return self.kernels is not None

    @torch.inference_mode()
    def decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        """A pure-decode step (one token per sequence) that CUDA graphs can capture: fixed
        launch shapes for a batch size, no host synchronisation, every input a tensor.

        Args:
            input_ids: ``[B]`` int64 token ids.
            positions: ``[B]`` int64 positions of the new tokens.
            slot_mapping: ``[B]`` int64 KV cache slots of the new tokens (negative = padding row:
                its K/V is not written).
            block_tables: ``[B, max_blocks]`` int32 block ids.
            context_lens: ``[B]`` int32 tokens to attend to, the new one included (0 = padding
                row: attention output zeros).
            kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``.

        Returns:
            ``[B, vocab_size]`` float32 logits (padding rows hold garbage).

        Raises:
            RuntimeError: the model is not on the fused CUDA path.
        """
        if self.kernels is None:
            raise RuntimeError("decode_forward needs CUDA with the Triton attention backend")
        kernels = self.kernels
        scale = self.attn.scale

        def attend(layer_idx, q, k, v):
            kernels.store_kv_cache(k, v, kv_cache, layer_idx, slot_mapping)
            return kernels.paged_decode_attention(q, kv_cache, layer_idx, block_tables,
                                                  context_lens, scale)

        return self._forward_fused(input_ids, positions, attend, None)

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters.

        Accepts names with or without the ``model.`` prefix (``lm_head.weight`` stays as is).

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or parameters left unloaded.
        """
        cfg = self.cfg
        loaded: set[tuple[str, int | None]] = set()
        shard_sizes = {
            "qkv_proj": [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2,
            "gate_up_proj": [cfg.intermediate_size] * 2,
        }
        shard_sizes["qkv_bias"] = shard_sizes["qkv_proj"]
        shard_sizes["gate_up_bias"] = shard_sizes["gate_up_proj"]
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            short = name[len("model."):] if name.startswith("model.") else name
            if short == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some checkpoints store the tied copy; the embedding is the source
            target, key = self._target(short, shard_sizes)
            if target is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(key)
        missing = [n for n in self._expected_keys(shard_sizes) if n not in loaded]
        if missing:
            shown = ", ".join(f"{a}[{b}]" if b is not None else a for a, b in missing[:8])
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {shown}")

    def _target(self, short: str, shard_sizes: dict[str, list[int]]
                ) -> tuple[torch.Tensor | None, tuple[str, int | None]]:
        if short in ("embed_tokens.weight", "norm.weight", "lm_head.weight"):
            attr = short.split(".")[0]
            return getattr(self, attr).data, (attr, None)
        m = _LAYER_RE.match(short)
        if not m or m.group(2) not in _LAYER_MAP or int(m.group(1)) >= len(self.layers):
            return None, ("", None)
        layer = self.layers[int(m.group(1))]
        attr, shard = _LAYER_MAP[m.group(2)]
        param = getattr(layer, attr, None)
        if param is None:
            return None, ("", None)
        data = param.data
        if shard is not None:
            sizes = shard_sizes[attr]
            data = data.narrow(0, sum(sizes[:shard]), sizes[shard])
        return data, (f"layers.{m.group(1)}.{attr}", shard)

    def _expected_keys(self, shard_sizes: dict[str, list[int]]) -> list[tuple[str, int | None]]:
        keys: list[tuple[str, int | None]] = [("embed_tokens", None), ("norm", None)]
        if not self.cfg.tie_word_embeddings:
            keys.append(("lm_head", None))
        for i, layer in enumerate(self.layers):
            for attr, p in layer.named_parameters(recurse=False):
                if attr in shard_sizes:
                    keys += [(f"layers.{i}.{attr}", s) for s in range(len(shard_sizes[attr]))]
                else:
                    keys.append((f"layers.{i}.{attr}", None))
        return keys

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Fill every parameter with deterministic random values (``--load-format dummy``).

        Matrices get ``N(0, initializer_range)`` (the HF initialisation), norm weights 1 and
        biases 0, so activations stay finite at any depth. The same seed gives the same weights
        on the same device type.
        """
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed)
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("_bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
