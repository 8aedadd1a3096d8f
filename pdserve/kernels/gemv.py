"""Linear layer for one or two rows (Triton): ``y = x W^T (+ b)`` read at the weight's bandwidth.

A decode step of one or two sequences multiplies a ``[1, K]`` or ``[2, K]`` activation by every
weight matrix of the model. This is a matrix-vector product bound by reading ``W`` once; cuBLAS
reads it well below the copy bandwidth at one row, and cuts ``down_proj`` in two kernels (split-K
and its reduce). Here each program owns ``BLOCK_N`` output features and walks the whole ``K``
dimension in ``BLOCK_K`` steps, keeping ``BLOCK_M x BLOCK_N x BLOCK_K`` float32 partial products in
registers and summing them once at the end, so there are many small programs in flight, no tensor
cores (which would pad the rows to 16) and no second kernel (``benchmarks/decode_latency.py
--kernels`` times it next to ``F.linear``; docs/benchmarks.md, "Measurements moved out of code
comments").

The launch grid depends only on shapes, so the kernel is captured in CUDA graphs; it also runs on
CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check
it. Import this module only where Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl

#: The most rows :func:`small_batch_linear` takes (see :func:`preferred` for when it is used).
MAX_ROWS = 2
_BLOCK_N = 4
_BLOCK_K = 512


@triton.jit
def _gemv_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K]
    b_ptr,  # [N] (HAS_BIAS)
    y_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_ym,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + offs_k) < K
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :],
                    mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
    y = tl.sum(acc, 2)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def preferred(rows: int, out_features: int, in_features: int) -> bool:
    """Whether :func:`small_batch_linear` beats cuBLAS for this product, by the timings of
    Qwen3-0.6B's projections (docs/benchmarks.md, "Batch-1 decode latency", and "Measurements
    moved out of code comments"): at one row always; at two rows only for a weight no wider than
    it is long (``o_proj``, ``down_proj``; ``qkv_proj`` and ``gate_up_proj`` lose to cuBLAS
    there); never from three rows on."""
    return rows == 1 or (rows == 2 and out_features <= in_features)


def small_batch_linear(x: torch.Tensor, weight: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x W^T + b`` for at most :data:`MAX_ROWS` rows, accumulated in float32.

    Args:
        x: ``[M, K]`` with ``1 <= M <= MAX_ROWS``, last dim contiguous.
        weight: ``[N, K]``, last dim contiguous, same dtype as ``x``.
        bias: optional ``[N]``.

    Returns:
        ``[M, N]`` in ``x``'s dtype, without waiting for the GPU.

    Raises:
        ValueError: on shape, layout or dtype mismatches, or more than :data:`MAX_ROWS` rows.
    """
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] expected, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"small_batch_linear takes 1 to {MAX_ROWS} rows, got {rows}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight need a contiguous last dimension")
    if x.dtype != weight.dtype or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"dtype or bias mismatch: x {x.dtype}, weight {weight.dtype}, "
                         f"bias {None if bias is None else tuple(bias.shape)}")
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, _BLOCK_N),)](
        x, weight, weight if bias is None else bias, y, rows, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=triton.next_power_of_2(rows), BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K, num_warps=4, num_stages=3,
        **pdl.launch_options(x.device))
    return y
