"""Rotary position embedding (rotate-half layout) with its frequency table, optionally preceded
by a per-head RMSNorm (Qwen3's q/k norm)."""

from __future__ import annotations

import math

import torch

from pdserve.layers.custom_op import CustomOp
from pdserve.layers.norm import RMSNorm


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Rotary inverse frequencies ``[head_dim // 2]`` (float32), with optional scaling.

    ``default``: ``theta ** (-2i / head_dim)`` (Su et al., RoFormer). ``linear``: divided by
    ``factor``. ``llama3``: the frequency-dependent rescaling published with Llama 3.1 (low
    frequencies divided by ``factor``, high ones kept, a smooth ramp in between, with
    ``low_freq_factor``, ``high_freq_factor`` and ``original_max_position_embeddings``).

    Args:
        head_dim: rotated dims per head.
        theta: the rotary base.
        scaling: None or a Hugging Face ``rope_scaling`` dict.

    Raises:
        ValueError: an unsupported ``rope_type``.
    """
    dim = head_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = scaling or {}
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

    Attributes:
        cos_cache, sin_cache: ``[max_positions, head_dim // 2]`` float32 (buffers).
    """

    def __init__(self, max_positions: int, inv_freq: torch.Tensor, device: torch.device):
        super().__init__()
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None]
        self.register_buffer("cos_cache", freqs.cos().to(device), persistent=False)
        self.register_buffer("sin_cache", freqs.sin().to(device), persistent=False)

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
        a fused QKV projection) with :func:`pdserve.kernels.rotary.rotary_embedding`; returns
        ``(q, k)``."""
        from pdserve.kernels import rotary as kernels

        cos, sin = self.cos_cache, self.sin_cache
        if q_norm is None:
            return (kernels.rotary_embedding(q, positions, cos, sin),
                    kernels.rotary_embedding(k, positions, cos, sin))
        return (kernels.rotary_embedding(q, positions, cos, sin, q_norm.weight, q_norm.eps),
                kernels.rotary_embedding(k, positions, cos, sin, k_norm.weight, k_norm.eps))
