"""KV cache moves (Triton): this step's keys and values of one layer into their paged slots,
and the keys and values of whole prefill contexts out of them, packed for a varlen kernel.

Layout of ``kv_cache``: docs/architecture.md ("KV cache layout"). Tokens with a negative slot
(padding rows of a CUDA-graph batch) are skipped. An fp8 (e4m3) cache stores
``clamp(x / scale, -448, 448)`` rounded to e4m3, the convention of
:mod:`pdserve.attention.kv_quant`. Import only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.common import next_power_of_2


_ROUNDING_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: adding and subtracting it rounds |y| < 2**22 to an int


@triton.jit
def round_to_e4m3(x):
    """``x`` (fp32, ``|x| <= 448``) rounded to nearest-even on the e4m3 grid, still in fp32: 3
    mantissa bits above 2**-6, steps of 2**-9 below (subnormals). The cast to fp8 that follows
    is then exact. The GPU's own conversion rounds the same way; doing it here keeps Triton's CPU
    interpreter right too (its fp8 cast drops the carry of a mantissa that rounds up into the
    exponent)."""
    exp = ((x.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    ulp_exp = tl.maximum(exp, -6) - 3
    inv_ulp = ((127 - ulp_exp) << 23).to(tl.float32, bitcast=True)
    ulp = ((127 + ulp_exp) << 23).to(tl.float32, bitcast=True)
    y = x * inv_ulp  # exact: a power of two
    return ((y + _ROUNDING_MAGIC) - _ROUNDING_MAGIC) * ulp


@triton.jit
def to_cache_dtype(x, inv_scale, cache_dtype, QUANTIZE: tl.constexpr):
    """Keys or values of the model's dtype (any float tile) -> the cache's dtype; with
    ``QUANTIZE`` (fp8 e4m3) ``clamp(x * inv_scale, -448, 448)`` rounded by
    :func:`round_to_e4m3`, the convention of :mod:`pdserve.attention.kv_quant`. Every KV write
    (here and in :mod:`pdserve.kernels.rotary`) goes through it."""
    if QUANTIZE:
        x = round_to_e4m3(tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -448.0), 448.0))
    return x.to(cache_dtype)


@triton.jit
def _store_kv_kernel(
    k_ptr,
    v_ptr,
    kv_ptr,  # the layer's view: [num_blocks, 2, Hkv, block_size, D]
    slot_mapping_ptr,
    stride_k_t,
    stride_k_h,
    stride_v_t,
    stride_v_h,
    stride_kv_b,
    stride_kv_kv,
    stride_kv_h,
    stride_kv_t,
    k_inv_scale,
    v_inv_scale,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Broadcast the slot before comparing: Triton 3.9's interpreter mistypes scalar comparisons.
    slot_tile = tl.zeros([HEADS_PAD, HEAD_DIM_PAD], dtype=tl.int64) + slot
    mask = (slot_tile >= 0) & (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = offs_h[:, None] * stride_k_h + offs_d[None, :]
    k = tl.load(k_ptr + token * stride_k_t + src, mask=mask)
    v = tl.load(v_ptr + token * stride_v_t + offs_h[:, None] * stride_v_h + offs_d[None, :], mask=mask)
    k = to_cache_dtype(k, k_inv_scale, kv_ptr.dtype.element_ty, QUANTIZE)
    v = to_cache_dtype(v, v_inv_scale, kv_ptr.dtype.element_ty, QUANTIZE)
    dst = (
        kv_ptr
        + (slot // BLOCK_SIZE) * stride_kv_b
        + (slot % BLOCK_SIZE) * stride_kv_t
        + offs_h[:, None] * stride_kv_h
        + offs_d[None, :]
    )
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_kv_kv, v, mask=mask)


def check_store_args(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                     slot_mapping: torch.Tensor) -> bool:
    """Check the arguments of a KV write (:func:`store_kv_cache`, and the one fused into
    :func:`pdserve.kernels.rotary.rotary_embedding_qk_store`); returns whether the cache is fp8
    (then the write quantizes).

    Raises:
        ValueError: on shape, dtype or layout mismatches, or ``layer`` out of range.
    """
    if k.shape != v.shape or k.dim() != 3:
        raise ValueError("k and v must both be [num_tokens, num_kv_heads, head_dim], got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    num_tokens, num_kv_heads, head_dim = k.shape
    if (kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or kv_cache.shape[3] != num_kv_heads
            or kv_cache.shape[5] != head_dim):
        raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match k/v {tuple(k.shape)}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")
    quantize = kv_cache.dtype == torch.float8_e4m3fn
    if k.dtype != v.dtype or (not quantize and k.dtype != kv_cache.dtype):
        raise ValueError(f"k/v dtype {k.dtype}/{v.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens], got {tuple(slot_mapping.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or kv_cache.stride(-1) != 1:
        raise ValueError("k, v and kv_cache need a contiguous last dimension")
    return quantize


def store_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new keys and values into the paged KV cache of one layer.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]`` in the cache's dtype, or any float dtype
            for an fp8 cache (last dim contiguous).
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, written in
            place; ``torch.float8_e4m3fn`` stores ``clamp(x / scale, -448, 448)``.
        layer: index into dim 1 of ``kv_cache``.
        slot_mapping: ``[num_tokens]`` int32/int64 slots (``block_id * block_size + offset``);
            tokens with a negative slot are skipped (padding of CUDA graph batches).
        k_scale, v_scale: the layer's positive scales of an fp8 cache (ignored otherwise).

    Raises:
        ValueError: on shape or dtype mismatches.
    """
    quantize = check_store_args(k, v, kv_cache, layer, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    kv_layer = kv_cache[:, layer]
    _store_kv_kernel[(num_tokens,)](
        k,
        v,
        kv_layer,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        1.0 / k_scale,
        1.0 / v_scale,
        NUM_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache.shape[4],
        QUANTIZE=quantize,
        num_warps=4,
        **pdl.launch_options(k.device),
    )


@triton.jit
def _gather_kv_kernel(
    kv_ptr,  # the layer's view: [num_blocks, 2, Hkv, block_size, D]
    block_ptr,
    offset_ptr,
    k_out_ptr,  # [T, Hkv, D], contiguous
    v_out_ptr,
    stride_kv_b,
    stride_kv_kv,
    stride_kv_h,
    stride_kv_t,
    k_scale,
    v_scale,
    NUM_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    DEQUANTIZE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.load(block_ptr + token).to(tl.int64)
    offset = tl.load(offset_ptr + token).to(tl.int64)
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    src = (kv_ptr + block * stride_kv_b + offset * stride_kv_t + offs_h[:, None] * stride_kv_h
           + offs_d[None, :])
    k = tl.load(src, mask=mask)
    v = tl.load(src + stride_kv_kv, mask=mask)
    if DEQUANTIZE:
        k = k.to(tl.float32) * k_scale
        v = v.to(tl.float32) * v_scale
    dst = token * (NUM_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_out_ptr + dst, k.to(k_out_ptr.dtype.element_ty), mask=mask)
    tl.store(v_out_ptr + dst, v.to(v_out_ptr.dtype.element_ty), mask=mask)


def gather_kv_cache(
    kv_cache: torch.Tensor,
    layer: int,
    blocks: torch.Tensor,
    offsets: torch.Tensor,
    dtype: torch.dtype,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of the given cache slots of one layer, packed token after token: the
    contexts of a step's prefills for the varlen prefill attention. One program per token copies
    its ``[num_kv_heads, head_dim]`` keys and values (torch's advanced indexing of the same slots
    is slower, docs/benchmarks.md, "Measurements moved out of code comments").

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, last dim
            contiguous; fp8 (e4m3) entries are multiplied by the layer's scale.
        layer: index into dim 1 of ``kv_cache``.
        blocks, offsets: ``[T]`` int32/int64 cache block and in-block offset of each token.
        dtype: dtype of the result (the activations' dtype).
        k_scale, v_scale: the layer's scales of an fp8 cache (ignored otherwise).

    Returns:
        ``(k, v)``, each ``[T, num_kv_heads, head_dim]`` contiguous in ``dtype``.

    Raises:
        ValueError: on shape mismatches or a layer out of range.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or kv_cache.stride(-1) != 1:
        raise ValueError(f"kv_cache must be [num_blocks, num_layers, 2, Hkv, block_size, D] with a "
                         f"contiguous last dim, got {tuple(kv_cache.shape)}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")
    if blocks.dim() != 1 or blocks.shape != offsets.shape:
        raise ValueError(f"blocks and offsets must both be [T], got {tuple(blocks.shape)} and "
                         f"{tuple(offsets.shape)}")
    num_tokens = blocks.shape[0]
    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[5]
    k = torch.empty((num_tokens, num_kv_heads, head_dim), dtype=dtype, device=kv_cache.device)
    v = torch.empty_like(k)
    if num_tokens == 0:
        return k, v
    kv_layer = kv_cache[:, layer]
    _gather_kv_kernel[(num_tokens,)](
        kv_layer,
        blocks,
        offsets,
        k,
        v,
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        k_scale,
        v_scale,
        NUM_HEADS=num_kv_heads,
        HEADS_PAD=next_power_of_2(num_kv_heads),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=next_power_of_2(head_dim),
        DEQUANTIZE=kv_cache.dtype == torch.float8_e4m3fn,
        num_warps=4,
        **pdl.launch_options(kv_cache.device),
    )
    return k, v
