"""RMSNorm, optionally fused with the residual add of the decoder's residual stream."""

from __future__ import annotations

import torch

from pdserve.layers.custom_op import CustomOp
from pdserve.layers.weights import new_parameter


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, computed in float32 and cast back (as in HF Llama).

    Args:
        x: ``[..., hidden]``.
        weight: ``[hidden]``.
        eps: added to the mean square.
    """
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(CustomOp):
    """RMSNorm (Zhang & Sennrich, 2019) with a learned weight, matching Hugging Face
    ``LlamaRMSNorm`` / ``Qwen3RMSNorm`` (statistics in float32, the normalised value rounded to
    the input dtype, then multiplied by the weight).

    Called as ``norm(x)`` it returns the normalised ``x``; called as ``norm(x, residual)`` it
    first adds ``x`` to the residual stream and returns ``(normalised sum, sum)`` (the Triton op
    does both in one pass and updates ``residual`` in place).

    Args:
        hidden_size: size of the normalised (last) dim.
        eps: added to the mean square.
        dtype, device: where the weight lives.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device)

    def gain(self) -> torch.Tensor:
        """The per-feature factor applied after normalising: ``weight`` ``[hidden]``."""
        return self.weight

    def forward_torch(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x`` ``[..., hidden]``; with ``residual`` (same shape) -> ``(out, x + residual)``."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        residual = x + residual
        return rms_norm(residual, self.weight, self.eps), residual

    def forward_triton(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """As :meth:`forward_torch` with :func:`pdserve.kernels.rms_norm.rms_norm`; ``x`` is
        ``[T, hidden]`` and ``residual`` is updated in place."""
        from pdserve.kernels import rms_norm as kernels

        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual), residual


class GemmaRMSNorm(torch.nn.Module):
    """Gemma's RMSNorm: ``x / rms(x) * (1 + weight)`` computed in float32 and rounded once to
    the input dtype, matching Hugging Face ``Gemma3RMSNorm`` (its weight is stored as an offset
    from 1; the product is taken before the rounding, unlike :class:`RMSNorm`).

    Args:
        hidden_size: size of the normalised (last) dim.
        eps: added to the mean square.
        dtype, device: where the weight lives.
    """

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.eps = eps
        self.weight = new_parameter((hidden_size,), dtype, device)

    def gain(self) -> torch.Tensor:
        """The per-feature factor applied after normalising: ``1 + weight`` ``[hidden]``
        (float32)."""
        return 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., hidden]`` -> normalised ``[..., hidden]`` in ``x``'s dtype."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
