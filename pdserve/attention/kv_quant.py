"""FP8 (e4m3) KV cache: the stored dtype, per-layer scales, and the torch quantize / dequantize
that the attention backends use on the paths without a Triton kernel.

A key or value ``x`` is stored as ``fp8(clamp(x * (1 / scale), -448, 448))`` and read back as
``float(stored) * scale`` (the convention of vLLM's fp8 KV cache, whose ``k_scale`` / ``v_scale``
divide on write and multiply on read). 448 is the largest finite float8 e4m3fn value; the clamp
makes the conversion saturate on every device (the Triton KV-write kernel clamps the same way).

Scales, one per layer for K and one for V, come from the weights (:func:`scale_for_bound`, fed
by the model's ``kv_cache_scales``). e4m3 keeps 3 mantissa bits (a relative rounding error of at
most 2^-4) from 2^-6 up to 448, about 15 binades; below 2^-6 values lose precision (subnormals),
above 448 they saturate. vLLM uses scale 1.0 when a checkpoint carries no calibrated scales; with
it a large share of the embedded SmolLM2's small first-layer values are subnormal
(docs/benchmarks.md, "Measurements moved out of code comments"). Instead, each layer's scale is an
upper bound of what it can store, divided by 448: the input of the K/V projection is
RMS-normalised, ``u = x / rms(x)`` with ``||u||_2 <= sqrt(hidden)``, times the norm weight ``g``,
so by Cauchy-Schwarz
``|v_i| <= ||W_v[i] * g||_2 * sqrt(hidden) + |b_i|``; keys get the same bound times sqrt(2)
(the rotary embedding mixes pairs of dimensions, each pair's norm is kept), or, after a
per-head key norm (Qwen3), ``max|g_k| * sqrt(head_dim)``. The bound always holds, so nothing
saturates; it is loose by up to about ``sqrt(hidden)`` (about 5 binades), which leaves some 10
binades above the subnormals for typical values. The scale is rounded up to a power of two
(exact scaling, and the same scale on two instances whose weights differ by rounding, e.g. a
bf16 GPU and a float32 CPU copy); the scales are part of the KV compatibility check of a P/D
pair. Calibrated scales (from activations) can be given per layer through
:class:`KVCacheScales` without changing the kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.types.engine_config import KVCacheDtype

FP8_KV_DTYPE = torch.float8_e4m3fn
FP8_E4M3_MAX = 448.0


def kv_cache_torch_dtype(kind: KVCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the KV cache tensor: ``model_dtype`` for ``AUTO``, else
    ``torch.float8_e4m3fn``."""
    return model_dtype if kind is KVCacheDtype.AUTO else FP8_KV_DTYPE


@dataclass(frozen=True)
class KVCacheScales:
    """Per-layer scales of an fp8 KV cache (module docstring for the convention).

    Attributes:
        k: ``num_layers`` positive floats, the key scale of each layer.
        v: ``num_layers`` positive floats, the value scale of each layer.

    Raises:
        ValueError: lengths differ, or a scale is not a positive finite number.
    """

    k: tuple[float, ...]
    v: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v):
            raise ValueError(f"{len(self.k)} key scales but {len(self.v)} value scales")
        if not all(0.0 < s < float("inf") for s in self.k + self.v):
            raise ValueError("KV cache scales must be positive finite numbers")

    @classmethod
    def unit(cls, num_layers: int) -> "KVCacheScales":
        """Scale 1.0 for the keys and values of every layer (vLLM's default without
        calibration)."""
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def of_layer(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer``."""
        return self.k[layer], self.v[layer]


# Headroom over a bound before rounding to a power of two: the bound is computed in float32, the
# projection itself runs in 16-bit floats.
_BOUND_MARGIN = 1.01


def scale_for_bound(bound: float) -> float:
    """The scale that stores values up to ``bound`` (>= 0) without saturating: the smallest power
    of two ``>= bound * 1.01 / 448`` (1.0 for a bound of 0)."""
    if not bound > 0.0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(bound * _BOUND_MARGIN / FP8_E4M3_MAX))


def projection_row_bounds(weight: torch.Tensor, norm_weight: torch.Tensor,
                          bias: torch.Tensor | None) -> torch.Tensor:
    """Largest ``|y_i|`` of ``y = weight @ (norm_weight * u) + bias`` over every ``u`` with
    ``||u||_2 <= sqrt(hidden)`` (an RMS-normalised input), by Cauchy-Schwarz.

    Args:
        weight: ``[out, hidden]``.
        norm_weight: ``[hidden]``, the RMSNorm weight in front of the projection.
        bias: ``[out]`` or None.

    Returns:
        ``[out]`` float32 bounds.
    """
    rows = (weight.float() * norm_weight.float()).norm(dim=1) * math.sqrt(weight.shape[1])
    return rows if bias is None else rows + bias.float().abs()


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype = FP8_KV_DTYPE) -> torch.Tensor:
    """``x`` (any shape, any float dtype) as stored in an fp8 cache: ``x / scale`` in float32,
    clamped to ``[-448, 448]``, rounded to nearest-even e4m3."""
    return (x.float() * (1.0 / scale)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Stored fp8 values ``x`` (any shape) as ``dtype`` values: ``float(x) * scale``. Every e4m3
    value is exact in fp16, bf16 and float32."""
    out = x.to(dtype)
    return out if scale == 1.0 else out.mul_(scale)


def round_trip(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as attention reads it back from a cache of ``cache_dtype``: unchanged when the cache
    stores ``x.dtype``, else quantized and dequantized (same shape and dtype as ``x``)."""
    if cache_dtype == x.dtype:
        return x
    return dequantize(quantize(x, scale, cache_dtype), scale, x.dtype)
