"""The CUDA backend of multi-head latent attention: the latent write and the absorbed-form decode
with Triton kernels, prefill with the torch ops of :class:`~pdserve.attention.mla.
MLAAttentionBackend`; its decode steps can be captured in CUDA graphs."""

from __future__ import annotations

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.mla import MLAAttentionBackend, MLAGeometry


class TritonMLAAttentionBackend(MLAAttentionBackend):
    """:class:`MLAAttentionBackend` with the latent entries written by
    :func:`pdserve.kernels.kv_cache.store_kv_cache` (through ``slot_mapping``: negative slots,
    the padding rows of a CUDA graph batch, write nothing; an fp8 cache quantizes with the
    layer's scales in the same launch) and decode attention by the split-K kernel
    :func:`pdserve.kernels.mla_decode.mla_decode_attention`. Neither synchronises with the host
    nor reads ``slot_block`` / ``decode_mask``, so a pure-decode step on
    :func:`~pdserve.attention.metadata.decode_metadata` can be captured
    (``supports_cuda_graphs``); the model's layers run their Triton ops
    (``uses_triton_kernels``: RMSNorm, rotary, SwiGLU, the fused MoE of the routed experts).

    Args:
        geometry, block_size, scale: as :class:`MLAAttentionBackend`.

    Raises:
        ImportError: Triton is not installed.
        ValueError: as :class:`MLAAttentionBackend`.
    """

    uses_triton_kernels = True
    supports_cuda_graphs = True

    def __init__(self, geometry: MLAGeometry, block_size: int, scale: float):
        super().__init__(geometry, block_size, scale)
        # module references, so that a test may reload them under Triton's interpreter
        from pdserve.kernels import kv_cache, mla_decode

        self._kv_cache_kernels = kv_cache
        self._decode_kernels = mla_decode

    def _write(self, kv_cache: torch.Tensor, layer: int, entry: torch.Tensor,
               meta: AttentionMetadata, k_scale: float, v_scale: float) -> None:
        """The entries ``[T, W]``: first halves into the K slot, second halves into the V slot,
        at ``meta.slot_mapping``."""
        half = kv_cache.shape[-1]
        self._kv_cache_kernels.store_kv_cache(
            entry[:, None, :half], entry[:, None, half:], kv_cache, layer, meta.slot_mapping,
            k_scale, v_scale)

    def _decode_latent(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                       meta: AttentionMetadata, k_scale: float, v_scale: float) -> torch.Tensor:
        """:func:`~pdserve.kernels.mla_decode.mla_decode_attention` of the decode rows' absorbed
        queries ``[B, H, W]`` -> ``[B, H, r]``."""
        assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
        return self._decode_kernels.mla_decode_attention(
            q.contiguous(), kv_cache, layer, meta.decode_block_tables, meta.decode_seq_lens,
            self.scale, self.geometry.kv_lora_rank, k_scale, v_scale)
