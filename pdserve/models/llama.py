"""Llama-family decoder (Llama, Mistral-like, SmolLM2) and Qwen3, built from the layers of
:mod:`pdserve.layers` and an attention backend of :mod:`pdserve.attention`, over a paged KV cache.

The math follows the Hugging Face ``transformers`` implementations of ``LlamaForCausalLM`` and
``Qwen3ForCausalLM`` (RMSNorm in float32, rotate-half rotary embedding, SwiGLU MLP); Qwen3 adds
an RMSNorm over ``head_dim`` on each query and key head before the rotary embedding. Weights are
stored fused (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up) so that one matmul replaces
three (two); :meth:`CausalLM.load_weights` maps Hugging Face parameter names onto the fused
tensors through each parameter's ``weight_loader``.

There is one forward path, :meth:`CausalLM.forward`: the flattened tokens of a mixed batch
(prefill chunks and decodes), their positions, the KV cache and an
:class:`~pdserve.attention.metadata.AttentionMetadata`, returning logits for the tokens that are
sampled. It is written in stages, which the model runner may also call one by one:
:meth:`CausalLM.embed`, then per layer :meth:`DecoderLayer.attention_inputs` (norm, QKV
projection), :meth:`DecoderLayer.attend` (q/k norm and rotary, the KV write and paged attention,
all by the attention backend) and
:meth:`DecoderLayer.attention_output` (output projection, norm, MLP), then
:meth:`CausalLM.compute_logits`. Whether a stage runs eagerly or is replayed from a CUDA graph is
the runner's choice (a whole decode step; the stages between attentions of a small mixed step,
:mod:`pdserve.runner.piecewise_graphs`); which ops run (torch or Triton) follows the attention
backend, set in one place (:meth:`CausalLM.set_attention_backend`).

The parsed config, :class:`~pdserve.models.arch_config.ArchConfig`, is in
:mod:`pdserve.models.arch_config`; the other families (:mod:`pdserve.models.qwen3_moe`,
:mod:`pdserve.models.gemma3`) subclass this module's classes piece by piece.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from pdserve.attention.base import AttentionBackend
from pdserve.attention.kv_quant import KVCacheScales, projection_row_bounds, scale_for_bound
from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.selector import select_attention_backend
from pdserve.layers.activation import SiluAndMul
from pdserve.layers.custom_op import CustomOp
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.distributed.communication import tp_all_gather_object
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.layers.linear import MergedLinear, QKVLinear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers import rotary
from pdserve.models.arch_config import ArchConfig
from pdserve.models.stage_buffers import StageBuffers
from pdserve.layers.rotary import QKRotation, RotaryEmbedding

# What one decoder layer hands the next, ``[T, hidden_size]`` tensors: ``(embeddings,)`` into
# the first layer, then ``(mlp_out, residual)`` (Llama family) or ``(stream,)`` (Gemma 3). The
# model runner passes it along without looking inside (:mod:`pdserve.runner.piecewise_graphs`).
LayerState = tuple[torch.Tensor, ...]


class LlamaAttention(nn.Module):
    """Grouped-query self-attention: fused QKV projection, optional q/k norm, rotary embedding,
    paged attention through the model's backend, output projection. With tensor parallelism
    the QKV projection is column-parallel by heads and the output projection row-parallel, so
    a rank attends over its own heads only."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        d = cfg.head_dim
        self.layer_idx = layer_idx
        self.qkv_proj = QKVLinear(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, d,
                                  cfg.attention_bias or cfg.qkv_bias, dtype, device)
        # this rank's heads (all of them at TP 1)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = d
        self.o_proj = RowParallelLinear(cfg.num_heads * d, cfg.hidden_size, cfg.attention_bias,
                                        dtype, device)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device)
        self.rotary_emb = rotary_emb
        self.sliding_window = cfg.layer_sliding_window(layer_idx)
        self.backend: AttentionBackend | None = None  # set by CausalLM.set_attention_backend

    def project_qkv(self, hidden: torch.Tensor, qkv_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``hidden`` ``[T, hidden_size]`` (normalised) -> queries ``[T, num_heads, head_dim]``,
        keys and values ``[T, num_kv_heads, head_dim]`` as projected (the q/k norms and the
        rotary embedding are applied in :meth:`attend`); strided views of one projection,
        written into ``qkv_out`` (``[T, q_size + 2 * kv_size]``) when given
        (:meth:`pdserve.layers.linear.MergedLinear.project_into`)."""
        t = hidden.shape[0]
        q, k, v = self.split_qkv(hidden, qkv_out)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def split_qkv(self, hidden: torch.Tensor, qkv_out: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The QKV projection of ``hidden`` ``[T, hidden_size]`` (into ``qkv_out``
        ``[T, q_size + 2 * kv_size]`` when given), as views ``[T, q_size]``,
        ``[T, kv_size]``, ``[T, kv_size]``."""
        if qkv_out is None:
            return self.qkv_proj.split(self.qkv_proj(hidden))
        return self.qkv_proj.split(self.qkv_proj.project_into(hidden, qkv_out))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Norm and rotate queries and keys (:meth:`rotation`), write this layer's K/V of the
        step into ``kv_cache`` and attend, all through the model's backend
        (:meth:`pdserve.attention.base.AttentionBackend.forward`, with ``out``)."""
        return self.backend.forward(self.layer_idx, q, k, v, kv_cache, meta,
                                    sliding_window=self.sliding_window, out=out,
                                    rotation=self.rotation(positions))

    def rotation(self, positions: torch.Tensor) -> QKRotation:
        """The q/k norms (when the model has them) and the rotary embedding at ``positions``
        ``[T]``."""
        return QKRotation(self.rotary_emb, positions, self.q_norm, self.k_norm)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, num_heads, head_dim]`` -> ``[T, hidden_size]``."""
        return self.o_proj(o.reshape(o.shape[0], self.qkv_proj.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: fused gate|up projection (column-parallel), ``silu(gate) * up``, down
    projection (row-parallel)."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device):
        super().__init__()
        i, h = cfg.intermediate_size, cfg.hidden_size
        self.gate_up_proj = MergedLinear(h, [i, i], cfg.mlp_bias, dtype, device)
        self.act = SiluAndMul()
        self.down_proj = RowParallelLinear(i, h, cfg.mlp_bias, dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """One pre-norm decoder layer: attention then MLP, each after an RMSNorm that also adds the
    previous block's output to the residual stream."""

    def __init__(self, cfg: ArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, layer_idx, rotary_emb, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp = self.make_mlp(cfg, layer_idx, dtype, device)

    def make_mlp(self, cfg: ArchConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> nn.Module:
        """The layer's feed-forward block (a dense SwiGLU MLP; families with another one, e.g.
        mixture-of-experts, override this)."""
        return LlamaMLP(cfg, dtype, device)

    def attention_inputs(self, state: LayerState, qkv_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LayerState]:
        """The part of the layer before attention: the input norm (adding the previous layer's
        output to the residual stream) and the query/key/value projection.

        Args:
            state: ``(hidden, residual)`` from :meth:`CausalLM.embed` (``(embeddings,)``) or
                the previous layer's :meth:`attention_output`.
            qkv_out: optional buffer the projection writes into (as
                :meth:`LlamaAttention.project_qkv`).

        Returns:
            ``(q, k, v, state)``: as :meth:`LlamaAttention.project_qkv` (not yet rotated), and
            the state that :meth:`attention_output` takes.
        """
        if len(state) == 1:  # layer 0: the embeddings are the residual stream
            residual = state[0]
            x = self.input_layernorm(residual)
        else:
            x, residual = self.input_layernorm(*state)
        q, k, v = self.self_attn.project_qkv(x, qkv_out)
        return q, k, v, (residual,)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """The layer's attention (:meth:`LlamaAttention.attend`, which rotates ``q`` and ``k``
        at ``positions`` ``[T]``): ``[T, num_heads, head_dim]``."""
        return self.self_attn.attend(q, k, v, positions, kv_cache, meta, out)

    def attention_output(self, o: torch.Tensor, state: LayerState) -> LayerState:
        """The part of the layer after attention: output projection, post-attention norm
        (adding to the residual stream) and MLP.

        Args:
            o: ``[T, num_heads, head_dim]`` from :meth:`attend`.
            state: from :meth:`attention_inputs`.

        Returns:
            ``(mlp_out, residual)``, each ``[T, hidden_size]``; the layer's output is their sum
            (added by the next norm).
        """
        x, residual = self.post_attention_layernorm(self.self_attn.project_out(o), state[0])
        return self.mlp(x), residual

    def forward(self, positions: torch.Tensor, state: LayerState, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> LayerState:
        """One layer: :meth:`attention_inputs`, :meth:`attend`, :meth:`attention_output`.

        Args:
            positions: ``[T]`` int64 positions.
            state: as :meth:`attention_inputs`.
            kv_cache, meta: as :meth:`CausalLM.forward`.
        """
        q, k, v, state = self.attention_inputs(state)
        return self.attention_output(self.attend(q, k, v, positions, kv_cache, meta), state)


# HF projection names stored stacked in one of our parameters -> (our name, shard index).
_STACKED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
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
    :meth:`init_dummy_weights`. The attention backend comes from
    :func:`pdserve.attention.selector.select_attention_backend`.

    Attributes:
        attn_backend: the attention backend every layer uses.
        decoder_layer_cls: the class of each decoder layer (families subclass it).
    """

    decoder_layer_cls: type[DecoderLayer] = DecoderLayer

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        rotary_emb = rotary.rotary_embedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling,
                                             max_positions, device)
        self.layers = nn.ModuleList(
            self.decoder_layer_cls(cfg, i, rotary_emb, dtype, device)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device,
                              tie_to=self.embed_tokens if cfg.tie_word_embeddings else None)
        attn = self.layers[0].self_attn  # this rank's heads
        self.set_attention_backend(select_attention_backend(
            device, attn.num_heads, attn.num_kv_heads, cfg.head_dim, block_size,
            cfg.head_dim ** -0.5))

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Use ``backend`` in every layer, and the layers' Triton ops exactly when the backend
        says so (``backend.uses_triton_kernels``): the one place where the op choice is made."""
        self.attn_backend = backend
        for layer in self.layers:
            layer.self_attn.backend = backend
        for module in self.modules():
            if isinstance(module, CustomOp):
                module.use_triton = backend.uses_triton_kernels

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Run one step.

        Args:
            input_ids: ``[T]`` int64 token ids (prefill tokens first, then decode tokens).
            positions: ``[T]`` int64 absolute positions.
            kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; this
                step's K/V are written into it.
            attn_metadata: attention metadata of the step.
            logits_indices: ``[S]`` int64 indices into the batch of the tokens to sample; None =
                every token (a CUDA-graph decode step).

        Returns:
            ``[S, vocab_size]`` logits in the model's dtype (``S = T`` without
            ``logits_indices``); float32 where the model post-processes them (Gemma 3's final
            soft-capping).
        """
        state = self.embed(input_ids)
        for layer in self.layers:
            state = layer(positions, state, kv_cache, attn_metadata)
        return self.compute_logits(state, logits_indices)

    def embed(self, input_ids: torch.Tensor) -> LayerState:
        """The first layer's state: ``(embeddings,)``, ``[T, hidden_size]``."""
        return (self.embed_tokens(input_ids),)

    def stage_buffers(self, num_tokens: int) -> StageBuffers:
        """Zeroed buffers of ``num_tokens`` rows between this model's stages
        (:class:`~pdserve.models.stage_buffers.StageBuffers`): the fused QKV projection writes
        into one buffer whose views are the queries, keys and values (this rank's heads)."""
        attn = self.layers[0].self_attn
        n, d = num_tokens, attn.head_dim
        qkv = torch.zeros(n, attn.qkv_proj.output_size, dtype=self.dtype, device=self.device)
        q, k, v = (t.view(n, heads, d) for t, heads in zip(
            attn.qkv_proj.split(qkv), (attn.num_heads, attn.num_kv_heads, attn.num_kv_heads)))
        out = torch.zeros(n, attn.num_heads, d, dtype=self.dtype, device=self.device)
        return StageBuffers(qkv, (q, k, v), out)

    def compute_logits(self, state: LayerState,
                       logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """The last layer's state -> logits ``[S, vocab_size]`` of the rows ``logits_indices``
        (every row when None), as :meth:`forward` returns them."""
        hidden, residual = state
        if logits_indices is not None:
            hidden, residual = hidden[logits_indices], residual[logits_indices]
        x, _ = self.norm(hidden, residual)
        return self.lm_head(x)

    # ---------------------------------------------------------------- weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (fused) parameters, each through its
        parameter's ``weight_loader``.

        Accepts names with or without the ``model.`` prefix (``lm_head.weight`` stays as is).

        Raises:
            ValueError: an unknown tensor name, a shape mismatch, or parameters left unloaded.
        """
        cfg = self.cfg
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int | None]] = set()
        for name, tensor in weights:
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            short = name[len("model."):] if name.startswith("model.") else name
            if short == "lm_head.weight" and cfg.tie_word_embeddings:
                continue  # some checkpoints store the tied copy; the embedding is the source
            target, shard = self._param_name(short)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            try:
                param.weight_loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"weight {name!r} has {e}") from None
            loaded.add((target, shard))
        expected = [(n, s if p.num_shards > 1 else None) for n, p in params.items()
                    for s in range(p.num_shards)]
        missing = [k for k in expected if k not in loaded]
        if missing:
            shown = ", ".join(f"{a}[{b}]" if b is not None else a for a, b in missing[:8])
            raise ValueError(f"checkpoint is missing {len(missing)} weights, e.g. {shown}")

    @torch.inference_mode()
    def kv_cache_scales(self) -> KVCacheScales:
        """Per-layer scales of an fp8 KV cache from the weights: an upper bound of every key and
        value a layer can produce, over 448, rounded up to a power of two (the method and why:
        :mod:`pdserve.attention.kv_quant`). The norms' gains come from ``norm.gain()`` (Gemma's
        is ``1 + weight``). Under tensor parallelism each rank bounds its own heads and every
        rank then takes the largest scale of each layer, so all ranks (and instances of other
        TP sizes) store with the scales of TP 1."""
        k_scales, v_scales = [], []
        for layer in self.layers:
            attn = layer.self_attn
            qkv = attn.qkv_proj
            q, kv = qkv.q_size, qkv.kv_size
            w, b, g = qkv.weight, qkv.bias, layer.input_layernorm.gain()
            if attn.k_norm is not None:  # per-head RMS norm: |k| <= max|g_k| * sqrt(head_dim)
                k_bound = attn.k_norm.gain().float().abs().max().item() * math.sqrt(attn.head_dim)
            else:  # a rotary pair keeps its norm: at most sqrt(2) times the larger bound
                k_bound = math.sqrt(2) * projection_row_bounds(
                    w[q:q + kv], g, None if b is None else b[q:q + kv]).max().item()
            v_bound = projection_row_bounds(
                w[q + kv:], g, None if b is None else b[q + kv:]).max().item()
            k_scales.append(scale_for_bound(k_bound))
            v_scales.append(scale_for_bound(v_bound))
        if get_tp_size() > 1:  # every rank bounds its own heads: all ranks take the largest
            per_rank = tp_all_gather_object((k_scales, v_scales))
            k_scales = [max(r[0][i] for r in per_rank) for i in range(len(k_scales))]
            v_scales = [max(r[1][i] for r in per_rank) for i in range(len(v_scales))]
        return KVCacheScales(tuple(k_scales), tuple(v_scales))

    @staticmethod
    def _param_name(short: str) -> tuple[str, int | None]:
        """Our parameter name and shard index of a Hugging Face name without ``model.``."""
        parts = short.split(".")
        if len(parts) >= 2 and parts[-2] in _STACKED:
            fused, shard = _STACKED[parts[-2]]
            return ".".join(parts[:-2] + [fused, parts[-1]]), shard
        return short, None

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Fill every parameter with deterministic random values (``--load-format dummy``).

        Matrices get ``N(0, initializer_range)`` (the HF initialisation), norm weights 1 and
        biases 0, so activations stay finite at any depth. The same seed gives the same weights
        on the same device type; each tensor-parallel rank draws its own shard from its own
        stream (rank 0's is the TP 1 stream), so no rank builds the whole model.
        """
        gen = torch.Generator(device=self.device)
        gen.manual_seed(seed + 1_000_003 * get_tp_rank())
        std = self.cfg.initializer_range
        for name, p in self.named_parameters():
            if p.dim() == 1:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
