"""DeepSeek-V2 / V3 (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``): multi-head latent
attention over a paged latent cache (:mod:`pdserve.attention.mla`) and DeepSeek-MoE feed-forward
blocks (:mod:`pdserve.layers.deepseek_moe`) after the first dense layers.

The math follows Hugging Face ``transformers``' ``modeling_deepseek_v2.py`` and
``modeling_deepseek_v3.py``: queries through ``q_proj`` or, with ``q_lora_rank``, through
``q_a_proj``, ``q_a_layernorm`` and ``q_b_proj``; ``kv_a_proj_with_mqa`` gives the latent ``c``
(normalised by ``kv_a_layernorm``) and the shared rotary key ``k_pe``; ``kv_b_proj``
up-projects ``c`` to per-head keys and values. DeepSeek rotates interleaved pairs
``(x0, x1), (x2, x3), ...`` (V2 always, V3 with ``rope_interleave``); here the rotary dims are
de-interleaved first (evens then odds) and rotated as halves, which gives the same dot products
(queries and keys are permuted alike) with the shared :class:`RotaryEmbedding`. YaRN scales the
cos/sin tables by ``mscale / mscale_all_dim`` (:func:`pdserve.layers.rotary.rope_parameters`)
and the softmax scale by ``mscale_all_dim``'s factor squared (:func:`softmax_scale`).

The cache geometry the rest of the engine sees is one KV head (replicated over tensor-parallel
ranks) of ``head_dim = (kv_lora_rank + qk_rope_head_dim) / 2`` (:class:`DeepseekArchConfig`).
Under tensor parallelism the query and ``kv_b_proj`` rows and the ``o_proj`` columns are split by
heads, ``kv_a_proj_with_mqa`` is replicated, the dense and shared-expert MLPs split as Llama's,
and the routed experts split their intermediate size the same way
(:class:`~pdserve.layers.deepseek_moe.ShardedExperts`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pdserve.attention.kv_quant import KVCacheScales, projection_row_bounds, scale_for_bound
from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.mla import MLAAttentionBackend, MLAGeometry
from pdserve.attention.selector import select_mla_backend
from pdserve.distributed.communication import tp_all_gather_object
from pdserve.distributed.parallel_state import get_tp_size
from pdserve.layers import rotary
from pdserve.layers.deepseek_moe import DeepseekMoE, DeepseekMoEConfig, RouterScoring
from pdserve.layers.embedding import LMHead, VocabEmbedding
from pdserve.layers.linear import Linear, MergedLinear, RowParallelLinear
from pdserve.layers.norm import RMSNorm
from pdserve.layers.rotary import RotaryEmbedding
from pdserve.layers.weights import LoadedWeight
from pdserve.models.arch_config import ArchConfig
from pdserve.models.llama import CausalLM, DecoderLayer, LayerState, LlamaMLP
from pdserve.models.qwen3_moe import Qwen3MoeCausalLM
from pdserve.models.stage_buffers import StageBuffers

ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass
class DeepseekArchConfig(ArchConfig):
    """:class:`ArchConfig` of a DeepSeek model, with the MLA and MoE fields.

    ``num_kv_heads`` (1) and ``head_dim`` (``(kv_lora_rank + qk_rope_head_dim) / 2``) describe
    the latent cache as the runner allocates it (:mod:`pdserve.attention.mla`), not the
    attention heads; ``num_heads`` is the query heads.

    Attributes:
        q_lora_rank: the query's low-rank width, None for a direct ``q_proj`` (V2-Lite).
        kv_lora_rank: the latent width ``r``.
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim: per-head query/key dims without and
            with rotary, value dims.
        rope_interleave: the rotary dims come in interleaved pairs (V2; V3's default).
        deepseek_moe: the MoE settings, None for a dense model.
    """

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True
    deepseek_moe: DeepseekMoEConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        """Per-head query/key dims: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _positive_int(hf: dict[str, Any], key: str, default: Any = None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"DeepSeek config needs a positive integer {key!r}, got {value!r}")
    return value


def deepseek_moe_config(hf: dict[str, Any], arch: str) -> DeepseekMoEConfig | None:
    """The :class:`DeepseekMoEConfig` of a config, None without routed experts.

    V2 routes by softmax, over groups only with ``topk_method = group_limited_greedy``; V3 by
    sigmoid with ``e_score_correction_bias`` over ``n_group`` groups (``topk_method
    noaux_tc``).

    ``norm_topk_prob`` is honoured for both, as DeepSeek's own code does (Hugging Face's V2
    router ignores it; the published V2 configs set it false).

    Raises:
        ValueError: a missing or inconsistent key, an unknown ``topk_method``, or a
            ``scoring_func`` other than the version's.
    """
    num_experts = hf.get("n_routed_experts")
    if not num_experts:
        return None
    num_experts = _positive_int(hf, "n_routed_experts")
    top_k = _positive_int(hf, "num_experts_per_tok")
    if top_k > num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} exceeds n_routed_experts={num_experts}")
    v3 = arch == "DeepseekV3ForCausalLM"
    method = hf.get("topk_method") or ("noaux_tc" if v3 else "greedy")
    known = ("noaux_tc",) if v3 else ("greedy", "group_limited_greedy")
    if method not in known:
        raise ValueError(f"{arch} with topk_method={method!r} is not supported "
                         f"(supported: {', '.join(known)})")
    scoring = hf.get("scoring_func") or ("sigmoid" if v3 else "softmax")
    if scoring != ("sigmoid" if v3 else "softmax"):
        raise ValueError(f"{arch} with scoring_func={scoring!r} is not supported")
    grouped = v3 or method == "group_limited_greedy"
    num_groups = _positive_int(hf, "n_group", 1) if grouped else 1
    topk_groups = _positive_int(hf, "topk_group", 1) if grouped else 1
    if num_experts % num_groups or topk_groups > num_groups:
        raise ValueError(f"n_group={num_groups} / topk_group={topk_groups} do not fit "
                         f"{num_experts} experts")
    if v3 and num_experts // num_groups < 2:
        raise ValueError("DeepSeek-V3 routing rates a group by its two best experts: n_group "
                         f"={num_groups} leaves fewer than two of {num_experts} per group")
    return DeepseekMoEConfig(
        num_experts=num_experts, top_k=top_k,
        moe_intermediate_size=_positive_int(hf, "moe_intermediate_size"),
        num_shared_experts=int(hf.get("n_shared_experts") or 0),
        scoring=RouterScoring.SIGMOID if v3 else RouterScoring.SOFTMAX,
        num_groups=num_groups, topk_groups=topk_groups,
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
        first_k_dense_replace=int(hf.get("first_k_dense_replace", 0)),
        moe_layer_freq=int(hf.get("moe_layer_freq", 1) or 1))


def deepseek_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The :class:`DeepseekArchConfig` fields beyond :class:`ArchConfig`'s Llama ones, and the
    cache geometry (``num_kv_heads = 1``, ``head_dim = W / 2``) that replaces the Llama parse's.

    Raises:
        ValueError: a missing MLA key, an odd latent entry width, or a bad MoE setting.
    """
    q_lora = hf.get("q_lora_rank")
    fields: dict[str, Any] = dict(
        q_lora_rank=None if q_lora is None else _positive_int(hf, "q_lora_rank"),
        kv_lora_rank=_positive_int(hf, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(hf, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive_int(hf, "qk_rope_head_dim"),
        v_head_dim=_positive_int(hf, "v_head_dim"),
        rope_interleave=(True if arch == "DeepseekV2ForCausalLM"
                         else bool(hf.get("rope_interleave", True))),
        deepseek_moe=deepseek_moe_config(hf, arch))
    geometry = MLAGeometry(int(hf["num_attention_heads"]), fields["kv_lora_rank"],
                           fields["qk_nope_head_dim"], fields["qk_rope_head_dim"],
                           fields["v_head_dim"])
    fields.update(num_kv_heads=1, head_dim=geometry.slot_width)
    return fields


def softmax_scale(cfg: DeepseekArchConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``(0.1 * mscale_all_dim * ln(factor) + 1) ** 2`` for a
    scaled rotary with ``mscale_all_dim`` (Hugging Face ``yarn_apply_mscale``)."""
    scale = cfg.qk_head_dim ** -0.5
    s = cfg.rope_scaling or {}
    mscale_all_dim = s.get("mscale_all_dim")
    factor = float(s.get("factor") or 1.0)
    if s and mscale_all_dim and factor > 1:
        m = 0.1 * float(mscale_all_dim) * math.log(factor) + 1.0
        scale *= m * m
    return scale


class ColumnParallelLinear(MergedLinear):
    """One column-parallel projection (output rows split in equal contiguous ranges, i.e. by
    heads for a per-head layout), loaded from one checkpoint tensor without a shard id."""

    def __init__(self, input_size: int, output_size: int, bias: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__(input_size, [output_size], bias, dtype, device)

    @property
    def num_shards(self) -> int:
        """One checkpoint tensor."""
        return 1

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight,
                      shard_id: int | None = None) -> None:
        """Copy this rank's rows of the checkpoint tensor (``shard_id`` must be None).

        Raises:
            ValueError: a shard id, or a shape mismatch.
        """
        if shard_id is not None:
            raise ValueError(f"shard {shard_id} given for an unsharded parameter")
        super().weight_loader(param, loaded, 0)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` with interleaved rotary pairs -> evens then odds (rotate-half layout)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class DeepseekAttention(nn.Module):
    """Multi-head latent attention of one layer: the query and latent projections, the rotary
    embedding of ``q_pe`` / ``k_pe``, attention by the model's :class:`MLAAttentionBackend`,
    and ``o_proj``."""

    def __init__(self, cfg: DeepseekArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.layer_idx = layer_idx
        self.cfg = cfg
        h = cfg.num_heads
        q_out = h * cfg.qk_head_dim
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if cfg.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, q_out, False, dtype, device)
            self.num_heads = self.q_proj.output_size // cfg.qk_head_dim
        else:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, cfg.attention_bias, dtype,
                                   device)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, q_out, False, dtype, device)
            self.num_heads = self.q_b_proj.output_size // cfg.qk_head_dim
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                                         cfg.attention_bias, dtype, device)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = ColumnParallelLinear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dtype, device)
        self.o_proj = RowParallelLinear(h * cfg.v_head_dim, cfg.hidden_size, cfg.attention_bias,
                                        dtype, device)
        self.rotary_emb = rotary_emb
        self.backend: MLAAttentionBackend | None = None  # set by CausalLM.set_attention_backend

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` (normalised) -> queries ``[T, H, qk_head_dim]`` and the latent
        projection ``[T, kv_lora_rank + qk_rope_head_dim]`` (``c`` not yet normalised, ``k_pe``
        not yet rotated)."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.cfg.qk_head_dim), self.kv_a_proj_with_mqa(x)

    def attend(self, q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """Normalise the latent, rotate ``q_pe`` and ``k_pe`` at ``positions`` ``[T]``, write
        the latent entries and attend (:meth:`MLAAttentionBackend.forward_mla`):
        ``[T, H, v_head_dim]`` (``out`` when given). ``q`` and ``kv_a`` are not modified (the
        Triton rotary embedding rotates in place: on a copy of the rotary parts)."""
        cfg = self.cfg
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        c, k_pe = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        k_pe = k_pe.unsqueeze(1)
        if cfg.rope_interleave:
            q_pe, k_pe = deinterleave(q_pe), deinterleave(k_pe)
        else:
            q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe)
        entry = torch.cat((c, k_pe.squeeze(1)), dim=-1)
        return self.backend.forward_mla(self.layer_idx, q_nope, q_pe, entry,
                                        self.kv_b_proj.weight, kv_cache, meta, out)

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """Attention output ``[T, H, v_head_dim]`` -> ``[T, hidden_size]``."""
        return self.o_proj(o.reshape(o.shape[0], -1))


class DeepseekDecoderLayer(DecoderLayer):
    """A pre-norm DeepSeek layer: MLA, then a dense SwiGLU MLP (the first
    ``first_k_dense_replace`` layers) or DeepSeek-MoE.

    Its stages keep :class:`DecoderLayer`'s names: :meth:`attention_inputs` returns
    ``(q, kv_a, None, state)`` (queries and the latent projection,
    :meth:`DeepseekAttention.project`), :meth:`attend` takes them and returns
    ``[T, H, v_head_dim]``.
    """

    def __init__(self, cfg: DeepseekArchConfig, layer_idx: int, rotary_emb: RotaryEmbedding,
                 dtype: torch.dtype, device: torch.device):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = DeepseekAttention(cfg, layer_idx, rotary_emb, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                device)
        self.mlp = self.make_mlp(cfg, layer_idx, dtype, device)

    def make_mlp(self, cfg: DeepseekArchConfig, layer_idx: int, dtype: torch.dtype,
                 device: torch.device) -> nn.Module:
        """DeepSeek-MoE in MoE layers (with shared experts of ``num_shared_experts *
        moe_intermediate_size``), else the dense MLP (``intermediate_size``)."""
        moe = cfg.deepseek_moe
        if moe is None or not moe.is_moe_layer(layer_idx):
            return LlamaMLP(cfg, dtype, device)
        shared = None
        if moe.num_shared_experts:
            width = moe.num_shared_experts * moe.moe_intermediate_size
            shared = LlamaMLP(_with_intermediate(cfg, width), dtype, device)
        return DeepseekMoE(cfg.hidden_size, moe, shared, dtype, device)

    def attention_inputs(self, state: LayerState, qkv_out: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor, None, LayerState]:
        """The input norm and the query/latent projections (``qkv_out`` is not supported and
        must be None): ``(q, kv_a, None, (residual,))``."""
        assert qkv_out is None, "MLA layers project into no buffer"
        if len(state) == 1:
            residual = state[0]
            x = self.input_layernorm(residual)
        else:
            x, residual = self.input_layernorm(*state)
        q, kv_a = self.self_attn.project(x)
        return q, kv_a, None, (residual,)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: None, positions: torch.Tensor,
               kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor | None = None
               ) -> torch.Tensor:
        """:meth:`DeepseekAttention.attend` of ``q`` and the latent projection ``k`` (``v``
        unused, None), into ``out`` (``[T, H, v_head_dim]``) when given."""
        assert v is None, "MLA layers take queries and the latent projection"
        return self.self_attn.attend(q, k, positions, kv_cache, meta, out)


def _beyond_layers(name: str, num_layers: int) -> bool:
    """Whether checkpoint tensor ``name`` belongs to a decoder layer ``>= num_layers``."""
    parts = name.removeprefix("model.").split(".")
    return len(parts) > 2 and parts[0] == "layers" and parts[1].isdigit() \
        and int(parts[1]) >= num_layers


def _with_intermediate(cfg: DeepseekArchConfig, width: int) -> DeepseekArchConfig:
    """``cfg`` with ``intermediate_size = width`` (the shared experts' MLP)."""
    return dataclasses.replace(cfg, intermediate_size=width)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek-V2 / V3 causal language model over a paged latent cache (same interface as
    :class:`pdserve.models.llama.CausalLM`; the attention backend is an
    :class:`MLAAttentionBackend`, its Triton subclass on CUDA: :func:`select_mla_backend`).

    Raises:
        ValueError: ``cfg`` is not a :class:`DeepseekArchConfig`, or an unsupported rope type.
    """

    decoder_layer_cls = DeepseekDecoderLayer

    def __init__(self, cfg: DeepseekArchConfig, dtype: torch.dtype, device: torch.device,
                 block_size: int, max_positions: int):
        if not isinstance(cfg, DeepseekArchConfig):
            raise ValueError(f"{cfg.architecture} needs a DeepseekArchConfig")
        nn.Module.__init__(self)
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        rotary_emb = rotary.rotary_embedding(cfg.qk_rope_head_dim, cfg.rope_theta,
                                             cfg.rope_scaling, max_positions, device)
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(cfg, i, rotary_emb, dtype, device)
            for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device,
                              tie_to=self.embed_tokens if cfg.tie_word_embeddings else None)
        attn = self.layers[0].self_attn
        geometry = MLAGeometry(attn.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                               cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.set_attention_backend(select_mla_backend(device, geometry, block_size,
                                                      softmax_scale(cfg)))

    def stage_buffers(self, num_tokens: int) -> StageBuffers:
        """Zeroed buffers of ``num_tokens`` rows between this model's stages: the queries
        ``[N, H, qk_head_dim]`` and the latent projection ``[N, kv_lora_rank +
        qk_rope_head_dim]`` (copied in: MLA layers project into no buffer) and the attention
        output ``[N, H, v_head_dim]``."""
        cfg, attn = self.cfg, self.layers[0].self_attn
        kw = {"dtype": self.dtype, "device": self.device}
        q = torch.zeros(num_tokens, attn.num_heads, cfg.qk_head_dim, **kw)
        kv_a = torch.zeros(num_tokens, cfg.kv_lora_rank + cfg.qk_rope_head_dim, **kw)
        out = torch.zeros(num_tokens, attn.num_heads, cfg.v_head_dim, **kw)
        return StageBuffers(None, (q, kv_a, None), out)

    @staticmethod
    def _param_name(short: str) -> tuple[str, int | None]:
        """Attention weights keep their Hugging Face names; experts and MLPs as
        :meth:`Qwen3MoeCausalLM._param_name` (per-expert tensors into the stacked ones, the
        dense and shared MLPs' gate|up fused)."""
        parts = short.split(".")
        if len(parts) >= 4 and parts[2] == "self_attn":
            return short, None
        return Qwen3MoeCausalLM._param_name(short)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """:meth:`CausalLM.load_weights`, skipping the layers past ``num_hidden_layers`` that
        V3 checkpoints carry for multi-token prediction (``num_nextn_predict_layers``), which
        serving does not run.

        Raises:
            ValueError: as :meth:`CausalLM.load_weights`.
        """
        n = self.cfg.num_layers
        super().load_weights((name, t) for name, t in weights if not _beyond_layers(name, n))

    @torch.inference_mode()
    def kv_cache_scales(self) -> KVCacheScales:
        """Per-layer fp8 scales of the latent cache: the K slot (the latent's first half)
        is bounded by the ``kv_a_layernorm`` (``|c_i| <= max|g| * sqrt(kv_lora_rank)``), the V
        slot also holds ``k_pe``, which a rotation keeps within ``sqrt(2)`` times the larger
        bound of its projection rows (the method: :mod:`pdserve.attention.kv_quant`). Every TP
        rank holds the whole latent, so they compute the same scales."""
        k_scales, v_scales = [], []
        cfg = self.cfg
        for layer in self.layers:
            attn = layer.self_attn
            c_bound = (attn.kv_a_layernorm.gain().float().abs().max().item()
                       * math.sqrt(cfg.kv_lora_rank))
            w, b = attn.kv_a_proj_with_mqa.weight, attn.kv_a_proj_with_mqa.bias
            r = cfg.kv_lora_rank
            pe_bound = math.sqrt(2) * projection_row_bounds(
                w[r:], layer.input_layernorm.gain(), None if b is None else b[r:]).max().item()
            k_scales.append(scale_for_bound(c_bound))
            v_scales.append(scale_for_bound(max(c_bound, pe_bound)))
        if get_tp_size() > 1:  # identical on every rank; gathered to stay one rule with Llama's
            per_rank = tp_all_gather_object((k_scales, v_scales))
            k_scales = [max(r[0][i] for r in per_rank) for i in range(len(k_scales))]
            v_scales = [max(r[1][i] for r in per_rank) for i in range(len(v_scales))]
        return KVCacheScales(tuple(k_scales), tuple(v_scales))
