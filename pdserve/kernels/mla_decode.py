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
combines the pieces (at most :data:`MAX_SPLITS`). Each half of the entry is a tile of the largest
power of two it holds and a tail tile of the rest (``288 = 256 + 32`` for DeepSeek's 576-value
entry; masked loads read no padding bytes). An fp8 (e4m3) cache is read as stored and converted in registers:
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
    _jit_without_specialising, _merge_pieces, _partial_buffers, _split_range, choose_num_splits)

_LOG2_E = 1.4426950408889634
#: query heads per program (tl.dot's smallest M; a sequence's heads share each entry read)
BLOCK_H = 16
#: context tokens per inner iteration by default (``[16, 288]`` tiles of the two slots fit in
#: registers beside the accumulators without spilling at 4 or 8 warps; 32 spills at 4 warps)
BLOCK_N = 16
#: most context pieces per sequence: the merge holds a sequence's pieces of one head in
#: registers, ``[32, 512]`` fp32 at DeepSeek's latent width over its 8 warps without spilling
#: (64 pieces spill on sm_90: ``cuobjdump -res-usage`` of the compiled merge kernel)
MAX_SPLITS = 32


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
    MAIN: tl.constexpr,
    TAIL_PAD: tl.constexpr,
    LORA_RANK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    KV_FP8: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    # int64: seq * stride_po_s (heads x pieces x r values a sequence) passes 2**31 at a few
    # thousand sequences of 128 heads
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)

    _, start, end = _split_range(context_lens_ptr, seq, split, num_seqs, num_splits, BLOCK_N)

    # Each half (slot) of the entry is a MAIN-wide tile and a TAIL_PAD-wide tile of its last
    # HALF - MAIN values (masked; all masked when HALF is a power of two): 288 = 256 + 32 for
    # DeepSeek's 576-value entry, instead of one 512-wide tile per half.
    offs_m = tl.arange(0, MAIN)
    offs_t = MAIN + tl.arange(0, TAIL_PAD)
    t_mask = offs_t < HALF
    h_mask = heads < NUM_HEADS
    hm = h_mask[:, None]
    q_rows = q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h
    # the query's values against the K slot (entry values 0 .. HALF) and the V slot (HALF .. W)
    qk_m = tl.load(q_rows + offs_m[None, :], mask=hm, other=0.0)
    qk_t = tl.load(q_rows + offs_t[None, :], mask=hm & t_mask[None, :], other=0.0)
    qv_m = tl.load(q_rows + HALF + offs_m[None, :], mask=hm, other=0.0)
    qv_t = tl.load(q_rows + HALF + offs_t[None, :], mask=hm & t_mask[None, :], other=0.0)
    if DOT_IN_FP32:
        qk_m, qk_t = qk_m.to(tl.float32), qk_t.to(tl.float32)
        qv_m, qv_t = qv_m.to(tl.float32), qv_t.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_km = tl.zeros([BLOCK_H, MAIN], dtype=tl.float32)
    acc_kt = tl.zeros([BLOCK_H, TAIL_PAD], dtype=tl.float32)
    acc_vm = tl.zeros([BLOCK_H, MAIN], dtype=tl.float32)
    acc_vt = tl.zeros([BLOCK_H, TAIL_PAD], dtype=tl.float32)

    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_base + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        rows = kv_ptr + (block.to(tl.int64) * stride_kv_b
                         + (offs_n % BLOCK_SIZE) * stride_kv_t)[:, None]
        nm = n_mask[:, None]
        k_m = tl.load(rows + offs_m[None, :], mask=nm, other=0.0)
        k_t = tl.load(rows + offs_t[None, :], mask=nm & t_mask[None, :], other=0.0)
        v_m = tl.load(rows + stride_kv_kv + offs_m[None, :], mask=nm, other=0.0)
        v_t = tl.load(rows + stride_kv_kv + offs_t[None, :], mask=nm & t_mask[None, :],
                      other=0.0)
        if KV_FP8:  # exact conversion, then the layer's scales
            k_m = (k_m.to(tl.float32) * k_scale).to(qk_m.dtype)
            k_t = (k_t.to(tl.float32) * k_scale).to(qk_m.dtype)
            v_m = (v_m.to(tl.float32) * v_scale).to(qk_m.dtype)
            v_t = (v_t.to(tl.float32) * v_scale).to(qk_m.dtype)
        elif DOT_IN_FP32:
            k_m, k_t = k_m.to(tl.float32), k_t.to(tl.float32)
            v_m, v_t = v_m.to(tl.float32), v_t.to(tl.float32)
        if DOT_IN_FP32:
            s = tl.dot(qk_m, tl.trans(k_m), input_precision="ieee")
            s += tl.dot(qk_t, tl.trans(k_t), input_precision="ieee")
            s += tl.dot(qv_m, tl.trans(v_m), input_precision="ieee")
            s += tl.dot(qv_t, tl.trans(v_t), input_precision="ieee")
        else:
            s = tl.dot(qk_m, tl.trans(k_m))
            s += tl.dot(qk_t, tl.trans(k_t))
            s += tl.dot(qv_m, tl.trans(v_m))
            s += tl.dot(qv_t, tl.trans(v_t))
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_IN_FP32:
            acc_km = acc_km * alpha[:, None] + tl.dot(p, k_m, input_precision="ieee")
            acc_kt = acc_kt * alpha[:, None] + tl.dot(p, k_t, input_precision="ieee")
            acc_vm = acc_vm * alpha[:, None] + tl.dot(p, v_m, input_precision="ieee")
            acc_vt = acc_vt * alpha[:, None] + tl.dot(p, v_t, input_precision="ieee")
        else:
            p16 = p.to(k_m.dtype)
            acc_km = acc_km * alpha[:, None] + tl.dot(p16, k_m)
            acc_kt = acc_kt * alpha[:, None] + tl.dot(p16, k_t)
            acc_vm = acc_vm * alpha[:, None] + tl.dot(p16, v_m)
            acc_vt = acc_vt * alpha[:, None] + tl.dot(p16, v_t)
        m_i = m_new

    inv = (1.0 / tl.where(l_i > 0, l_i, 1.0))[:, None]
    # the output is the latent part of the averaged entries, values 0 .. LORA_RANK: all of the
    # K slot's half, then the V slot's first LORA_RANK - HALF values (the rest is k_pe)
    v_values = LORA_RANK - HALF
    masks = (hm & (offs_m < HALF)[None, :], hm & t_mask[None, :],
             hm & (offs_m < v_values)[None, :], hm & (offs_t < v_values)[None, :])
    if SPLIT:
        base = (part_out_ptr + seq * stride_po_s + heads[:, None] * stride_po_h
                + split * stride_po_p)
        nonempty = (heads * 0 + start) < end  # an empty piece writes only l == 0
        live = nonempty[:, None]
        tl.store(base + offs_m[None, :], acc_km * inv, mask=masks[0] & live)
        tl.store(base + offs_t[None, :], acc_kt * inv, mask=masks[1] & live)
        tl.store(base + HALF + offs_m[None, :], acc_vm * inv, mask=masks[2] & live)
        tl.store(base + HALF + offs_t[None, :], acc_vt * inv, mask=masks[3] & live)
        pm = seq * stride_pm_s + heads * stride_pm_h + split
        tl.store(part_max_ptr + pm, m_i, mask=h_mask)
        tl.store(part_sum_ptr + pm, l_i, mask=h_mask)
    else:
        base = out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h
        ty = out_ptr.dtype.element_ty
        tl.store(base + offs_m[None, :], (acc_km * inv).to(ty), mask=masks[0])
        tl.store(base + offs_t[None, :], (acc_kt * inv).to(ty), mask=masks[1])
        tl.store(base + HALF + offs_m[None, :], (acc_vm * inv).to(ty), mask=masks[2])
        tl.store(base + HALF + offs_t[None, :], (acc_vt * inv).to(ty), mask=masks[3])


# the batch size and block-table width change from step to step: not specialised on (as
# paged_decode's kernels, for the same reason)
_mla_decode_split_kernel = _jit_without_specialising(_mla_decode_split_kernel)


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                         kv_lora_rank: int, k_scale: float = 1.0, v_scale: float = 1.0,
                         out: torch.Tensor | None = None, num_splits: int | None = None,
                         block_n: int = BLOCK_N, num_warps: int | None = None) -> torch.Tensor:
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
        num_splits: context pieces per sequence, at most :data:`MAX_SPLITS`; default
            :func:`choose_num_splits <pdserve.kernels.paged_decode.choose_num_splits>` of the
            batch size (no context hint, so that eager and graph-replayed steps of one batch
            size compute the same bits), capped.
        block_n: context tokens per inner iteration (a power of two, at least 16).
        num_warps: warps per program of the split kernel; default 8 for halves over 128 values,
            else 4 (``benchmarks/mla_decode.py --sweep`` times the others).

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
    if width != 2 * half or not half <= kv_lora_rank < width or half < 16:
        raise ValueError(f"entry width {width} does not match the cache's halves of {half} "
                         f"(at least 16) and kv_lora_rank {kv_lora_rank}")
    if not 0 <= layer < kv_cache.shape[1]:
        raise ValueError(f"layer {layer} out of range for {kv_cache.shape[1]} layers")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if q.dtype != kv_cache.dtype and not kv_fp8:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if block_size & (block_size - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_size and block_n must be powers of two (block_n at least 16), "
                         f"got {block_size} and {block_n}")
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
        num_splits = min(MAX_SPLITS, choose_num_splits(num_seqs, 1, q.device))
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")
    block_h = BLOCK_H
    main = next_power_of_2(half + 1) // 2  # the largest power of two <= half
    split = num_splits > 1
    part_out, part_max, part_sum = _partial_buffers(out, context_lens, num_splits, split)
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
        NUM_HEADS=num_heads, BLOCK_H=block_h, HALF=half, MAIN=main,
        TAIL_PAD=max(16, next_power_of_2(half - main)),
        LORA_RANK=kv_lora_rank, BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        # Triton's CPU interpreter multiplies 16-bit tl.dot operands as raw bits (see
        # paged_decode): interpreted runs widen them first
        DOT_IN_FP32=q.dtype == torch.float32 or q.device.type != "cuda", KV_FP8=kv_fp8,
        num_warps=num_warps or (8 if half > 128 else 4), num_stages=2, **options)
    if split:
        _merge_pieces(out, part_out, part_max, part_sum, num_splits,
                      num_warps=8 if kv_lora_rank > 256 else 4)
    return out
