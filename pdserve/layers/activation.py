"""Gated activations of a fused gate|up projection: SwiGLU ``silu(gate) * up`` and GeGLU
``gelu_tanh(gate) * up``."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.layers.custom_op import CustomOp


class SiluAndMul(CustomOp):
    """``silu(x[:, :n]) * x[:, n:]`` for ``x`` ``[T, 2 * n]`` (gate first, then up) -> ``[T, n]``
    (Shazeer, *GLU variants improve transformer*, 2020)."""

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """Two torch ops (``F.silu`` then the product)."""
        n = x.shape[-1] // 2
        gate, up = x.split([n, n], dim=-1)
        return F.silu(gate) * up

    def forward_triton(self, x: torch.Tensor) -> torch.Tensor:
        """One pass (:func:`pdserve.kernels.activation.silu_and_mul`)."""
        from pdserve.kernels import activation as kernels

        return kernels.silu_and_mul(x)


class GeluTanhAndMul(torch.nn.Module):
    """GeGLU with the tanh approximation of GELU: ``gelu_tanh(x[:, :n]) * x[:, n:]`` for ``x``
    ``[T, 2 * n]`` (gate first, then up) -> ``[T, n]`` (Shazeer, *GLU variants improve
    transformer*, 2020; Hugging Face's ``gelu_pytorch_tanh``, used by Gemma 3)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Two torch ops (``F.gelu(approximate="tanh")`` then the product)."""
        n = x.shape[-1] // 2
        gate, up = x.split([n, n], dim=-1)
        return F.gelu(gate, approximate="tanh") * up
