"""SwiGLU activation (Triton): ``silu(gate) * up`` of a fused gate|up projection in one pass.

Import only where Triton is installed; :class:`pdserve.layers.activation.SiluAndMul` picks this
op or its torch counterpart.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pdserve.kernels import pdl
from pdserve.kernels.common import next_power_of_2


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    n_cols,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl.enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # Rounded to the input dtype between the two operations, as torch's F.silu(gate) * up does.
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU activation of a fused gate|up projection: ``silu(x[:, :n]) * x[:, n:]``.

    One pass over the tensor instead of torch's two kernels (``F.silu`` then the product).

    Args:
        x: ``[num_tokens, 2 * n]`` (gate first, then up; last dim contiguous).
        out: optional ``[num_tokens, n]`` output buffer.

    Returns:
        ``[num_tokens, n]`` in ``x``'s dtype.

    Raises:
        ValueError: on a bad shape or a non-contiguous last dim.
    """
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * n], got {tuple(x.shape)}")
    n_rows, width = x.shape
    n = width // 2
    if out is None:
        out = torch.empty((n_rows, n), dtype=x.dtype, device=x.device)
    if out.shape != (n_rows, n) or x.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"out must be [{n_rows}, {n}] and both tensors need a contiguous last dim")
    if n_rows == 0:
        return out
    block = min(1024, next_power_of_2(n))
    _silu_and_mul_kernel[(n_rows, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, num_warps=4,
        **pdl.launch_options(x.device))
    return out
