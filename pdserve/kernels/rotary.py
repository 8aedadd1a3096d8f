"""Rotary position embedding (Triton), in place, optionally preceded by a per-head RMSNorm
(Qwen3's q/k norm).

Import only where Triton is installed; :class:`pdserve.layers.rotary.RotaryEmbedding` picks this
op or its torch counterpart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import next_power_of_2


@triton.jit
def _rotary_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    norm_weight_ptr,
    stride_x_t,
    stride_x_h,
    stride_cs,
    eps,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_j = tl.arange(0, HALF_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_j[None, :] < HALF)
    base = x_ptr + token * stride_x_t + offs_h[:, None] * stride_x_h + offs_j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / HEAD_DIM + eps)
        w1 = tl.load(norm_weight_ptr + offs_j, mask=offs_j < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(norm_weight_ptr + HALF + offs_j, mask=offs_j < HALF, other=0.0).to(tl.float32)
        x1 = (x1 * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]
        x2 = (x2 * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]
        x1 = x1.to(dtype).to(tl.float32)
        x2 = x2.to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_cs + offs_j, mask=offs_j < HALF, other=0.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_cs + offs_j, mask=offs_j < HALF, other=0.0)[None, :]
    tl.store(base, (x1 * c - x2 * s).to(dtype), mask=mask)
    tl.store(base + HALF, (x2 * c + x1 * s).to(dtype), mask=mask)


def rotary_embedding(
    x: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Rotary position embedding (Su et al., RoFormer, 2021), "rotate half" (GPT-NeoX) layout, in
    place; optionally preceded by a per-head RMSNorm (Qwen3's ``q_norm``/``k_norm``).

    Call it once for q and once for k.

    Args:
        x: ``[num_tokens, num_heads, head_dim]``, modified in place (last dim contiguous; the token
            and head strides may be those of a view into a fused QKV projection).
        positions: ``[num_tokens]`` integer positions.
        cos, sin: ``[max_position, head_dim // 2]`` fp32 tables (``cos(pos * inv_freq)``), the
            whole head dim is rotated.
        norm_weight: optional ``[head_dim]`` RMSNorm weight applied to each head before rotation.
        eps: RMSNorm epsilon.

    Returns:
        ``x``.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_dim], got {tuple(x.shape)}")
    num_tokens, num_heads, head_dim = x.shape
    if head_dim % 2 or cos.shape[-1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [max_position, head_dim // 2] "
                         f"for head_dim {head_dim}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [num_tokens], got {tuple(positions.shape)}")
    if norm_weight is not None and norm_weight.shape != (head_dim,):
        raise ValueError(f"norm_weight must be [head_dim], got {tuple(norm_weight.shape)}")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("x, cos and sin need a contiguous last dimension (and equal cos/sin strides)")
    if num_tokens == 0:
        return x
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        x,
        positions,
        cos,
        sin,
        norm_weight if norm_weight is not None else cos,
        x.stride(0),
        x.stride(1),
        cos.stride(0),
        eps,
        NUM_HEADS=num_heads,
        HEADS_PAD=next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        HAS_NORM=norm_weight is not None,
        num_warps=4,
    )
    return x
