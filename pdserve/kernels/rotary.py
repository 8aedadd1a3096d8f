"""Rotary position embedding (Triton), in place, optionally preceded by a per-head RMSNorm
(Qwen3's q/k norm), and optionally followed by the KV cache write of the rotated keys and the
values in the same launch.

Import only where Triton is installed; :class:`pdserve.layers.rotary.RotaryEmbedding` picks this
op or its torch counterpart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.kv_cache import check_store_args, to_cache_dtype
from pdserve.kernels.common import next_power_of_2


@triton.jit
def _rotate_heads(
    x_ptr, token, pos, cos_ptr, sin_ptr, norm_weight_ptr, stride_x_t, stride_x_h, stride_cs, eps,
    NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    HALF_PAD: tl.constexpr, HAS_NORM: tl.constexpr,
):
    """Norm (optional) and rotate one token's heads in place; returns the rotated halves
    ``[HEADS_PAD, HALF_PAD]`` rounded to the tensor's dtype (held in fp32) and their mask."""
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
    o1 = (x1 * c - x2 * s).to(dtype)
    o2 = (x2 * c + x1 * s).to(dtype)
    tl.store(base, o1, mask=mask)
    tl.store(base + HALF, o2, mask=mask)
    return o1.to(tl.float32), o2.to(tl.float32), mask


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
    v_ptr,  # STORE_KV: [T, Y_HEADS, HEAD_DIM], written with the rotated y into the cache
    kv_ptr,  # STORE_KV: the layer's view of the cache, [num_blocks, 2, Y_HEADS, BLOCK_SIZE, D]
    slot_mapping_ptr,
    stride_v_t,
    stride_v_h,
    stride_kv_b,
    stride_kv_kv,
    stride_kv_h,
    stride_kv_t,
    k_inv_scale,
    v_inv_scale,
    X_HEADS: tl.constexpr,
    X_HEADS_PAD: tl.constexpr,
    Y_HEADS: tl.constexpr,
    Y_HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HAS_NORM: tl.constexpr,
    STORE_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    if tl.program_id(1) == 0:
        _rotate_heads(x_ptr, token, pos, cos_ptr, sin_ptr, x_norm_ptr, stride_x_t, stride_x_h,
                      stride_cs, x_eps, X_HEADS, X_HEADS_PAD, HEAD_DIM, HALF, HALF_PAD, HAS_NORM)
    else:
        k1, k2, mask = _rotate_heads(y_ptr, token, pos, cos_ptr, sin_ptr, y_norm_ptr, stride_y_t,
                                     stride_y_h, stride_cs, y_eps, Y_HEADS, Y_HEADS_PAD, HEAD_DIM,
                                     HALF, HALF_PAD, HAS_NORM)
        if STORE_KV:
            slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
            offs_h = tl.arange(0, Y_HEADS_PAD)
            offs_j = tl.arange(0, HALF_PAD)
            # Broadcast the slot before comparing: Triton 3.9's interpreter mistypes scalar
            # comparisons. Negative slots (padding rows of a CUDA graph batch) are skipped.
            mask = mask & ((tl.zeros([Y_HEADS_PAD, HALF_PAD], dtype=tl.int64) + slot) >= 0)
            src = v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_j[None, :]
            v1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
            v2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
            dst = (kv_ptr + (slot // BLOCK_SIZE) * stride_kv_b + (slot % BLOCK_SIZE) * stride_kv_t
                   + offs_h[:, None] * stride_kv_h + offs_j[None, :])
            cache_dtype = kv_ptr.dtype.element_ty
            k1 = to_cache_dtype(k1, k_inv_scale, cache_dtype, QUANTIZE)
            k2 = to_cache_dtype(k2, k_inv_scale, cache_dtype, QUANTIZE)
            v1 = to_cache_dtype(v1, v_inv_scale, cache_dtype, QUANTIZE)
            v2 = to_cache_dtype(v2, v_inv_scale, cache_dtype, QUANTIZE)
            tl.store(dst, k1, mask=mask)
            tl.store(dst + HALF, k2, mask=mask)
            tl.store(dst + stride_kv_kv, v1, mask=mask)
            tl.store(dst + stride_kv_kv + HALF, v2, mask=mask)

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
    _check_qk(q, k, positions, cos, sin, q_norm_weight, k_norm_weight)
    _launch(q, k, positions, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps)
    return q, k


@dataclass(frozen=True)
class _KVStore:
    """The KV write of :func:`rotary_embedding_qk_store`: values, the layer's cache view
    ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, slots, inverse scales, fp8 or not."""

    v: torch.Tensor
    kv_layer: torch.Tensor
    slot_mapping: torch.Tensor
    k_inv_scale: float
    v_inv_scale: float
    quantize: bool


def rotary_embedding_qk_store(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    q_eps: float = 1e-6,
    k_eps: float = 1e-6,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rotary_embedding_qk`, and the rotated keys and the values written into the paged
    KV cache in the same launch: the same bits as :func:`rotary_embedding_qk` followed by
    :func:`pdserve.kernels.kv_cache.store_kv_cache`, one kernel instead of two.

    Args:
        q, k, positions, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps: as
            :func:`rotary_embedding_qk` (``q`` and ``k`` rotated in place).
        v: ``[num_tokens, num_kv_heads, head_dim]`` values (last dim contiguous).
        kv_cache, layer, slot_mapping, k_scale, v_scale: as
            :func:`pdserve.kernels.kv_cache.store_kv_cache` (tokens with a negative slot are
            rotated but not written).

    Returns:
        ``(q, k)``.

    Raises:
        ValueError: on shape, dtype or layout mismatches, or only one norm weight.
    """
    _check_qk(q, k, positions, cos, sin, q_norm_weight, k_norm_weight)
    quantize = check_store_args(k, v, kv_cache, layer, slot_mapping)
    kv_layer = kv_cache[:, layer]
    _launch(q, k, positions, cos, sin, q_norm_weight, k_norm_weight, q_eps, k_eps,
            _KVStore(v, kv_layer, slot_mapping, 1.0 / k_scale, 1.0 / v_scale, quantize))
    return q, k


def _check_qk(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, q_norm_weight: torch.Tensor | None,
              k_norm_weight: torch.Tensor | None) -> None:
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("give both q and k norm weights or neither")
    _check(q, positions, cos, sin, q_norm_weight)
    _check(k, positions, cos, sin, k_norm_weight)
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q and k head dims differ: {q.shape[2]} and {k.shape[2]}")


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
            x_eps: float, y_eps: float, store: _KVStore | None = None) -> None:
    num_tokens, _, head_dim = x.shape
    if num_tokens == 0:
        return
    other = x if y is None else y
    half = head_dim // 2
    # Without a KV write its pointer and stride arguments are stand-ins the kernel never reads.
    v = other if store is None else store.v
    kv = other if store is None else store.kv_layer
    kv_strides = (0, 0, 0, 0) if store is None else tuple(kv.stride()[:4])
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
        v,
        kv,
        positions if store is None else store.slot_mapping,
        v.stride(0),
        v.stride(1),
        *kv_strides,
        1.0 if store is None else store.k_inv_scale,
        1.0 if store is None else store.v_inv_scale,
        X_HEADS=x.shape[1],
        X_HEADS_PAD=next_power_of_2(x.shape[1]),
        Y_HEADS=other.shape[1],
        Y_HEADS_PAD=next_power_of_2(other.shape[1]),
        HEAD_DIM=head_dim,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        HAS_NORM=x_norm is not None,
        STORE_KV=store is not None,
        BLOCK_SIZE=1 if store is None else kv.shape[3],
        QUANTIZE=store is not None and store.quantize,
        num_warps=4,
        **pdl.launch_options(x.device),
    )
