"""Fused token draw for the CUDA sampler: temperature and an inverse-CDF draw from
``softmax(logits / T)`` in two short kernels, one random number per row.

The token drawn is the first vocabulary index whose cumulative probability exceeds a uniform
``u`` (inverse transform sampling). The first kernel (one program per row and fixed block of
:data:`BLOCK_V` vocabulary entries) writes the block's maximum ``m`` of ``x / T``, the lowest index
holding it, and ``sum(exp(x / T - m))``. The second (one program per row) weighs the blocks by
``exp(m - max)`` into the row's distribution over blocks, takes the block where the cumulative
weight passes ``u`` times the total, and the entry within it where the cumulative sum of that
block's ``exp(x / T - m)`` passes the rest; a greedy row (``T == 0``) takes the largest value,
lowest index on ties. Masked entries (``-inf``) have zero weight and are never drawn.

This reads the logits once, plus one block per row. The Gumbel-max kernel it replaced
(``argmax(x / T + g)``) needed a Philox draw for every vocabulary entry, which bound its time
(docs/benchmarks.md, "Measurements moved out of code comments").

The uniform comes from Triton's counter-based Philox generator (Salmon et al., *Parallel random
numbers: as easy as 1, 2, 3*, 2011; ``tl.rand`` at counter 0) keyed by ``seed * 2**32 + position``
per row, where ``position`` is the index of the token being drawn in the request's output. Blocks
have a fixed size and are combined in a fixed order, so a request's draws depend only on its
logits, its seed and how many tokens it has produced: not on the batch, on how steps are grouped
into multi-step rounds, or on the engine's history.

Import only where Triton is installed (the CUDA path of the model runner).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl

#: Vocabulary entries per program of the first kernel (a row's draw depends on it through the
#: order of its float32 sums, so it is fixed, not tuned per batch).
BLOCK_V = 2048
_LOG2_E = tl.constexpr(1.4426950408889634)


@triton.jit
def _block_stats_kernel(
    logits_ptr,
    stride_row,
    temps_ptr,
    max_ptr,  # [S, nblocks] float32: the block's largest logits / T
    idx_ptr,  # [S, nblocks] int32: its lowest index holding it
    sum_ptr,  # [S, nblocks] float32: sum of exp(logits / T - max) over the block
    vocab,
    nblocks,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    blk = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    inv_temp = 1.0 / tl.where(temp == 0.0, 1.0, temp)
    offs = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < vocab,
                other=float("-inf")).to(tl.float32) * inv_temp
    m = tl.max(x, 0)
    first = tl.min(tl.where(x == m, offs, vocab), 0)
    # a block of masked entries only: weight 0 (x - m would be NaN)
    total = tl.sum(tl.exp2((x - tl.where(m == float("-inf"), 0.0, m)) * _LOG2_E), 0)
    stat = row * nblocks + blk
    tl.store(max_ptr + stat, m)
    tl.store(idx_ptr + stat, first)
    tl.store(sum_ptr + stat, total)


@triton.jit(do_not_specialize=[5])  # step (argument 5) changes every call
def _pick_kernel(
    logits_ptr,
    stride_row,
    temps_ptr,
    seeds_ptr,
    positions_ptr,
    step,
    max_ptr,
    idx_ptr,
    sum_ptr,
    out_ptr,  # [S] int64 tokens
    vocab,
    nblocks,
    BLOCK: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0)
    temp = tl.load(temps_ptr + row)
    ob = tl.arange(0, BLOCKS_PAD)
    stat = row * nblocks + ob
    in_row = ob < nblocks
    m = tl.load(max_ptr + stat, mask=in_row, other=float("-inf"))
    top = tl.max(m, 0)
    if temp == 0.0:  # greedy: the largest value, lowest index on ties (blocks in index order)
        first = tl.load(idx_ptr + stat, mask=in_row, other=vocab)
        tl.store(out_ptr + row, tl.min(tl.where(m == top, first, vocab), 0).to(tl.int64))
    else:
        s = tl.load(sum_ptr + stat, mask=in_row, other=0.0)
        w = tl.where(s > 0, s * tl.exp2((m - top) * _LOG2_E), 0.0)
        key = tl.load(seeds_ptr + row).to(tl.uint64) * 4294967296 + (
            tl.load(positions_ptr + row) + step).to(tl.uint64)
        u = tl.sum(tl.rand(key, tl.arange(0, 1)), 0)
        target = u * tl.sum(w, 0)
        # The block where the cumulative weight passes the target; float rounding may leave the
        # target at the very end, so never past the last block with any weight.
        last_blk = tl.max(tl.where(w > 0, ob, 0), 0)
        blk = tl.minimum(tl.sum((tl.cumsum(w, 0) <= target).to(tl.int32), 0), last_blk)
        before = tl.sum(tl.where(ob < blk, w, 0.0), 0)
        m_blk = tl.sum(tl.where(ob == blk, m, 0.0), 0)
        rest = (target - before) * tl.exp2((top - m_blk) * _LOG2_E)  # in the block's own units
        offs = tl.arange(0, BLOCK)
        idx = blk * BLOCK + offs
        x = tl.load(logits_ptr + row.to(tl.int64) * stride_row + idx, mask=idx < vocab,
                    other=float("-inf")).to(tl.float32) * (1.0 / temp)
        e = tl.exp2((x - m_blk) * _LOG2_E)
        pick = tl.sum((tl.cumsum(e, 0) <= rest).to(tl.int32), 0)
        last = tl.max(tl.where(e > 0, offs, 0), 0)
        tl.store(out_ptr + row, (blk * BLOCK + tl.minimum(pick, last)).to(tl.int64))


def draw_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                positions: torch.Tensor, step: int = 0, out: torch.Tensor | None = None,
                block_v: int = BLOCK_V) -> torch.Tensor:
    """One token per row drawn from ``softmax(logits / T)``, or the argmax where ``T == 0``
    (lowest index on ties); see the module docstring for the method and the noise's key.

    Args:
        logits: ``[S, V]`` float32, bfloat16 or float16 (loads are converted to float32), last
            dim contiguous (masked tokens at ``-inf``; a sampled row needs one finite entry).
        temperatures: ``[S]`` float32, contiguous; 0 marks a greedy row.
        seeds: ``[S]`` int64 in ``[0, 2**31)``, contiguous: the Philox key of each row.
        positions: ``[S]`` int64, contiguous: output position of the token each row draws at
            ``step`` 0.
        step: added to every position (the step inside a multi-step round).
        out: optional ``[S]`` int64 output.
        block_v: vocabulary entries per block, a power of two of at least 16 (tests use small
            ones to get several blocks from a small vocabulary; a draw depends on it).

    Returns:
        ``[S]`` int64 token ids, without waiting for the GPU.

    Raises:
        ValueError: mismatched shapes, a non-contiguous vocabulary dimension or per-row tensor,
            a bad ``block_v``.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [S, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name, t in (("temperatures", temperatures), ("seeds", seeds), ("positions", positions)):
        if t.shape != (rows,) or (rows > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{rows}], got {tuple(t.shape)}")
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"block_v must be a power of two of at least 16, got {block_v}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows or not vocab:
        return out
    block = min(block_v, max(16, triton.next_power_of_2(vocab)))
    nblocks = triton.cdiv(vocab, block)
    maxima = torch.empty((rows, nblocks), dtype=torch.float32, device=logits.device)
    sums = torch.empty_like(maxima)
    firsts = torch.empty((rows, nblocks), dtype=torch.int32, device=logits.device)
    _block_stats_kernel[(rows, nblocks)](logits, logits.stride(0), temperatures, maxima, firsts,
                                         sums, vocab, nblocks, BLOCK=block, num_warps=4,
                                         **pdl.launch_options(logits.device))
    _pick_kernel[(rows,)](logits, logits.stride(0), temperatures, seeds, positions, step, maxima,
                          firsts, sums, out, vocab, nblocks, BLOCK=block,
                          BLOCKS_PAD=triton.next_power_of_2(nblocks), num_warps=8,
                          **pdl.launch_options(logits.device))
    return out
