"""Split stage of paged decode attention over an fp8 (e4m3) KV cache: a CUDA C++ kernel on
tensor cores, compiled at run time with NVRTC, for GPUs of compute capability 8.9 and later.

Why not Triton: for the second dot product (probabilities times values) Triton stages the 8-bit
value tile in shared memory and reads it back one byte at a time in the transposed operand
layout, and its tiles pad a query group of 2 (Qwen3-0.6B: 2 query heads per KV head) to 16 rows,
so the Triton kernel of :mod:`pdserve.kernels.paged_decode` reaches a much smaller share of
the paged read bandwidth with an fp8 cache than with a bf16 one and stays latency bound on its
registers (docs/benchmarks.md, "What the fp8 decode step is made of"). This kernel feeds
``mma.sync.m16n8k16`` (f16 operands, f32 accumulators) straight from registers loaded from
global memory, and chooses the head-dimension order of each operand so that no data moves
between lanes:

- ``S^T = Q K^T`` with the queries as the 16-row operand (query heads on rows; up to 8 heads of a
  group, the rest zero) and 8 tokens as the columns: lane ``(r, c)`` (``r = lane / 4``, ``c =
  lane % 4``) loads 32 contiguous key bytes of token ``r`` (dims ``32c .. 32c+31``), and the k-step
  order of the head dims is chosen to match, so each 32-bit word becomes two operand registers
  with two ``cvt.rn.f16x2.e4m3x2`` and no permutes;
- the accumulator of ``S^T`` is, per lane, exactly the ``P^T`` operand of ``O^T = V^T P^T``
  (the FlashAttention-2 register reuse, here on the transposed product), after the online
  softmax (Milakov & Gimelshein, 2018) of head ``r``;
- ``V^T`` is the 16-row operand: m-tile ``i`` holds dims ``8r + i`` and ``8(r+8) + i``, so a lane
  loads 8 contiguous value bytes per token and row half, and a byte permute (``prmt``) pairs two
  tokens' bytes of one dim before the conversion.

A 16-token tile of one KV head is one block's worth of 12 vector loads per lane; each warp keeps
the next tile's loads in flight while it computes the current one (two register buffers), and
takes its tiles' block ids from one preloaded register per lane by shuffles. Warps merge their
online-softmax states through shared memory at the end. On Hopper the kernel is a programmatic
dependent launch (:mod:`pdserve.kernels.pdl`): it reads the step's context lengths and block
tables, then waits for the kernel ahead before it reads queries or cache or writes anything.

The work split and the outputs are those of the Triton split kernel (grid: sequence x KV head x
piece; piece length ``ceil(ceil(max_context / num_splits) / 64) * 64`` tokens; normalised fp32
partial outputs, log2-domain maxima and sums), so the Triton merge kernel of
:mod:`pdserve.kernels.paged_decode` combines the pieces. :func:`paged_decode_fp8_split` is called
from :func:`pdserve.kernels.paged_decode.paged_decode_attention`, which checks shapes and runs
it where :func:`supports` says it applies. The numerics match the Triton kernel's fp16 dot
products: queries rounded to fp16 (after the softmax scale), fp8 values exact in fp16,
probabilities rounded to fp16, fp32 accumulation.

The module stays whole past ~450 lines: the CUDA source, its compilation and its launch are one
unit.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from pdserve.kernels import pdl

logger = logging.getLogger("pdserve.kernels")

CUDA_SOURCE = r"""
typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned char u8;

struct __align__(16) Vec16 { u32 x, y, z, w; };
struct __align__(8) Vec8 { u32 x, y; };

__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Two e4m3 values (bits 0-7 and 8-15 of w, shifted down by `hi` halves) to an f16x2.
__device__ __forceinline__ u32 e4m3x2_lo(u32 w) {
    u32 r;
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, a;\n\t}" : "=r"(r) : "r"(w));
    return r;
}
__device__ __forceinline__ u32 e4m3x2_hi(u32 w) {
    u32 r;
    asm("{\n\t.reg .b16 a, b;\n\tmov.b32 {a, b}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, b;\n\t}" : "=r"(r) : "r"(w));
    return r;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

template <bool BF16>
__device__ __forceinline__ float half_to_f32(u32 h) {
    if (BF16) {
        return __uint_as_float(h << 16);
    } else {
        float f;
        asm("{\n\t.reg .b16 a;\n\tcvt.u16.u32 a, %1;\n\tcvt.f32.f16 %0, a;\n\t}" : "=f"(f) : "r"(h));
        return f;
    }
}

// D += A * B, m16n8k16, f16 inputs, f32 accumulators (PTX ISA fragment layouts).
__device__ __forceinline__ void mma16816(float* d, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One 16-token tile of one KV head as lane (r, c) needs it: keys of tokens r and 8 + r (bytes
// 32c .. 32c+31), values of tokens 2c, 2c+1, 2c+8, 2c+9 (bytes 8r .. 8r+7 and 8(r+8) ..).
struct Tile {
    Vec16 k[2][2];  // [n-tile][half]
    Vec8 v[4][2];   // [token 2c, 2c+1, 2c+8, 2c+9][row half r / r+8]
};

// Tokens at or past `end` read the context's last token instead (the tile's first token is before
// `end` and the tile lies in one block, so that token is in the same block): a cache slot past
// the context may hold any bytes, NaN included, and a zero probability times NaN is NaN. A token
// is 128 bytes (head_dim 128, one byte each) after the previous one in a block.
__device__ __forceinline__ void load_tile(Tile& tl, const u8* kvh_base, int blk, int t0, int end,
                                          int block_shift, int stride_kv_b, int stride_kv_kv,
                                          int r, int c) {
    const u8* base = kvh_base + (long long)blk * stride_kv_b + (t0 & ((1 << block_shift) - 1)) * 128;
    const u8* kb = base + 32 * c;
    const u8* vb = base + stride_kv_kv;
    int tk[2] = {r, 8 + r};
    int tv[4] = {2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9};
    if (t0 + 16 > end) {  // the piece's last tile (warp-uniform branch)
        const int last = end - 1 - t0;
#pragma unroll
        for (int n = 0; n < 2; ++n) tk[n] = min(tk[n], last);
#pragma unroll
        for (int j = 0; j < 4; ++j) tv[j] = min(tv[j], last);
    }
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        const Vec16* p = reinterpret_cast<const Vec16*>(kb + tk[n] * 128);
        tl.k[n][0] = p[0];
        tl.k[n][1] = p[1];
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u8* p = vb + tv[j] * 128;
        tl.v[j][0] = *reinterpret_cast<const Vec8*>(p + 8 * r);
        tl.v[j][1] = *reinterpret_cast<const Vec8*>(p + 8 * (r + 8));
    }
}

// The online softmax step of one tile: S^T = Q K^T on tensor cores (rows = query heads, only
// r < G real), the running max and sum of head r, then O^T += V^T P^T.
__device__ __forceinline__ void compute_tile(const Tile& tl, int t0, int end, const u32* qa,
                                             const u32* qb, u32 zero, float (*acc)[4], float& m,
                                             float& l, int r, int c) {
    const float NEG_INF = __int_as_float(0xff800000);
    const unsigned FULL = 0xffffffffu;
    // S^T (head r) for tokens 2c, 2c+1 (n-tile 0) and 8+2c, 9+2c (n-tile 1).
    float sc[2][4];
#pragma unroll
    for (int n = 0; n < 2; ++n) {
        sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
        const u32 w[8] = {tl.k[n][0].x, tl.k[n][0].y, tl.k[n][0].z, tl.k[n][0].w,
                          tl.k[n][1].x, tl.k[n][1].y, tl.k[n][1].z, tl.k[n][1].w};
#pragma unroll
        for (int s = 0; s < 8; ++s)
            mma16816(sc[n], qa[s], zero, qb[s], zero, e4m3x2_lo(w[s]), e4m3x2_hi(w[s]));
    }
    float p[4] = {sc[0][0], sc[0][1], sc[1][0], sc[1][1]};
    const int tok[4] = {2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c};
    float tmax = NEG_INF;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        p[j] = (t0 + tok[j] < end) ? p[j] : NEG_INF;
        tmax = fmaxf(tmax, p[j]);
    }
    tmax = fmaxf(tmax, __shfl_xor_sync(FULL, tmax, 1));
    tmax = fmaxf(tmax, __shfl_xor_sync(FULL, tmax, 2));
    const float mn = fmaxf(m, tmax);
    if (__any_sync(FULL, mn > m)) {  // rescale only when some head's max grew
        const float alpha = ex2(m - mn);
        l *= alpha;
        const float a0 = __shfl_sync(FULL, alpha, 8 * c);      // head 2c
        const float a1 = __shfl_sync(FULL, alpha, 8 * c + 4);  // head 2c + 1
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[i][0] *= a0;
            acc[i][1] *= a1;
            acc[i][2] *= a0;
            acc[i][3] *= a1;
        }
        m = mn;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        p[j] = ex2(p[j] - m);
        l += p[j];
    }
    // The P^T fragment (k = tokens, n = heads) is exactly this lane's four probabilities.
    const u32 pb0 = pack_f16x2(p[0], p[1]), pb1 = pack_f16x2(p[2], p[3]);
    // V^T fragments: m-tile i holds head dims 8r + i (rows r) and 8(r + 8) + i (rows r + 8);
    // byte permutes pair the tokens of each dim, one conversion gives two m-tiles' pairs.
#pragma unroll
    for (int h = 0; h < 2; ++h) {      // word of the 8 bytes: dims +0..3, +4..7
#pragma unroll
        for (int b = 0; b < 2; ++b) {  // byte pair within the word: dims +0,1 / +2,3
            const u32 sel = b ? 0x7362u : 0x5140u;
            const u32 w00 = prmt(h ? tl.v[0][0].y : tl.v[0][0].x, h ? tl.v[1][0].y : tl.v[1][0].x, sel);
            const u32 w01 = prmt(h ? tl.v[0][1].y : tl.v[0][1].x, h ? tl.v[1][1].y : tl.v[1][1].x, sel);
            const u32 w10 = prmt(h ? tl.v[2][0].y : tl.v[2][0].x, h ? tl.v[3][0].y : tl.v[3][0].x, sel);
            const u32 w11 = prmt(h ? tl.v[2][1].y : tl.v[2][1].x, h ? tl.v[3][1].y : tl.v[3][1].x, sel);
            const int i0 = 4 * h + 2 * b;
            mma16816(acc[i0], e4m3x2_lo(w00), e4m3x2_lo(w01), e4m3x2_lo(w10), e4m3x2_lo(w11), pb0, pb1);
            mma16816(acc[i0 + 1], e4m3x2_hi(w00), e4m3x2_hi(w01), e4m3x2_hi(w10), e4m3x2_hi(w11), pb0, pb1);
        }
    }
}

// grid (num_seqs, num_kv_heads, num_splits), NW warps; head_dim 128, G <= 8 query heads per KV
// head, block_size a multiple of 16. Lane = 4 * r + c (r = lane / 4, c = lane % 4).
template <int G, int NW, bool Q_BF16, bool PDL>
__global__ void __launch_bounds__(NW * 32) paged_decode_fp8_split(
    float* __restrict__ part_out,        // [S, Hq, P, D] normalised partial outputs
    float* __restrict__ part_max,        // [S, Hq, P] running max of log2-scaled scores
    float* __restrict__ part_sum,        // [S, Hq, P] softmax denominators
    const u16* __restrict__ q,           // [S, Hq, D] bf16 or fp16
    const u8* __restrict__ kv,           // the layer's view [num_blocks, 2, Hkv, block_size, D]
    const int* __restrict__ block_tables,
    const int* __restrict__ context_lens,
    double scale_log2_d, double v_scale_d,
    int num_seqs, int num_splits, int split_align, int block_shift,
    int stride_q_s, int stride_q_h,
    int stride_kv_b, int stride_kv_kv, int stride_kv_h,
    int stride_bt_s, int stride_po_s, int stride_po_h, int stride_po_p,
    int stride_pm_s, int stride_pm_h)
{
    constexpr int D = 128;
    constexpr int TILE = 16;
    const float NEG_INF = __int_as_float(0xff800000);
    const unsigned FULL = 0xffffffffu;
    const int seq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int r = lane >> 2, c = lane & 3;

    __shared__ int s_ctx[NW];
    __shared__ float s_m[NW][8];
    __shared__ float s_l[NW][8];
    __shared__ float s_acc[NW][G][D];

    // The batch's longest context fixes the piece length (as in the Triton split kernel).
    int mx = 0;
    for (int i = tid; i < num_seqs; i += NW * 32) mx = max(mx, context_lens[i]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = max(mx, __shfl_xor_sync(FULL, mx, o));
    if (lane == 0) s_ctx[warp] = mx;
    __syncthreads();
    mx = s_ctx[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) mx = max(mx, s_ctx[w]);
    const int ctx = context_lens[seq];
    const int per = ((mx + num_splits - 1) / num_splits + split_align - 1) / split_align * split_align;
    const int start = split * per;
    const int end = min(start + per, ctx);
    const long long pm = (long long)seq * stride_pm_s + (long long)kvh * G * stride_pm_h + split;
    const u8* kvh_base = kv + (long long)kvh * stride_kv_h;
    const int* bt = block_tables + (long long)seq * stride_bt_s;
    // The piece's 16-token tiles; warp w takes tiles w, w + NW, ... Lane j holds the block id of
    // the warp's j-th tile of the current 32, so a tile's address needs a shuffle, not a load.
    const int ntiles = (end - start + TILE - 1) / TILE;
    int blk_lane = 0;
    {
        const int jt = warp + lane * NW;
        if (jt < ntiles) blk_lane = bt[(start + jt * TILE) >> block_shift];
    }

    // Up to here the kernel read only step inputs that earlier copies wrote; the queries and the
    // cache are written by the kernel ahead (and every output buffer may still be in its use).
    if constexpr (PDL) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;" :::);
    }
    if (start >= end) {  // an empty piece: zero weight for the merge, output left unwritten
        if (tid < G) {
            part_max[pm + tid * stride_pm_h] = NEG_INF;
            part_sum[pm + tid * stride_pm_h] = 0.f;
        }
        return;
    }

    // Software pipeline over two register buffers: the next tile's loads are in flight while
    // this one is computed (unrolled by two so that no buffer is copied).
    auto fetch = [&](Tile& tl, int nth, int k) {  // the warp's nth tile, tile k of the piece
        const int j = nth & 31;
        if (j == 0 && nth > 0) {
            const int jt = k + lane * NW;
            blk_lane = jt < ntiles ? bt[(start + jt * TILE) >> block_shift] : 0;
        }
        load_tile(tl, kvh_base, __shfl_sync(FULL, blk_lane, j), start + k * TILE, end, block_shift,
                  stride_kv_b, stride_kv_kv, r, c);
    };
    Tile ta, tb;
    int kt = warp, step = 0;  // tile of the piece, tile of this warp
    if (kt < ntiles) fetch(ta, 0, kt);  // in flight while the queries are loaded

    // This lane's 32 query values (head r, dims 32c .. 32c+31).
    Vec16 qraw[4];
    if (r < G) {
        const Vec16* qp = reinterpret_cast<const Vec16*>(
            q + (long long)seq * stride_q_s + (long long)(kvh * G + r) * stride_q_h + c * 32);
#pragma unroll
        for (int h = 0; h < 4; ++h) qraw[h] = qp[h];
    } else {
#pragma unroll
        for (int h = 0; h < 4; ++h) qraw[h] = Vec16{0u, 0u, 0u, 0u};
    }

    // Query fragments: A of S^T = Q K^T (rows = query heads, only r < G real; rows 8-15 zero),
    // pre-scaled into the log2 domain. Within k-step s, the logical columns 2c, 2c+1 / 2c+8, 2c+9
    // are head dims 32c+4s+{0,1} / 32c+4s+{2,3}: the key fragments then come from 32 contiguous
    // bytes per lane, with no byte permutes.
    const float sl2 = (float)scale_log2_d;
    u32 qa[8], qb[8];
    u32 zero;  // rows 8-15 of the query operand (an opaque zero: one register, not a move per use)
    asm volatile("mov.b32 %0, 0;" : "=r"(zero));
#pragma unroll
    for (int h = 0; h < 4; ++h) {
        const u32 w[4] = {qraw[h].x, qraw[h].y, qraw[h].z, qraw[h].w};
#pragma unroll
        for (int j = 0; j < 2; ++j) {  // step s = 2h + j: words w[2j] (dims +0,+1), w[2j+1] (+2,+3)
            const u32 x = w[2 * j], y = w[2 * j + 1];
            qa[2 * h + j] = pack_f16x2(half_to_f32<Q_BF16>(x & 0xffffu) * sl2,
                                       half_to_f32<Q_BF16>(x >> 16) * sl2);
            qb[2 * h + j] = pack_f16x2(half_to_f32<Q_BF16>(y & 0xffffu) * sl2,
                                       half_to_f32<Q_BF16>(y >> 16) * sl2);
        }
    }

    // O^T accumulators: m-tile i, rows d = 8r + i (acc[i][0..1]) and 8(r+8) + i (acc[i][2..3]),
    // columns = query heads 2c, 2c+1.
    float acc[8][4];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    float m = -1e30f;  // running max of head r (finite: exp2 of differences stays defined)
    float l = 0.f;     // this lane's part of head r's denominator

    while (kt < ntiles) {
        if (kt + NW < ntiles) fetch(tb, step + 1, kt + NW);
        compute_tile(ta, start + kt * TILE, end, qa, qb, zero, acc, m, l, r, c);
        kt += NW;
        ++step;
        if (kt >= ntiles) break;
        if (kt + NW < ntiles) fetch(ta, step + 1, kt + NW);
        compute_tile(tb, start + kt * TILE, end, qa, qb, zero, acc, m, l, r, c);
        kt += NW;
        ++step;
    }

    // Head r's denominator over the lane's quad, then the warps' states through shared memory.
    l += __shfl_xor_sync(FULL, l, 1);
    l += __shfl_xor_sync(FULL, l, 2);
    if (c == 0) {
        s_m[warp][r] = m;
        s_l[warp][r] = l;
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
        const int g = 2 * c + k;
        if (g < G) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                s_acc[warp][g][8 * r + i] = acc[i][k];
                s_acc[warp][g][8 * (r + 8) + i] = acc[i][2 + k];
            }
        }
    }
    __syncthreads();
    const float v_scale = (float)v_scale_d;
    for (int e = tid; e < G * D; e += NW * 32) {
        const int g = e / D, d = e % D;
        float mt = s_m[0][g];
#pragma unroll
        for (int w = 1; w < NW; ++w) mt = fmaxf(mt, s_m[w][g]);
        float lt = 0.f, at = 0.f;
#pragma unroll
        for (int w = 0; w < NW; ++w) {
            const float f = ex2(s_m[w][g] - mt);
            lt += s_l[w][g] * f;
            at += s_acc[w][g][d] * f;
        }
        const int head = kvh * G + g;
        part_out[(long long)seq * stride_po_s + (long long)head * stride_po_h
                 + (long long)split * stride_po_p + d] = at * v_scale / lt;
        if (d == 0) {
            part_max[pm + g * stride_pm_h] = mt;
            part_sum[pm + g * stride_pm_h] = lt;
        }
    }
}
"""

# Tokens per split piece are a multiple of this (the Triton split kernel's default block_n), so
# both kernels cut a batch into the same pieces.
SPLIT_ALIGN = 64
_TILE = 16


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute`` of the CUDA driver API (cuda.h): an id, padding, a 64-byte union."""

    _fields_ = [("id", ctypes.c_uint), ("pad", ctypes.c_char * 4), ("value", ctypes.c_ubyte * 64)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of the CUDA driver API (cuda.h)."""

    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


# CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION (cuda.h): the launch may begin once the
# kernel ahead has signalled griddepcontrol.launch_dependents (pdserve.kernels.pdl).
_PROGRAMMATIC_STREAM_SERIALIZATION = 6


@functools.lru_cache(maxsize=1)
def _driver() -> ctypes.CDLL:
    """The CUDA driver library with ``cuLaunchKernelEx`` typed."""
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                     ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


@functools.lru_cache(maxsize=None)
def _compiled(group: int, num_warps: int, q_bf16: bool, pdl: bool, device_index: int):
    """The kernel instance for these template arguments on one device,
    compiled once (about a second) with NVRTC through ``torch.cuda._compile_kernel`` (PyTorch's
    run-time compilation helper, 2.9 and later).

    Raises:
        RuntimeError: NVRTC or the driver refused the source.
    """
    name = (f"paged_decode_fp8_split<{group}, {num_warps}, {'true' if q_bf16 else 'false'}, "
            f"{'true' if pdl else 'false'}>")
    with torch.cuda.device(device_index):
        return torch.cuda._compile_kernel(CUDA_SOURCE, name)  # .func: its CUfunction


@functools.lru_cache(maxsize=None)
def _compiles(group: int, num_warps: int, q_bf16: bool, pdl: bool, device_index: int) -> bool:
    """Whether this kernel instance compiles and loads here; a failure (no NVRTC library, a
    driver that refuses the code) is logged once and leaves the call to Triton."""
    try:
        _compiled(group, num_warps, q_bf16, pdl, device_index)
    except (RuntimeError, OSError) as e:
        logger.warning("the CUDA fp8 decode kernel is not available here (%s); decode attention "
                       "runs the Triton kernel", e)
        return False
    return True


def supports(q: torch.Tensor, kv_layer: torch.Tensor, group: int, sliding_window: int | None,
             fp8_dot_dtype: torch.dtype, num_warps: int = 4) -> bool:
    """Whether :func:`paged_decode_fp8_split` handles this call.

    Args:
        q: ``[num_seqs, num_q_heads, head_dim]`` queries.
        kv_layer: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]`` one layer of the cache.
        group: query heads per KV head.
        sliding_window: the caller's window (None: the whole context).
        fp8_dot_dtype: the dtype the caller asked the dot products to run in.
        num_warps: the warps per program the caller will launch with.

    True for an e4m3 cache on a CUDA device of compute capability 8.9 or later (the e4m3 pair
    conversion), 16-bit queries with dot products in fp16, ``head_dim`` 128, at most 8 query
    heads per KV head (one tensor-core tile's 8 columns), blocks of a multiple of 16 tokens
    stored token after token (128 bytes each), no sliding window, and 16-byte aligned rows;
    false otherwise (the caller then runs Triton), also when the kernel does not compile here
    (checked once per instance, at the first call).
    """
    if (q.device.type != "cuda" or kv_layer.dtype != torch.float8_e4m3fn
            or q.dtype not in (torch.float16, torch.bfloat16) or fp8_dot_dtype != torch.float16
            or sliding_window is not None or q.shape[-1] != 128 or not 1 <= group <= 8
            or kv_layer.shape[3] % _TILE or kv_layer.shape[3] & (kv_layer.shape[3] - 1)):
        return False
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if _capability(device) < (8, 9):
        return False
    if q.data_ptr() % 16 or kv_layer.data_ptr() % 16 or q.stride(0) % 8 or q.stride(1) % 8:
        return False
    if kv_layer.stride(4) != 1 or kv_layer.stride(3) != 128:  # tokens of a block contiguous
        return False
    if any(s % 16 or s >= 2**31 for s in kv_layer.stride()[:3]):
        return False
    if not hasattr(torch.cuda, "_compile_kernel"):
        return False
    return _compiles(group, num_warps, q.dtype == torch.bfloat16, _uses_pdl(device), device)


@functools.lru_cache(maxsize=16)
def _capability(device_index: int) -> tuple[int, int]:
    """The compute capability of a CUDA device (asked once: the checks run at every call)."""
    return torch.cuda.get_device_capability(device_index)


def _uses_pdl(device_index: int) -> bool:
    """Whether launches on the device are programmatic dependent ones
    (:mod:`pdserve.kernels.pdl`)."""
    return pdl.device_supports(torch.device("cuda", device_index))


def paged_decode_fp8_split(
    part_out: torch.Tensor,
    part_max: torch.Tensor,
    part_sum: torch.Tensor,
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale_log2: float,
    v_scale: float,
    num_splits: int,
    num_warps: int = 4,
) -> None:
    """Write the split pieces of decode attention (the Triton split kernel's outputs) for the
    merge kernel of :mod:`pdserve.kernels.paged_decode`, on the current stream; a programmatic
    dependent launch (:mod:`pdserve.kernels.pdl`) on Hopper and later.

    Args:
        part_out: ``[num_seqs, num_q_heads, num_splits, 128]`` fp32, written for non-empty pieces.
        part_max, part_sum: ``[num_seqs, num_q_heads, num_splits]`` fp32: each piece's maximum of
            the log2-scaled scores and its sum of ``exp2(score - max)`` (0 for an empty piece).
        q: ``[num_seqs, num_q_heads, 128]`` bf16 or fp16.
        kv_layer: ``[num_blocks, 2, num_kv_heads, block_size, 128]`` e4m3, one layer's view.
        block_tables: ``[num_seqs, max_blocks]`` int32, contiguous rows.
        context_lens: ``[num_seqs]`` int32, contiguous.
        scale_log2: softmax scale times log2(e) times the key scale.
        v_scale: the value scale.
        num_splits: pieces per (sequence, KV head).
        num_warps: warps per program (docs/benchmarks.md, "Measurements moved out of code
            comments", compares 2, 4 and 8).

    The caller checks :func:`supports` and the shapes (``paged_decode_attention`` does).

    Raises:
        RuntimeError: the kernel could not be compiled or launched.
    """
    num_seqs, num_q_heads, _ = q.shape
    num_kv_heads, block_size = kv_layer.shape[2], kv_layer.shape[3]
    device = q.device.index if q.device.index is not None else torch.cuda.current_device()
    use_pdl = _uses_pdl(device)
    kernel = _compiled(num_q_heads // num_kv_heads, num_warps, q.dtype == torch.bfloat16,
                       use_pdl, device)
    c_int, c_ptr = ctypes.c_int, ctypes.c_void_p
    args = (
        c_ptr(part_out.data_ptr()), c_ptr(part_max.data_ptr()), c_ptr(part_sum.data_ptr()),
        c_ptr(q.data_ptr()), c_ptr(kv_layer.data_ptr()), c_ptr(block_tables.data_ptr()),
        c_ptr(context_lens.data_ptr()),
        ctypes.c_double(scale_log2), ctypes.c_double(v_scale),
        c_int(num_seqs), c_int(num_splits), c_int(SPLIT_ALIGN), c_int(block_size.bit_length() - 1),
        c_int(q.stride(0)), c_int(q.stride(1)),
        c_int(kv_layer.stride(0)), c_int(kv_layer.stride(1)), c_int(kv_layer.stride(2)),
        c_int(block_tables.stride(0)),
        c_int(part_out.stride(0)), c_int(part_out.stride(1)), c_int(part_out.stride(2)),
        c_int(part_max.stride(0)), c_int(part_max.stride(1)),
    )
    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value[0] = 1  # programmaticStreamSerializationAllowed
    config = _LaunchConfig(
        grid=(ctypes.c_uint * 3)(num_seqs, num_kv_heads, num_splits),
        block=(ctypes.c_uint * 3)(num_warps * 32, 1, 1),
        shared_mem_bytes=0,
        stream=torch.cuda.current_stream(device).cuda_stream,
        attrs=ctypes.pointer(attr) if use_pdl else None,
        num_attrs=1 if use_pdl else 0,
    )
    err = _driver().cuLaunchKernelEx(ctypes.byref(config), kernel.func, params, None)
    if err:
        raise RuntimeError(f"cuLaunchKernelEx of the fp8 decode kernel failed: CUDA error {err}")
