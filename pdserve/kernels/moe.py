"""Fused mixture-of-experts (Triton): the token-expert pairs sorted by expert, then one grouped
GEMM launch per projection over all experts (no loop over experts on the host).

The scheme follows vLLM's ``fused_moe`` (Apache-2.0; itself after the MegaBlocks idea of
block-sparse expert GEMMs, Gale et al., 2022):

1. :func:`moe_align` sorts the ``T * top_k`` (token, expert) pairs by expert and pads each
   expert's run to a multiple of ``BLOCK_M`` rows, so every ``BLOCK_M`` rows of the sorted list
   belong to one expert (:attr:`MoEAlignment.block_expert`).
2. :func:`_grouped_gemm_kernel` computes, for each block of sorted rows and each ``BLOCK_N``
   columns, ``A[rows] @ W[expert]^T`` in fp32 and writes each row back to its pair's place
   (optionally multiplied by the pair's routing weight).

Everything is computed with device-side torch ops and Triton kernels of fixed grid size for a
given ``T`` (no host synchronisation), so the decode step can be captured in a CUDA graph.

Import only where Triton is installed; :class:`pdserve.layers.fused_moe.FusedMoE` picks this
op or its torch counterpart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl

from pdserve.kernels.activation import silu_and_mul


@dataclass
class MoEAlignment:
    """(token, expert) pairs sorted by expert, each expert's run padded to ``block_m`` rows.

    Attributes:
        sorted_pairs: ``[max_rows]`` int32: the pair index ``t * top_k + j`` at each sorted row;
            padding rows hold ``num_pairs`` (out of range, masked in the kernel).
        block_expert: ``[max_rows // block_m]`` int32: the expert of each block of rows
            (``num_experts`` for blocks past the used rows).
        num_rows: ``[1]`` int32: rows in use (a multiple of ``block_m``).
        block_m: rows per block.
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    num_rows: torch.Tensor
    block_m: int


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Sort the pairs of ``topk_ids`` by expert and pad each expert's run to ``block_m`` rows.

    Args:
        topk_ids: ``[T, top_k]`` int expert ids, each in ``0 .. num_experts - 1``.
        num_experts: experts of the layer.
        block_m: rows per block of the grouped GEMM (a power of two).

    Returns:
        The :class:`MoEAlignment`; its buffers have a size fixed by ``T``, ``top_k``,
        ``num_experts`` and ``block_m`` (``T * top_k + num_experts * (block_m - 1)`` rows, rounded
        up to a block).
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_rows = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m) * block_m
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    padded_start = padded_end - padded
    count_start = counts.cumsum(0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of_sorted = flat[order]
    rank = torch.arange(num_pairs, device=device) - count_start[expert_of_sorted]
    dest = padded_start[expert_of_sorted] + rank
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    return MoEAlignment(sorted_pairs, block_expert, padded_end[-1:].to(torch.int32), block_m)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, w_ptr, c_ptr, weights_ptr,
    sorted_pairs_ptr, block_expert_ptr, num_rows_ptr,
    N, K, num_pairs,
    stride_am, stride_ak,
    stride_we, stride_wn, stride_wk,
    stride_cm, stride_cn,
    A_ROW_DIV: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    # One program: BLOCK_M sorted rows (one expert) x BLOCK_N output columns.
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_rows = tl.load(num_rows_ptr)
    if pid_m * BLOCK_M >= num_rows:
        return
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + offs_m).to(tl.int64)
    row_mask = pairs < num_pairs
    a_rows = pairs // A_ROW_DIV  # the token of a pair (first GEMM) or the pair itself (second)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    w_ptrs = (w_ptr + expert * stride_we + offs_n[None, :] * stride_wn
              + offs_k[:, None] * stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k + k0 < K
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_IN_FP32:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if MUL_WEIGHT:
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
        acc = acc * weight[:, None]
    c_ptrs = c_ptr + pairs[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


def _block_sizes(num_pairs: int, num_experts: int, n: int, k: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, BLOCK_K)``: row blocks near the mean number of pairs per expert
    (each expert's run is padded to a whole block: small blocks for decode-sized batches, larger
    ones for prefill)."""
    per_expert = num_pairs / max(num_experts, 1)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 48 else 64
    block_n = 64 if n >= 64 else max(16, triton.next_power_of_2(n))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    return block_m, block_n, block_k


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, align: MoEAlignment, num_pairs: int,
                 a_row_div: int, out: torch.Tensor, pair_weights: torch.Tensor | None = None,
                 block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """``out[p] = A[p // a_row_div] @ w[expert(p)]^T`` (times ``pair_weights[p]`` when given) for
    every pair ``p`` of ``align``.

    Args:
        a: ``[rows, K]`` input (tokens, or pairs with ``a_row_div == 1``).
        w: ``[E, N, K]`` expert weights.
        align: from :func:`moe_align`.
        num_pairs: ``T * top_k``.
        a_row_div: ``top_k`` when ``a`` holds one row per token, 1 when one per pair.
        out: ``[num_pairs, N]``.
        pair_weights: optional ``[num_pairs]`` routing weights.
        block_n, block_k: tile sizes (powers of two, >= 16).

    Returns:
        ``out``.
    """
    _, n, k = w.shape
    grid = (align.sorted_pairs.numel() // align.block_m, triton.cdiv(n, block_n))
    _grouped_gemm_kernel[grid](
        a, w, out, pair_weights if pair_weights is not None else out,
        align.sorted_pairs, align.block_expert, align.num_rows,
        n, k, num_pairs,
        a.stride(0), a.stride(1),
        w.stride(0), w.stride(1), w.stride(2),
        out.stride(0), out.stride(1),
        A_ROW_DIV=a_row_div, MUL_WEIGHT=pair_weights is not None,
        # fp32 models multiply in full fp32 (not TF32); Triton's CPU interpreter multiplies
        # 16-bit float operands of tl.dot as raw integer bits (seen in 3.6-3.9), so interpreted
        # runs widen them first (as pdserve/kernels/paged_decode.py does).
        DOT_IN_FP32=a.dtype == torch.float32 or a.device.type != "cuda",
        BLOCK_M=align.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4,
        **pdl.launch_options(a.device))
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts of a mixture-of-experts layer over routed tokens.

    ``out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)``, with ``e = topk_ids[t, j]``
    and ``g | u = w13[e] @ x[t]``; the products in fp32, rounded to ``x``'s dtype between the
    two projections and before the sum over ``j``.

    Args:
        x: ``[T, H]`` hidden states.
        w13: ``[E, 2 * I, H]`` gate|up projections of each expert (gate rows first).
        w2: ``[E, H, I]`` down projections.
        topk_weights: ``[T, top_k]`` routing weights.
        topk_ids: ``[T, top_k]`` int expert ids.

    Returns:
        ``[T, H]`` in ``x``'s dtype.

    Raises:
        ValueError: shapes that do not fit together.
    """
    t, h = x.shape
    e, two_i, h_w = w13.shape
    top_k = topk_ids.shape[1]
    if h_w != h or w2.shape != (e, h, two_i // 2) or topk_weights.shape != topk_ids.shape \
            or topk_ids.shape[0] != t:
        raise ValueError(f"fused_moe shapes do not fit: x {tuple(x.shape)}, w13 "
                         f"{tuple(w13.shape)}, w2 {tuple(w2.shape)}, topk {tuple(topk_ids.shape)}")
    if t == 0:
        return torch.zeros_like(x)
    num_pairs = t * top_k
    block_m, bn1, bk1 = _block_sizes(num_pairs, e, two_i, h)
    _, bn2, bk2 = _block_sizes(num_pairs, e, h, two_i // 2)
    align = moe_align(topk_ids, e, block_m)
    x = x.contiguous()
    gate_up = torch.empty((num_pairs, two_i), dtype=x.dtype, device=x.device)
    grouped_gemm(x, w13, align, num_pairs, top_k, gate_up, block_n=bn1, block_k=bk1)
    act = silu_and_mul(gate_up)
    down = torch.empty((num_pairs, h), dtype=x.dtype, device=x.device)
    grouped_gemm(act, w2, align, num_pairs, 1, down,
                 pair_weights=topk_weights.reshape(-1).to(torch.float32).contiguous(),
                 block_n=bn2, block_k=bk2)
    return down.view(t, top_k, h).sum(dim=1)
