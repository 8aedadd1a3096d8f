"""Compute kernels of the model's CUDA path, one module per kernel family.

- :mod:`~pdserve.kernels.paged_decode`: split-K paged decode attention (Triton).
- :mod:`~pdserve.kernels.prefill_attention`: packed (varlen) FlashAttention prefill (torch op).
- :mod:`~pdserve.kernels.kv_cache`: KV cache write (Triton).
- :mod:`~pdserve.kernels.rms_norm`, :mod:`~pdserve.kernels.rotary`,
  :mod:`~pdserve.kernels.activation`: the layers' fused Triton ops.
- :mod:`~pdserve.kernels.sampling`: the sampler's fused inverse-CDF token draw (Triton).

Importing this package imports nothing; the Triton modules import ``triton`` and are imported
only where it is installed (the CUDA path). Layers and attention backends choose between these
kernels and their torch counterparts (docs/architecture.md).
"""
