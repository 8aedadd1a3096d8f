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
def _rotate_heads(
    x_ptr, token, pos, cos_ptr, sin_ptr, norm_weight_ptr, stride_x_t, stride_x_h, stride_cs, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):
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


@triton.jit
def _rotary_kernel(
    x_ptr,  # program_id(1) == 0: [T, X_HEADS, HEAD_DIM]
    y_ptr,  # program_id(1) == 1: [T, Y_HEADS, HEAD_DIM] (a second tensor, e.g. the keys)
    positions_ptr,
    cos_ptr,
    sin_ptr,
    x_norm_ptr,
    y_norm_ptr,
    stride_x_t,
    stride_x_h,
    stride_y_t,
    stride_y_h,
    stride_cs,
    x_eps,
    y_eps,
    X_HEADS: tl.constexpr,
    X_HEADS_PAD: tl.constexpr,
    Y_HEADS: tl.constexpr,
    Y_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(x_ptr, token, pos, cos_ptr, sin_ptr, x_norm_ptr, stride_x_t, stride_x_h,
                      stride_cs, x_eps, X_HEADS, X_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, HAS_NORM)
    else:
        _rotate_heads(y_ptr, token, pos, cos_ptr, sin_ptr, y_norm_ptr, stride_y_t, stride_y_h,
                      stride_cs, y_eps, Y_HEADS, Y_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, HAS_NORM)


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

    :func:`rotary_embedding_qk` does queries and keys in one launch.

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

    Raises:
        ValueError: on shape or layout mismatches.
    """
    _check(x, positions, cos, sin, norm_weight)
    _launch(x, None, positions, cos, sin, norm_weight, None, eps, eps)
    return x


def rotary_embedding_qk(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
    k_eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_embedding` of queries and keys in one launch (one program per token and
    tensor); both get their norm or neither.

    Args:
        q: ``[num_tokens, num_heads, head_dim]``, in place.
        k: ``[num_tokens, num_kv_heads, head_dim]``, in place.
        positions, cos, sin: as :func:`rotary_embedding`.
        q_norm_weight, k_norm_weight: ``[head_dim]`` RMSNorm weights, both or neither.
        q_eps, k_eps: their epsilons.

    Returns:
        ``(q, k)``.

    Raises:
        ValueError: on shape or layout mismatches, or only one norm weight.
    """
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    _check(q, positions, cos, sin, q_norm_weight)
    _check(k, positions, cos, sin, k_norm_weight)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} and {k.shape[2]}")
    _launch(q, k, positions, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps)
    return q, k


def _check(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           norm_weight: torch.Tensor | None) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [num_tokens, num_heads, head_dim], got {tuple(x.shape)}")
    num_tokens, _, head_dim = x.shape
    if head_dim % 2 or cos.shape[-1] != head_dim // 2 or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)} must be [max_position, head_dim // 2] "
                         f"for head_dim {head_dim}")
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions must be [num_tokens], got {tuple(positions.shape)}")
    if norm_weight is not None and norm_weight.shape != (head_dim,):
        raise ValueError(f"norm_weight must be [head_dim], got {tuple(norm_weight.shape)}")
    if x.stride(-1) != 1 or cos.stride(-1) != 1 or sin.stride(-1) != 1 or cos.stride(0) != sin.stride(0):
        raise ValueError("x, cos and sin need a contiguous last dimension (and equal cos/sin strides)")


def _launch(x: torch.Tensor, y: torch.Tensor | None, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor, x_norm: torch.Tensor | None, y_norm: torch.Tensor | None,
            x_eps: float, y_eps: float) -> None:
    num_tokens, _, head_dim = x.shape
    if num_tokens == 0:
        return
    other = x if y is None else y
    half = head_dim // 2
    _rotary_kernel[(num_tokens, 1 if y is None else 2)](
        x,
        other,
        positions,
        cos,
        sin,
        cos if x_norm is None else x_norm,
        cos if y_norm is None else y_norm,
        x.stride(0),
        x.stride(1),
        other.stride(0),
        other.stride(1),
        cos.stride(0),
        x_eps,
        y_eps,
        X_HEADS=x.shape[1],
        X_HEADS_PAD=next_power_of_2(x.shape[1]),
        Y_HEADS=other.shape[1],
        Y_HEADS_PAD=next_power_of_2(other.shape[1]),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        HAS_NORM=x_norm is not None,
        num_warps=4,
    )
