"""RMSNorm (Triton), optionally fused with the residual add of the decoder's residual stream.

Import only where Triton is installed; :class:`pdserve.layers.norm.RMSNorm` picks this op or
its torch counterpart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.common import next_power_of_2


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    stride_x,
    stride_r,
    stride_o,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Add in the model dtype, as the reference models do, and hand the sum back as the new
        # residual stream.
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich, 2019) over the last dim, optionally fused with the residual add.

    Matches Hugging Face ``LlamaRMSNorm``/``Qwen3RMSNorm``: statistics in fp32, the normalised
    value rounded to the input dtype, then multiplied by ``weight``.

    Args:
        x: ``[num_tokens, hidden]`` (last dim contiguous).
        weight: ``[hidden]``.
        eps: added to the mean square.
        residual: optional ``[num_tokens, hidden]``; when given, ``x + residual`` is normalised and
            also written back into ``residual`` (in place).
        out: optional output buffer shaped like ``x``.

    Returns:
        The normalised ``[num_tokens, hidden]`` tensor (``out`` when given).
    """
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError("x must be [num_tokens, hidden] and weight [hidden], got "
                         f"{tuple(x.shape)}, {tuple(weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x")
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.stride(-1) != 1 or out.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs a contiguous last dimension")
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return out
    block = next_power_of_2(n_cols)
    _rms_norm_kernel[(n_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl.launch_options(x.device),
    )
    return out
