"""Split-K paged decode attention (Triton): one new token per sequence over its paged KV cache.

The KV cache is one tensor for every layer (docs/architecture.md, "KV cache layout")::

    kv_cache: [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]   (dim 2: 0=K, 1=V)

The slot of position ``p`` of a request is ``block_table[p // block_size] * block_size +
p % block_size``; K of that position in layer ``l`` and kv head ``h`` is
``kv_cache[slot // block_size, l, 0, h, slot % block_size]``.

Every launch has a grid that depends only on tensor shapes and Python ints fixed by the caller,
never on tensor contents, and nothing here synchronises with the host, so the launches can be
captured in CUDA graphs.

The decode-attention kernel follows the split-K ("flash-decoding") scheme of Dao et al., *Flash-
Decoding for long-context inference* (2023): the context of each sequence is cut into
``num_splits`` pieces that run as separate programs, each keeping an online softmax (Milakov &
Gimelshein, *Online normalizer calculation for softmax*, 2018), and a second kernel merges the
pieces with their log-sum-exp weights. All pieces of one launch have the same length,
``ceil(max_context_len / num_splits)`` tokens, where the kernel reads the batch's longest context
from ``context_lens`` itself; so the grid is the same for every step of a given batch size (what
CUDA graphs need), and a long context is cut into more pieces than a short one (whose last pieces
are empty and return at once). Cutting every context into the same number of pieces instead leaves
the programs of the longest sequences running alone at the end of the launch, a tail that costs
much of the bandwidth the kernel reaches when contexts differ widely (docs/benchmarks.md,
"Measurements moved out of code comments").

The kernels also run on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before
``triton`` is imported), which is how the CPU test suite checks them; this is slow and meant for
tests only.

An fp8 (e4m3) cache is read as is (half the bytes) and converted to the query's dtype in
registers; the key scale is folded into the softmax scale and the value scale multiplies the
output, so the dot products run in the query's dtype as for a 16-bit cache
(:mod:`pdserve.attention.kv_quant` gives the convention). On CUDA GPUs of compute capability 8.9
and later the split stage of an fp8 cache runs the CUDA kernel of
:mod:`pdserve.kernels.paged_decode_fp8` instead where it applies (head size 128, up to 8 query
heads per KV head; faster than the Triton split kernel, docs/benchmarks.md, "Measurements moved out
of code comments"), and this module's merge kernel combines its pieces.

:class:`pdserve.attention.triton_backend.TritonAttentionBackend` runs this kernel for the
decode rows of a step. Import this module only where Triton is installed.

The module stays whole past ~450 lines: the split and merge kernels, their launch configuration
and the launcher that checks their shared preconditions are one unit.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os

import torch
import triton
import triton.language as tl

from pdserve.kernels import paged_decode_fp8, pdl
from pdserve.kernels.common import multiprocessor_count
from pdserve.kernels.common import next_power_of_2 as _next_power_of_2

_LOG2_E = 1.4426950408889634

# Smallest number of context tokens worth a separate split (below this the merge costs more than
# the parallelism gains).
_MIN_TOKENS_PER_SPLIT = 64
MAX_NUM_SPLITS = 64
# Pieces (query heads x splits) one merge program reads. With one head per program most programs
# have a few hundred bytes to read, too little to cover a program's start; four heads of four
# pieces give each program more (docs/benchmarks.md, "Decode attention merge", and
# "Measurements moved out of code comments").
_REDUCE_PIECES = 16


@dataclasses.dataclass(frozen=True)
class DecodeKernelConfig:
    """Launch parameters of :func:`paged_decode_attention` when the caller gives none.

    Attributes:
        block_n: context tokens per inner-loop iteration (power of two, at least 16).
        num_warps: Triton warps per program.
        num_stages: Triton software-pipelining depth of the context loop.
        programs_per_sm: programs per streaming multiprocessor that the split count aims for.
        min_splits: fewest context splits per (sequence, kv head), whatever the batch size; it
            bounds the longest program to ``1 / min_splits`` of the longest context.
        fp8_block_n, fp8_num_warps, fp8_num_stages: ``block_n``, ``num_warps`` and
            ``num_stages`` for an fp8 cache (its loads are converted in registers, which moves
            the best launch to fewer warps; docs/benchmarks.md, "Measurements moved out of code
            comments").
        fp8_mma: 1 runs the split stage of an fp8 cache with the CUDA kernel of
            :mod:`pdserve.kernels.paged_decode_fp8` where it applies
            (:func:`~pdserve.kernels.paged_decode_fp8.supports`), 0 always with Triton.
        fp8_mma_warps: that kernel's warps per program.

    The defaults come from ``benchmarks/decode_attention.py`` on an H200 (docs/benchmarks.md);
    ``PDSERVE_DECODE_KERNEL_CONFIG`` (JSON with any of these keys) overrides them, for tuning on
    other GPUs.
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 2
    min_splits: int = 4
    fp8_block_n: int = 64
    fp8_num_warps: int = 2
    fp8_num_stages: int = 2
    fp8_mma: int = 1
    fp8_mma_warps: int = 4


@functools.lru_cache(maxsize=1)
def decode_kernel_config() -> DecodeKernelConfig:
    """The :class:`DecodeKernelConfig` in force: defaults, updated from the JSON object in
    ``PDSERVE_DECODE_KERNEL_CONFIG`` when set.

    Raises:
        ValueError: the variable is not a JSON object of known keys with positive int values
            (``fp8_mma``: 0 or 1).
    """
    raw = os.environ.get("PDSERVE_DECODE_KERNEL_CONFIG", "").strip()
    if not raw:
        return DecodeKernelConfig()
    try:
        values = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"PDSERVE_DECODE_KERNEL_CONFIG is not JSON: {e}") from None
    fields = {f.name for f in dataclasses.fields(DecodeKernelConfig)}
    if not isinstance(values, dict) or set(values) - fields:
        raise ValueError(f"PDSERVE_DECODE_KERNEL_CONFIG must be a JSON object with keys from {sorted(fields)}")
    if not all(isinstance(v, int) and not isinstance(v, bool)
               and (v in (0, 1) if k == "fp8_mma" else v > 0) for k, v in values.items()):
        raise ValueError("PDSERVE_DECODE_KERNEL_CONFIG values must be positive ints (fp8_mma: 0 or 1)")
    return DecodeKernelConfig(**values)


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    device: torch.device,
    max_context_len: int | None = None,
) -> int:
    """Number of context splits per (sequence, kv head) for :func:`paged_decode_attention`.

    Aims at ``programs_per_sm x multiprocessor count`` programs in all, and at least
    ``min_splits`` (:func:`decode_kernel_config`). When ``max_context_len`` (tokens) is given, no
    split gets fewer than 64 tokens on average; leave it ``None`` under CUDA graphs so the answer
    depends on the batch size alone.

    Returns:
        An int in ``[1, MAX_NUM_SPLITS]``.
    """
    cfg = decode_kernel_config()
    # interpreter runs: any small number of multiprocessors keeps the test grids small
    target = cfg.programs_per_sm * multiprocessor_count(device, cpu_stand_in=4)
    splits = max(cfg.min_splits, math.ceil(target / max(1, num_seqs * num_kv_heads)))
    if max_context_len is not None:
        splits = min(splits, max(1, math.ceil(max_context_len / _MIN_TOKENS_PER_SPLIT)))
    return min(splits, MAX_NUM_SPLITS)


# Arguments that change from step to step outside CUDA graphs (the block-table width follows the
# longest context of the batch; the split count and the number of sequences follow the batch size). Triton would otherwise
# compile a new variant whenever one of them turns divisible by 16 or equal to 1, a compilation
# inside a step (docs/benchmarks.md, "Measurements moved out of code comments"); none of them
# feeds a vectorised access.
_PER_STEP_ARGS = ("num_seqs", "num_splits", "stride_bt_s", "stride_pm_s", "stride_pm_h")


def _jit_without_specialising(fn):
    """``triton.jit`` with :data:`_PER_STEP_ARGS` unspecialised (given as argument indices, which
    every Triton 3 release accepts)."""
    names = list(inspect.signature(fn).parameters)
    return triton.jit(fn, do_not_specialize=[names.index(a) for a in _PER_STEP_ARGS if a in names])


@triton.jit
def _split_range(context_lens_ptr, seq, split, num_seqs, num_splits, BLOCK_N: tl.constexpr):
    """The context piece of one split-K program: ``(ctx, start, end)``, the context length of
    sequence ``seq`` and the token positions ``[start, end)`` that piece ``split`` reads.

    Every piece of a launch is ``ceil(max_ctx / num_splits)`` tokens rounded up to a multiple of
    ``BLOCK_N``, ``max_ctx`` being the batch's longest context, read here from
    ``context_lens_ptr`` (``[num_seqs]`` int32 tokens): the grid then depends on the batch size
    alone (module docstring). A piece past the sequence's context is empty (``start >= end``).
    Shared by this module's split kernel and :mod:`pdserve.kernels.mla_decode`'s.
    """
    ctx = tl.load(context_lens_ptr + seq)
    max_ctx = 0
    for s0 in range(0, num_seqs, 256):
        offs_s = s0 + tl.arange(0, 256)
        lens = tl.load(context_lens_ptr + offs_s, mask=offs_s < num_seqs, other=0)
        max_ctx = tl.maximum(max_ctx, tl.max(lens, 0))
    tokens_per_split = tl.cdiv(tl.cdiv(max_ctx, num_splits), BLOCK_N) * BLOCK_N
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, ctx)
    return ctx, start, end


def _paged_decode_split_kernel(
    out_ptr,  # [S, Hq, D] final output (used when not SPLIT)
    part_out_ptr,  # [S, Hq, P, D] fp32 normalised partial outputs (SPLIT)
    part_max_ptr,  # [S, Hq, P] fp32 running max of log2-scaled scores (SPLIT)
    part_sum_ptr,  # [S, Hq, P] fp32 softmax denominators (SPLIT)
    q_ptr,
    kv_ptr,  # the layer's view: [num_blocks, 2, Hkv, block_size, D]
    block_tables_ptr,
    context_lens_ptr,
    scale_log2,
    sliding_window,  # keys older than the last ``sliding_window`` positions are skipped (SLIDING)
    v_scale,
    num_seqs,
    num_splits,
    stride_q_s,
    stride_q_h,
    stride_o_s,
    stride_o_h,
    stride_kv_b,
    stride_kv_kv,
    stride_kv_h,
    stride_kv_t,
    stride_bt_s,
    stride_po_s,
    stride_po_h,
    stride_po_p,
    stride_pm_s,
    stride_pm_h,
    QUERY_GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    SLIDING: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_DOT_FP16: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # The batch's longest context fixes the piece length of every sequence (module docstring).
    ctx, start, end = _split_range(context_lens_ptr, seq, split, num_seqs, num_splits, BLOCK_N)
    if SLIDING:
        # Pieces wholly before the window are empty (start >= end) and return at once.
        start = tl.maximum(start, ctx - sliding_window)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    g_mask = offs_g < QUERY_GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * QUERY_GROUP + offs_g

    q = tl.load(
        q_ptr + seq * stride_q_s + heads[:, None] * stride_q_h + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if FP8_DOT_FP16:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    k_base = kv_ptr + kv_head * stride_kv_h
    bt_base = block_tables_ptr + seq.to(tl.int64) * stride_bt_s
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        block = tl.load(bt_base + offs_n // BLOCK_SIZE, mask=n_mask, other=0)
        tok = block.to(tl.int64) * stride_kv_b + (offs_n % BLOCK_SIZE) * stride_kv_t
        kv_mask = n_mask[:, None] & d_mask[None, :]
        k = tl.load(k_base + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(k_base + stride_kv_kv + tok[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_FP8:  # exact: every e4m3 value is a 16-bit (and fp32) float
            # (fp16 when FP8_DOT_FP16: one hardware conversion per pair on Hopper)
            k = k.to(q.dtype)
            v = v.to(q.dtype)

        if DOT_IN_FP32:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = tl.where(n_mask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if DOT_IN_FP32:
            pv = tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # Sequences with no context (padding rows of a CUDA graph batch) produce zeros, not NaN.
    out = acc * v_scale / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if SPLIT:
        po = (
            part_out_ptr
            + seq * stride_po_s
            + heads[:, None] * stride_po_h
            + split * stride_po_p
            + offs_d[None, :]
        )
        # An empty piece writes only its zero weight (l == 0), which the merge reads first.
        # (a tensor comparison: Triton 3.9's interpreter refuses a scalar bool in a mask)
        nonempty = (offs_d * 0 + start) < end
        tl.store(po, out, mask=out_mask & nonempty[None, :])
        pm = seq * stride_pm_s + heads * stride_pm_h + split
        tl.store(part_max_ptr + pm, m_i, mask=g_mask)
        tl.store(part_sum_ptr + pm, l_i, mask=g_mask)
    else:
        o = out_ptr + seq * stride_o_s + heads[:, None] * stride_o_h + offs_d[None, :]
        tl.store(o, out.to(out_ptr.dtype.element_ty), mask=out_mask)


def _paged_decode_reduce_kernel(
    out_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    num_splits,
    stride_o_s,
    stride_o_h,
    stride_po_s,
    stride_po_h,
    stride_po_p,
    stride_pm_s,
    stride_pm_h,
    NUM_HEADS: tl.constexpr,
    HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    # One program merges the pieces of HEADS query heads of one sequence: [HEADS, pieces, D].
    seq = tl.program_id(0).to(tl.int64)  # seq * stride_po_s may pass 2**31
    offs_h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    offs_p = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = offs_h < NUM_HEADS
    hp_mask = h_mask[:, None] & (offs_p < num_splits)[None, :]
    d_mask = offs_d < HEAD_DIM

    pm = seq * stride_pm_s + offs_h[:, None] * stride_pm_h + offs_p[None, :]
    m = tl.load(part_max_ptr + pm, mask=hp_mask, other=float("-inf"))
    l = tl.load(part_sum_ptr + pm, mask=hp_mask, other=0.0)
    m_max = tl.max(m, 1)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # a row with no context at all
    # Empty splits have l == 0 and m == -inf: their weight is 0.
    w = tl.exp2(m - m_max[:, None]) * l
    po = (
        part_out_ptr
        + seq * stride_po_s
        + offs_h[:, None, None] * stride_po_h
        + offs_p[None, :, None] * stride_po_p
        + offs_d[None, None, :]
    )
    # Empty pieces left their partial output unwritten: never read it (0 * NaN would be NaN).
    parts = tl.load(po, mask=(hp_mask & (l > 0))[:, :, None] & d_mask[None, None, :], other=0.0)
    total = tl.sum(w, 1)
    out = tl.sum(parts * w[:, :, None], 1) / tl.where(total > 0, total, 1.0)[:, None]
    o = out_ptr + seq * stride_o_s + offs_h[:, None] * stride_o_h + offs_d[None, :]
    tl.store(o, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


_paged_decode_split_kernel = _jit_without_specialising(_paged_decode_split_kernel)
_paged_decode_reduce_kernel = _jit_without_specialising(_paged_decode_reduce_kernel)


def _partial_buffers(out: torch.Tensor, context_lens: torch.Tensor, num_splits: int,
                     split: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The split kernel's piece buffers for an ``out`` of ``[num_seqs, num_heads, head_dim]``:
    ``(part_out, part_max, part_sum)``, fp32 ``[num_seqs, num_heads, num_splits, head_dim]``,
    ``[num_seqs, num_heads, num_splits]`` and the same (uninitialised). Without ``split``
    (one piece, written to ``out`` directly) unused placeholders of the right kind:
    ``(out, context_lens, context_lens)``. Shared with :mod:`pdserve.kernels.mla_decode`."""
    if not split:
        return out, context_lens, context_lens
    num_seqs, num_heads, head_dim = out.shape
    part_out = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                           device=out.device)
    part_max = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32,
                           device=out.device)
    return part_out, part_max, torch.empty_like(part_max)


def _merge_pieces(out: torch.Tensor, part_out: torch.Tensor, part_max: torch.Tensor,
                  part_sum: torch.Tensor, num_splits: int, num_warps: int) -> None:
    """Launch the merge kernel: ``out`` (``[num_seqs, num_heads, head_dim]``) becomes the
    log-sum-exp weighted mean of the ``num_splits`` pieces of :func:`_partial_buffers`'s
    buffers, :data:`_REDUCE_PIECES` pieces (heads x splits) per program with ``num_warps``
    warps. Shared with :mod:`pdserve.kernels.mla_decode`."""
    num_seqs, num_heads, head_dim = out.shape
    splits_pad = _next_power_of_2(num_splits)
    heads = max(1, min(_REDUCE_PIECES // splits_pad, _next_power_of_2(num_heads)))
    _paged_decode_reduce_kernel[(num_seqs, triton.cdiv(num_heads, heads))](
        out,
        part_out,
        part_max,
        part_sum,
        num_splits,
        out.stride(0),
        out.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        NUM_HEADS=num_heads,
        HEADS=heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_next_power_of_2(head_dim),
        SPLITS_PAD=splits_pad,
        num_warps=num_warps,
        **pdl.launch_options(out.device),
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    max_context_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    sliding_window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    fp8_dot_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged KV cache (decode step).

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` queries (bf16, fp16 or fp32); the last dim must be
            contiguous.
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]`` with the same
            dtype as ``q`` or ``torch.float8_e4m3fn``; ``block_size`` a power of two,
            ``head_dim`` at least 16.
        layer: index into dim 1 of ``kv_cache``.
        block_tables: ``[num_seqs, max_blocks]`` int32 block ids; only the first
            ``ceil(context_len / block_size)`` entries of a row are read.
        context_lens: ``[num_seqs]`` int32 tokens to attend to, the new token's own K/V included
            (it must already be in the cache). A sequence with 0 gets an all-zero output.
        scale: softmax scale, usually ``head_dim ** -0.5``.
        out: optional ``[num_seqs, num_q_heads, head_dim]`` output buffer (e.g. a static CUDA graph
            buffer); allocated when None.
        num_splits: context splits per sequence (1 = no merge kernel); default
            :func:`choose_num_splits`.
        max_context_len: optional upper bound of ``context_lens`` known on the host, used only to
            avoid pointless splits; leave None under CUDA graphs.
        block_n: tokens per inner iteration (power of two, at least 16); default
            :func:`decode_kernel_config` for the cache's dtype (16 for ``head_dim`` over 128).
        num_warps: Triton warps per program; default :func:`decode_kernel_config`.
        num_stages: Triton software-pipelining depth of the context loop; default
            :func:`decode_kernel_config`.
        sliding_window: None (attend the whole context) or ``W >= 1``: attend only the last
            ``W`` positions of each context (Mistral's and Gemma 3's local layers).
        k_scale, v_scale: the layer's scales of an fp8 cache (stored value times scale is the
            key / value); ignored for a cache in ``q``'s dtype.
        fp8_dot_dtype: with an fp8 cache and a 16-bit ``q``, the dtype the keys, values and query
            are widened to for the dot products: ``torch.float16`` (the default: e4m3 to fp16 is
            one hardware conversion per pair of values on Hopper, and exact) or ``q.dtype``. A
            16-bit ``q`` outside fp16's range (above 65,504 in magnitude) needs ``q.dtype``.

    Returns:
        ``out``: ``[num_seqs, num_q_heads, head_dim]`` in ``q``'s dtype.

    Raises:
        ValueError: on shape or dtype mismatches.
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [num_seqs, num_q_heads, head_dim], got {tuple(q.shape)}")
    if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
        raise ValueError(
            "kv_cache must be [num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim], "
            f"got {tuple(kv_cache.shape)}"
        )
    num_seqs, num_q_heads, head_dim = q.shape
    _, num_layers, _, num_kv_heads, block_size, kv_head_dim = kv_cache.shape
    if kv_head_dim != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, kv_cache has {kv_head_dim}")
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} out of range for {num_layers} layers")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    kv_fp8 = kv_cache.dtype == torch.float8_e4m3fn
    if q.dtype != kv_cache.dtype and not kv_fp8:
        raise ValueError(f"q dtype {q.dtype} differs from kv_cache dtype {kv_cache.dtype}")
    if block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    if head_dim < 16:
        raise ValueError(f"head_dim must be at least 16, got {head_dim}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}")
    if context_lens.shape != (num_seqs,):
        raise ValueError(f"context_lens must be [num_seqs], got {tuple(context_lens.shape)}")
    if q.stride(-1) != 1 or kv_cache.stride(-1) != 1 or block_tables.stride(-1) != 1:
        raise ValueError("q, kv_cache and block_tables need a contiguous last dimension")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or at least 1, got {sliding_window}")
    if fp8_dot_dtype is None:
        fp8_dot_dtype = torch.float16 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    if fp8_dot_dtype not in (torch.float16, q.dtype):
        raise ValueError(f"fp8_dot_dtype must be torch.float16 or q's dtype {q.dtype}, got {fp8_dot_dtype}")

    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim")
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, q.device, max_context_len)
    if not 1 <= num_splits <= MAX_NUM_SPLITS:
        raise ValueError(f"num_splits must be in [1, {MAX_NUM_SPLITS}], got {num_splits}")
    cfg = decode_kernel_config()
    group = num_q_heads // num_kv_heads
    kv_layer = kv_cache[:, layer]  # [num_blocks, 2, Hkv, block_size, D]
    # Triton launch parameters given by the caller (tuning sweeps) keep the Triton kernel.
    mma = (kv_fp8 and bool(cfg.fp8_mma) and block_n is None and num_warps is None
           and num_stages is None
           and paged_decode_fp8.supports(q, kv_layer, group, sliding_window, fp8_dot_dtype,
                                         cfg.fp8_mma_warps))
    if block_n is None:
        block_n = (cfg.fp8_block_n if kv_fp8 else cfg.block_n) if head_dim <= 128 else 16
    if num_warps is None:
        num_warps = cfg.fp8_num_warps if kv_fp8 else cfg.num_warps
    if num_stages is None:
        num_stages = cfg.fp8_num_stages if kv_fp8 else cfg.num_stages

    split = num_splits > 1 or mma  # the CUDA kernel always hands its pieces to the merge
    part_out, part_max, part_sum = _partial_buffers(out, context_lens, num_splits, split)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_seqs, num_kv_heads, num_splits)
    if mma:
        paged_decode_fp8.paged_decode_fp8_split(
            part_out, part_max, part_sum, q, kv_layer, block_tables, context_lens,
            scale * _LOG2_E * k_scale, v_scale, num_splits, cfg.fp8_mma_warps)
    else:
        _paged_decode_split_kernel[grid](
            out,
            part_out,
            part_max,
            part_sum,
            q,
            kv_layer,
            block_tables,
            context_lens,
            scale * _LOG2_E * (k_scale if kv_fp8 else 1.0),
            sliding_window or 0,
            v_scale if kv_fp8 else 1.0,
            num_seqs,
            num_splits,
            q.stride(0),
            q.stride(1),
            out.stride(0),
            out.stride(1),
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            kv_layer.stride(3),
            block_tables.stride(0),
            part_out.stride(0) if split else 0,
            part_out.stride(1) if split else 0,
            part_out.stride(2) if split else 0,
            part_max.stride(0) if split else 0,
            part_max.stride(1) if split else 0,
            QUERY_GROUP=group,
            GROUP_PAD=max(16, _next_power_of_2(group)),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=_next_power_of_2(head_dim),
            BLOCK_SIZE=block_size,
            BLOCK_N=block_n,
            SPLIT=split,
            DOT_PRECISION=precision,
            # Triton's CPU interpreter multiplies 16-bit float operands of tl.dot as raw integer bits
            # (seen in 3.6-3.9), so interpreted runs widen them first; rounding is unchanged.
            DOT_IN_FP32=q.device.type != "cuda",
            SLIDING=sliding_window is not None,
            KV_FP8=kv_fp8,
            FP8_DOT_FP16=kv_fp8 and fp8_dot_dtype == torch.float16 and q.dtype != torch.float16,
            num_warps=num_warps,
            num_stages=num_stages,
            **pdl.launch_options(q.device),
        )
    if split:
        _merge_pieces(out, part_out, part_max, part_sum, num_splits, num_warps=4)
    return out
