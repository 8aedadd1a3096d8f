"""Fused token draw for the CUDA sampler: temperature, Gumbel noise and argmax in one pass over
the logits.

Drawing from ``softmax(x / T)`` equals taking ``argmax(x / T + g)`` with ``g`` i.i.d. standard
Gumbel noise, ``g = -log(-log(u))``, ``u ~ U(0, 1)`` (the Gumbel-max trick: E. J. Gumbel,
*Statistical theory of extreme values*, 1954; Maddison, Tarlow & Minka, *A* Sampling*, 2014).
The torch sampler needs five passes over the ``[rows, vocab]`` logits for this
(temperature division, softmax, noise, division, argmax); this kernel reads them once, which on
an H200 with Qwen3's 151,936-token vocabulary and 256 rows saves about 0.6 ms per decode step.
A few rows alone would leave most of the GPU idle (one program per row took 121 µs for one row on
an H200), so each row's vocabulary is shared by several programs and a small kernel merges their
winners.

The uniform noise comes from Triton's counter-based Philox generator (Salmon et al., *Parallel
random numbers: as easy as 1, 2, 3*, 2011) keyed by ``seed * 2**32 + position`` per row, where
``position`` is the index of the token being drawn in the request's output. One Philox-4x32-10
call gives four 32-bit words, so vocabulary entry ``v`` takes word ``v % 4`` of the call at
counter ``v // 4``: a quarter of the generator work of one call per entry (the generator, not
the read of the logits, bounds the kernel's time on an H200 with 151,936 entries a row). The
noise of an entry depends only on the row's key and the entry's index, so a request's draws
depend only on its seed and how many tokens it has produced: not on the batch, not on how the
vocabulary is cut into pieces, not on how steps are grouped into multi-step rounds, and not on
the engine's history.

Import only where Triton is installed (the CUDA path of the model runner).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels.common import multiprocessor_count

_BLOCK_V = 2048
# Programs the draw aims for per streaming multiprocessor: rows times vocabulary pieces. The
# Philox generator, not the read of the logits, sets the kernel's time, so more programs in flight
# help: 16 against 4 took 69.4 against 80.2 us at 137 rows and 122.2 against 128.4 at 256 on an
# H200, the same at 64 rows (docs/benchmarks.md, "Gumbel draw").
_PROGRAMS_PER_SM = 16
_MAX_PIECES = 64


@triton.jit(do_not_specialize=[5])  # step (argument 5) changes every call
def _gumbel_argmax_kernel(
    logits_ptr,
    stride_row,
    temps_ptr,
    seeds_ptr,
    positions_ptr,
    step,
    out_ptr,  # [S] int64 tokens (ONE_PIECE) or [S, pieces] int32 piece winners
    best_ptr,  # [S, pieces] float32 piece maxima (unused when ONE_PIECE)
    vocab,
    piece,  # vocabulary entries per program, a multiple of BLOCK_V
    BLOCK_V: tl.constexpr,
    ONE_PIECE: tl.constexpr,
):
    row = tl.program_id(0)
    pc = tl.program_id(1)
    temp = tl.load(temps_ptr + row)
    greedy = temp == 0.0
    inv_temp = 1.0 / tl.where(greedy, 1.0, temp)
    key = tl.load(seeds_ptr + row).to(tl.uint64) * 4294967296 + (
        tl.load(positions_ptr + row) + step).to(tl.uint64)
    # The tile as [BLOCK_V // 4, 4] (row-major, contiguous in memory): entry v = 4 * c + w takes
    # output word w of Philox at counter c, so one Philox call serves four entries (v0 is a
    # multiple of 4: pieces are whole blocks).
    quad = tl.arange(0, BLOCK_V // 4)[:, None]
    word = tl.arange(0, 4)[None, :]
    best = tl.full([BLOCK_V // 4, 4], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V // 4, 4], tl.int32)
    base = logits_ptr + row.to(tl.int64) * stride_row
    for v0 in range(pc * piece, tl.minimum(pc * piece + piece, vocab), BLOCK_V):
        offs = v0 + 4 * quad + word
        mask = offs < vocab
        x = tl.load(base + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        if not greedy:
            u0, u1, u2, u3 = tl.rand4x(key, v0 // 4 + tl.arange(0, BLOCK_V // 4))
            u = tl.where(word == 0, u0[:, None], tl.where(word == 1, u1[:, None],
                         tl.where(word == 2, u2[:, None], u3[:, None])))
            x = x - tl.log(-tl.log(u))  # u == 0 gives -inf: never drawn
        take = x > best  # strict: each slot keeps its lowest index among equal values
        best = tl.where(take, x, best)
        best_idx = tl.where(take, offs, best_idx)
    top = tl.max(tl.max(best, 1), 0)
    # lowest index among the slots holding the maximum (deterministic ties)
    winner = tl.min(tl.min(tl.where(best == top, best_idx, vocab), 1), 0)
    if ONE_PIECE:
        tl.store(out_ptr + row, winner.to(tl.int64))
    else:
        pieces = tl.num_programs(1)
        tl.store(out_ptr + row * pieces + pc, winner)
        tl.store(best_ptr + row * pieces + pc, top)


@triton.jit(do_not_specialize=[3])  # pieces (argument 3) follows the batch size
def _merge_pieces_kernel(best_ptr, winner_ptr, out_ptr, pieces, vocab, PIECES_PAD: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, PIECES_PAD)
    mask = offs < pieces
    best = tl.load(best_ptr + row * pieces + offs, mask=mask, other=float("-inf"))
    idx = tl.load(winner_ptr + row * pieces + offs, mask=mask, other=vocab)
    top = tl.max(best, 0)
    # pieces are in vocabulary order: the lowest index among equal maxima, as in one pass
    tl.store(out_ptr + row, tl.min(tl.where(best == top, idx, vocab), 0).to(tl.int64))


def vocab_pieces(rows: int, vocab: int, device: torch.device) -> int:
    """How many programs share one row's vocabulary in :func:`gumbel_argmax`: enough for
    ``_PROGRAMS_PER_SM`` programs per multiprocessor in all (one row alone would leave all but
    one of them idle), never a piece shorter than ``_BLOCK_V`` entries. Depends on shapes only,
    so a CUDA graph captures a fixed grid."""
    # interpreter runs: one program per row unless the caller asks for pieces
    sms = multiprocessor_count(device, cpu_stand_in=1)
    want = -(-_PROGRAMS_PER_SM * sms // max(1, rows))
    return max(1, min(want, -(-vocab // _BLOCK_V), _MAX_PIECES))


def gumbel_argmax(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                  positions: torch.Tensor, step: int = 0, out: torch.Tensor | None = None,
                  pieces: int | None = None) -> torch.Tensor:
    """One token per row: ``argmax(logits / T + Gumbel noise)``, or plain argmax where ``T == 0``.

    Each row's vocabulary is cut into ``pieces`` equal runs, one program each; a second kernel
    takes the best of the pieces (lowest index on ties, as a single pass would). The noise of a
    vocabulary entry depends only on the row's key and the entry's index, so the draw does not
    depend on ``pieces``.

    Args:
        logits: ``[S, V]`` float32, bfloat16 or float16 (loads are converted to float32), last
            dim contiguous (masked tokens at ``-inf``).
        temperatures: ``[S]`` float32, contiguous; 0 marks a greedy row.
        seeds: ``[S]`` int64 in ``[0, 2**31)``, contiguous: the Philox key of each row.
        positions: ``[S]`` int64, contiguous: output position of the token each row draws at
            ``step`` 0.
        step: added to every position (the step inside a multi-step round).
        out: optional ``[S]`` int64 output.
        pieces: programs per row, 1 to 64; default :func:`vocab_pieces`.

    Returns:
        ``[S]`` int64 token ids, without waiting for the GPU.

    Raises:
        ValueError: mismatched shapes, a non-contiguous vocabulary dimension or per-row tensor,
            ``pieces`` out of range.
    """
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be [S, V] with a contiguous last dim, got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    for name, t in (("temperatures", temperatures), ("seeds", seeds), ("positions", positions)):
        if t.shape != (rows,) or (rows > 1 and t.stride(0) != 1):
            raise ValueError(f"{name} must be a contiguous [{rows}], got {tuple(t.shape)}")
    if pieces is None:
        pieces = vocab_pieces(rows, vocab, logits.device)
    if not 1 <= pieces <= _MAX_PIECES:
        raise ValueError(f"pieces must be in [1, {_MAX_PIECES}], got {pieces}")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if not rows:
        return out
    piece_len = -(-max(1, vocab) // pieces)
    block_v = min(_BLOCK_V, max(16, triton.next_power_of_2(piece_len)))
    piece = -(-piece_len // block_v) * block_v
    pieces = -(-max(1, vocab) // piece)  # no empty piece
    if pieces == 1:
        _gumbel_argmax_kernel[(rows, 1)](logits, logits.stride(0), temperatures, seeds, positions,
                                         step, out, out, vocab, piece, BLOCK_V=block_v,
                                         ONE_PIECE=True, num_warps=8)
        return out
    best = torch.empty((rows, pieces), dtype=torch.float32, device=logits.device)
    winners = torch.empty((rows, pieces), dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, pieces)](logits, logits.stride(0), temperatures, seeds, positions,
                                          step, winners, best, vocab, piece, BLOCK_V=block_v,
                                          ONE_PIECE=False, num_warps=8)
    # one compiled variant for every piece count (a new one inside a timed step costs ~0.1 s)
    _merge_pieces_kernel[(rows,)](best, winners, out, pieces, vocab, PIECES_PAD=_MAX_PIECES,
                                  num_warps=1)
    return out
