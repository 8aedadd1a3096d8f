"""Split-K decode attention of multi-head latent attention (MLA, DeepSeek-V2/V3) in the absorbed
form, over the paged latent cache (Triton).

The latent cache (:mod:`pdserve.attention.mla`) is the shared cache tensor with one "KV head"::

    kv_cache: [num_blocks, num_layers, 2, 1, block_size, W / 2]     W = kv_lora_rank + rope dims

a token's entry ``[c | k_pe]`` (``W`` values) split in halves over the K slot (dim 2 = 0) and the
V slot (dim 2 = 1). In the absorbed form (DeepSeek-V2 paper, section 2.1.2 and appendix C;
Hugging Face ``modeling_deepseek_v2``'s expanded arithmetic reassociated) every query head ``h``
of a sequence scores the shared entries with its absorbed query ``[q_nope_h W_UK_h | q_pe_h]``
(``W`` values) and averages the latents ``c`` (the first ``kv_lora_rank`` values of the entries);
the caller applies ``W_UV`` afterwards. So every head of a sequence reads the same entries: one
program serves ``BLOCK_H`` heads of one sequence and one piece of its context, and reads each
entry once for all of them.

The split-K scheme is :mod:`pdserve.kernels.paged_decode`'s (Dao et al., *Flash-Decoding*, 2023):
the pieces of one launch have the same length, ``ceil(max_context_len / num_splits)`` tokens, the
batch's longest context read from ``context_lens`` by the kernel itself, so the grid depends on
the batch size alone and the launch can be captured in a CUDA graph (nothing here synchronises
with the host); each piece keeps an online softmax in log2 space and that module's merge kernel
combines the pieces. Each half of the entry is padded to a power of two in registers (masked
loads read no padding bytes). An fp8 (e4m3) cache is read as stored and converted in registers:
the K slot's values times the layer's key scale, the V slot's times its value scale
(:mod:`pdserve.attention.kv_quant`'s convention). A sequence with no context (the padding rows
of a CUDA graph batch) gets zeros.

:func:`pdserve.attention.mla.decode_absorbed` is the torch reference of the same computation
(the CPU path, and the torch path of ``benchmarks/mla_decode.py``). Import this module only where
Triton is installed; under ``TRITON_INTERPRET=1`` it runs on CPU tensors (tests only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.common import next_power_of_2
from pdserve.kernels.paged_decode import (
    MAX_NUM_SPLITS, _jit_without_specialising, _paged_decode_reduce_kernel, choose_num_splits)

_LOG2_E = 1.4426950408889634
#: query heads per program (tl.dot's smallest M; a sequence's heads share each entry read)
BLOCK_H = 16
_BLOCK_N = 16  # context tokens per inner iteration
_REDUCE_PIECES = 16  # as paged_decode's merge: pieces (heads x splits) per merge program


def _mla_decode_split_kernel(
    out_ptr,  # [S, H, R] output (not SPLIT)
    part_out_ptr,  # [S, H, P, R] fp32 normalised partial outputs (SPLIT)
    part_max_ptr,  # [S, H, P] fp32 running max of log2-scaled scores (SPLIT)
    part_sum_ptr,  # [S, H, P] fp32 softmax denominators (SPLIT)
    q_ptr,  # [S, H, W] absorbed queries [q_lat | q_pe]
    kv_ptr,  # the layer's view [num_blocks, 2, 1, block_size, HALF]
    block_tables_ptr,
    context_lens_ptr,
    scale_log2,
    k_scale,
    v_scale,
    num_seqs,
    num_splits,
    stride_q_s,
    stride_q_h,
    stride_o_s,
    stride_o_h,
    stride_kv_b,
    stride_kv_kv,
    stride_kv_t,
    stride_bt_s,
    stride_po_s,
    stride_po_h,
    stride_po_p,
    stride_pm_s,
    stride_pm_h,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    LORA_RANK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    seq = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)

    ctx = tl.load(context_lens_ptr + seq)
    max_ctx = 0
    for s0 in range(0, num_seqs, 256):
        offs_s = s0 + tl.arange(0, 256)
        lens = tl.load(context_lens_ptr + offs_s, mask=offs_s < num_seqs, other=0)
        max_ctx = tl.maximum(max_ctx, tl.max(lens, 0))
    tokens_per_split = tl.cdiv(tl.cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)

    offs_d = tl.arange(0, HALF_PAD)
    d_mask = offs_d < HALF
    h_mask = heads < NUM_HEADS
    q_rows = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h
    qd_mask = h_mask[:, None] & d_mask[None, :]
    q_a = tl.load(q_rows + offs_d[None, :], mask=qd_mask, other=0.0)  # entry values 0 .. HALF
    q_b = tl.load(q_rows + HALF + offs_d[None, :], mask=qd_mask, other=0.0)  # HALF .. W
    if DOT_IN_FP32:
        q_a = q_a.to(tl.float32)
        q_b = q_b.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_a = tl.zeros([BLOCK_H, HALF_PAD], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK_H, HALF_PAD], dtype=tl.float32)

    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_base + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        tok = block.to(tl.int64) * stride_kv_b + (offs_n % BLOCK_SIZE) * stride_kv_t
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k_a = tl.load(kv_ptr + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        k_b = tl.load(kv_ptr + stride_kv_kv + tok[:, None] + offs_d[None, :], mask=kv_mask,
                      other=0.0)
        if KV_FP8:  # exact conversion, then the layer's scales
            k_a = (k_a.to(tl.float32) * k_scale).to(q_a.dtype)
            k_b = (k_b.to(tl.float32) * v_scale).to(q_b.dtype)
        elif DOT_IN_FP32:
            k_a = k_a.to(tl.float32)
            k_b = k_b.to(tl.float32)
        if DOT_IN_FP32:
            s = tl.dot(q_a, tl.trans(k_a), input_precision="ieee")
            s += tl.dot(q_b, tl.trans(k_b), input_precision="ieee")
        else:
            s = tl.dot(q_a, tl.trans(k_a))
            s += tl.dot(q_b, tl.trans(k_b))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_IN_FP32:
            pa = tl.dot(p, k_a, input_precision="ieee")
            pb = tl.dot(p, k_b, input_precision="ieee")
        else:
            pa = tl.dot(p.to(k_a.dtype), k_a)
            pb = tl.dot(p.to(k_b.dtype), k_b)
        acc_a = acc_a * alpha[:, None] + pa
        acc_b = acc_b * alpha[:, None] + pb
        m_i = m_new

    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    out_a = acc_a * inv[:, None]
    out_b = acc_b * inv[:, None]
    # the output is the latent part of the averaged entries: values 0 .. LORA_RANK, i.e. all of
    # the K slot's half and the V slot's first LORA_RANK - HALF values
    a_mask = h_mask[:, None] & d_mask[None, :]
    b_mask = h_mask[:, None] & (offs_d < LORA_RANK - HALF)[None, :]
    if SPLIT:
        po = (part_out_ptr + seq * stride_po_s + heads[:, None] * stride_po_h
              + split * stride_po_p + offs_d[None, :])
        nonempty = (offs_d * 0 + start) < end  # an empty piece writes only l == 0
        tl.store(po, out_a, mask=a_mask & nonempty[None, :])
        tl.store(po + HALF, out_b, mask=b_mask & nonempty[None, :])
        pm = seq * stride_pm_s + heads * stride_pm_h + split
        tl.store(part_max_ptr + pm, m_i, mask=h_mask)
        tl.store(part_sum_ptr + pm, l_i, mask=h_mask)
    else:
        o = out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o, out_a.to(out_ptr.dtype.element_ty), mask=a_mask)
        tl.store(o + HALF, out_b.to(out_ptr.dtype.element_ty), mask=b_mask)


# the batch size and block-table width change from step to step: not specialised on (as
# paged_decode's kernels, for the same reason)
_mla_decode_split_kernel = _jit_without_specialising(_mla_decode_split_kernel)


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         kv_lora_rank: int, k_scale: float = 1.0, v_scale: float = 1.0,
                         out: torch.Tensor | None = None, num_splits: int | None = None
                         ) -> torch.Tensor:
    """Absorbed-form MLA attention of one new token per sequence over its paged latent cache.

    Args:
        q: ``[num_seqs, num_heads, W]`` absorbed queries ``[q_nope W_UK | q_pe]`` (bf16, fp16 or
            fp32; last dim contiguous), ``W = kv_lora_rank + qk_rope_head_dim``.
        kv_cache: ``[num_blocks, num_layers, 2, 1, block_size, W / 2]`` in ``q``'s dtype or
            ``torch.float8_e4m3fn``; ``block_size`` a power of two.
        layer: index into dim 1.
        block_tables: ``[num_seqs, max_blocks]`` int32 block ids.
        context_lens: ``[num_seqs]`` int32 tokens to attend to, the new token's entry included
            (already written); 0 gives zeros.
        scale: softmax scale (``qk_head_dim ** -0.5`` times YaRN's ``mscale`` squared).
        kv_lora_rank: ``r``, the latent width (``W / 2 <= r < W``).
        k_scale, v_scale: the layer's fp8 scales of the K and V slots (ignored otherwise).
        out: optional ``[num_seqs, num_heads, r]`` buffer (contiguous last dim).
        num_splits: context pieces per sequence; default :func:`choose_num_splits
            <pdserve.kernels.paged_decode.choose_num_splits>` of the batch size (no context hint,
            so that eager and graph-replayed steps of one batch size compute the same bits).

    Returns:
        ``out``: ``[num_seqs, num_heads, r]`` attention-weighted latents, in ``q``'s dtype.

    Raises:
        ValueError: on shape, dtype or layout mismatches.
    """
    if q.dim() != 3 or kv_cache.dim() != 6 or kv_cache.shape[2] != 2 or kv_cache.shape[3] != 1:
        raise ValueError(f"q must be [S, H, W] and kv_cache [N, L, 2, 1, block_size, W / 2], got "
                         f"{tuple(q.shape)} and {tuple(kv_cache.shape)}")
    num_seqs, num_heads, width = q.shape
    half, block_size = kv_cache.shape[5], kv_cache.shape[4]
    if width != 2 * half or not half <= kv_lora_rank < width:
        raise ValueError(f"entry width {width} does not match the cache's halves of {half} and "
                         f"kv_lora_rank {kv_lora_rank}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if q.dtype != kv_cache.dtype and not kv_fp8:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or \
            context_lens.shape != (num_seqs,):
        raise ValueError("block_tables must be [num_seqs, max_blocks] and context_lens "
                         "[num_seqs]")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dimension")
    shape = (num_seqs, num_heads, kv_lora_rank)
    if out is None:
        out = torch.empty(shape, dtype=q.dtype, device=q.device)
    elif tuple(out.shape) != shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {shape} with a contiguous last dim")
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, 1, q.device)
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    block_h = BLOCK_H
    split = num_splits > 1
    if split:
        part_out = torch.empty((num_seqs, num_heads, num_splits, kv_lora_rank),
                               dtype=torch.float32, device=q.device)
        part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out, part_max, part_sum = out, context_lens, context_lens
    kv_layer = kv_cache[:, layer]  # [num_blocks, 2, 1, block_size, half]
    options = pdl.launch_options(q.device)
    grid = (num_seqs, triton.cdiv(num_heads, block_h), num_splits)
    _mla_decode_split_kernel[grid](
        out, part_out, part_max, part_sum, q, kv_layer, block_tables, context_lens,
        scale * _LOG2_E, k_scale if kv_fp8 else 1.0, v_scale if kv_fp8 else 1.0,
        num_seqs, num_splits, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(3), block_tables.stride(0),
        part_out.stride(0) if split else 0, part_out.stride(1) if split else 0,
        part_out.stride(2) if split else 0, part_max.stride(0) if split else 0,
        part_max.stride(1) if split else 0,
        NUM_HEADS=num_heads, BLOCK_H=block_h, HALF=half, HALF_PAD=next_power_of_2(half),
        LORA_RANK=kv_lora_rank, BLOCK_SIZE=block_size, BLOCK_N=_BLOCK_N, SPLIT=split,
        # Triton's CPU interpreter multiplies 16-bit tl.dot operands as raw bits (see
        # paged_decode): interpreted runs widen them first
        DOT_IN_FP32=q.dtype == torch.float32 or q.device.type != "cuda", KV_FP8=kv_fp8,
        num_warps=8 if half > 128 else 4, num_stages=2, **options)
    if split:
        splits_pad = next_power_of_2(num_splits)
        heads = max(1, min(_REDUCE_PIECES // splits_pad, next_power_of_2(num_heads)))
        _paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, heads))](
            out, part_out, part_max, part_sum, num_splits, out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2), part_max.stride(0),
            part_max.stride(1), NUM_HEADS=num_heads, HEADS=heads, HEAD_DIM=kv_lora_rank,
            HEAD_DIM_PAD=next_power_of_2(kv_lora_rank), SPLITS_PAD=splits_pad, num_warps=4,
            **options)
    return out
