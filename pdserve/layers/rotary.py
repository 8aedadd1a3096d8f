"""Rotary position embedding (rotate-half layout) with its frequency table, optionally preceded
by a per-head RMSNorm (Qwen3's q/k norm)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.layers.custom_op import CustomOp
from pdserve.layers.norm import RMSNorm


#: ``rope_type`` values :func:`rope_parameters` implements (Hugging Face names).
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
# Keys each scaled type needs in its ``rope_scaling`` dict (the others have HF defaults).
_REQUIRED_KEYS = {"linear": ("factor",), "dynamic": ("factor", "original_max_position_embeddings"),
                  "llama3": ("factor",), "yarn": ("original_max_position_embeddings",)}


def rope_type_of(scaling: dict | None) -> str:
    """The ``rope_type`` of a Hugging Face ``rope_scaling`` / ``rope_parameters`` dict (the
    legacy key ``type`` too); ``default`` for None."""
    scaling = scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def validate_rope_scaling(scaling: dict | None) -> None:
    """Check a ``rope_scaling`` dict once, at start-up.

    Raises:
        ValueError: an unsupported ``rope_type`` (named, with the supported ones), or a required
            parameter missing or not positive.
    """
    rope_type = rope_type_of(scaling)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r} (supported: "
                         + ", ".join(SUPPORTED_ROPE_TYPES) + ")")
    for key in _REQUIRED_KEYS.get(rope_type, ()):
        value = (scaling or {}).get(key)
        if value is None or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"rope scaling {rope_type!r} needs a positive {key!r}, got {value!r}")


def _yarn(inv_freq: torch.Tensor, dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al., *YaRN: Efficient Context Window Extension of Large Language Models*,
    2023), as Hugging Face ``_compute_yarn_parameters`` computes it: frequencies interpolated by
    ``factor`` below a ramp between the dims that rotate ``beta_slow`` and ``beta_fast`` times
    over ``original_max_position_embeddings``, kept above it; cos/sin scaled by
    ``attention_factor`` (default ``0.1 * ln(factor) + 1``, or the ``mscale`` /
    ``mscale_all_dim`` ratio)."""
    old_len = float(s["original_max_position_embeddings"])
    factor = s.get("factor")
    factor = float(factor) if factor else float(s["max_position_embeddings"]) / old_len

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
    return inv_freq, float(attention_factor)


def rope_parameters(head_dim: int, theta: float, scaling: dict | None,
                    max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32) and the factor that scales
    cos/sin (1.0 except for ``yarn``), for a Hugging Face ``rope_scaling`` dict.

    - ``default``: ``theta ** (-2i / head_dim)`` (Su et al., RoFormer).
    - ``linear``: divided by ``factor`` (position interpolation, Chen et al., 2023).
    - ``llama3``: the frequency-dependent rescaling published with Llama 3.1 (low frequencies
      divided by ``factor``, high ones kept, a smooth ramp in between, with ``low_freq_factor``,
      ``high_freq_factor`` and ``original_max_position_embeddings``).
    - ``yarn``: see :func:`_yarn`; static, as in Hugging Face.
    - ``dynamic`` (NTK-aware, as Hugging Face ``_compute_dynamic_ntk_parameters``): Hugging Face
      recomputes the base for the current sequence length once it passes
      ``original_max_position_embeddings`` (the config's ``max_position_embeddings``), so a
      token's frequencies depend on how long its sequence had grown when it was computed, which
      a KV cache shared between requests and instances cannot honour. Here the frequencies are
      fixed per instance: the default ones while ``max_positions`` (the engine's context) stays
      within ``original_max_position_embeddings`` (then equal to Hugging Face at every length),
      else the ones Hugging Face uses for a sequence of ``max_positions`` tokens (as vLLM does
      for its longest context).

    Args:
        head_dim: rotated dims per head.
        theta: the rotary base.
        scaling: None or a Hugging Face ``rope_scaling`` dict (checked by
            :func:`validate_rope_scaling`).
        max_positions: the engine's context length in tokens (``dynamic`` only).

    Raises:
        ValueError: an unsupported ``rope_type`` or a missing parameter.
    """
    validate_rope_scaling(scaling)
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
    rope_type = rope_type_of(scaling)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), 1.0
    if rope_type == "dynamic":
        old_len = int(scaling["original_max_position_embeddings"])
        if max_positions is None or max_positions <= old_len:
            return inv_freq, 1.0
        factor = float(scaling["factor"])
        base = theta * ((factor * max_positions / old_len) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope_type == "yarn":
        return _yarn(inv_freq, dim, theta, scaling)
    # llama3
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
    return torch.where(medium, smoothed, scaled), 1.0


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_positions: int | None = None) -> torch.Tensor:
    """The inverse frequencies of :func:`rope_parameters` (without the cos/sin factor).

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    return rope_parameters(head_dim, theta, scaling, max_positions)[0]


def rotary_embedding(head_dim: int, theta: float, scaling: dict | None, max_positions: int,
                     device: torch.device) -> "RotaryEmbedding":
    """The :class:`RotaryEmbedding` of a model's rotary settings (:func:`rope_parameters`) for
    positions ``0 .. max_positions - 1``.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    inv_freq, attention_factor = rope_parameters(head_dim, theta, scaling, max_positions)
    return RotaryEmbedding(max_positions, inv_freq, device, attention_factor)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding.

    Args:
        x: ``[T, heads, head_dim]``.
        cos, sin: ``[T, 1, head_dim // 2]`` in ``x``'s dtype.
    """
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RotaryEmbedding(CustomOp):
    """Rotary embedding of queries and keys at their positions (Su et al., RoFormer, 2021).

    Args:
        max_positions: size of the table (positions ``0 .. max_positions - 1``).
        inv_freq: ``[head_dim // 2]`` float32 inverse frequencies (:func:`rope_inv_freq`).
        device: where the tables live.
        attention_factor: multiplies both tables (YaRN's cos/sin scaling; 1.0 otherwise).

    Attributes:
        cos_cache, sin_cache: ``[max_positions, head_dim // 2]`` float32 (buffers).
    """

    def __init__(self, max_positions: int, inv_freq: torch.Tensor, device: torch.device,
                 attention_factor: float = 1.0):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None]
        self.register_buffer("cos_cache", (freqs.cos() * attention_factor).to(device),
                             persistent=False)
        self.register_buffer("sin_cache", (freqs.sin() * attention_factor).to(device),
                             persistent=False)

    def forward_torch(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``q`` ``[T, heads, head_dim]`` and keys ``k`` ``[T, kv_heads, head_dim]``
        (each after its per-head norm when given) rotated by ``positions`` ``[T]``; returns new
        tensors."""
        if q_norm is not None:
            q, k = q_norm(q), k_norm(k)
        cos = self.cos_cache[positions].to(q.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(q.dtype).unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def forward_triton(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`forward_torch`, in place on ``q`` and ``k`` (which may be strided views into
        a fused QKV projection) with :func:`pdserve.kernels.rotary.rotary_embedding_qk`; returns
        ``(q, k)``."""
        from pdserve.kernels import rotary as kernels

        return kernels.rotary_embedding_qk(q, k, positions, self.cos_cache, self.sin_cache,
                                           **kernel_norm_args(q_norm, k_norm))


def kernel_norm_args(q_norm: RMSNorm | None, k_norm: RMSNorm | None) -> dict:
    """The q/k norm keyword arguments of :mod:`pdserve.kernels.rotary`'s functions
    (``q_norm_weight``, ``k_norm_weight``, ``q_eps``, ``k_eps``); empty without norms."""
    if q_norm is None:
        return {}
    return dict(q_norm_weight=q_norm.weight, k_norm_weight=k_norm.weight, q_eps=q_norm.eps,
                k_eps=k_norm.eps)


@dataclass(frozen=True)
class QKRotation:
    """What turns a layer's projected queries and keys into attention's: the per-head RMSNorms
    when the model has them (Qwen3's q/k norm), then the rotary embedding at the step's
    positions. The attention backend applies it
    (:meth:`pdserve.attention.base.AttentionBackend.forward`): the Triton backend in the launch
    that also writes the keys and values into the KV cache.

    Attributes:
        rotary: the layer's :class:`RotaryEmbedding` (its ``cos_cache`` / ``sin_cache`` tables).
        positions: ``[T]`` int64 positions of the step's tokens.
        q_norm, k_norm: ``RMSNorm`` over ``head_dim``, both or neither.
    """

    rotary: RotaryEmbedding
    positions: torch.Tensor
    q_norm: RMSNorm | None = None
    k_norm: RMSNorm | None = None

    def apply(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[T, heads, head_dim]`` and keys ``[T, kv_heads, head_dim]`` normed and
        rotated by :attr:`rotary`'s op (in place with Triton, new tensors with torch)."""
        return self.rotary(self.positions, q, k, self.q_norm, self.k_norm)

    def kernel_args(self) -> dict:
        """Keyword arguments of :func:`pdserve.kernels.rotary.rotary_embedding_qk_store` that
        describe this rotation (positions, cos/sin tables, norm weights and epsilons)."""
        return dict(positions=self.positions, cos=self.rotary.cos_cache,
                    sin=self.rotary.sin_cache, **kernel_norm_args(self.q_norm, self.k_norm))
