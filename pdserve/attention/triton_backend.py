"""The CUDA attention backend: Triton KV writes (fused with the q/k norms and rotary embedding),
context gathers and split-K paged decode; prefill as the torch backend (one FlashAttention varlen
call per layer)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from pdserve.attention.metadata import AttentionMetadata
from pdserve.attention.torch_backend import TorchAttentionBackend

if TYPE_CHECKING:
    from pdserve.layers.rotary import QKRotation


class TritonAttentionBackend(TorchAttentionBackend):
    """CUDA backend: the KV write in the launch that norms and rotates queries and keys
    (:func:`pdserve.kernels.rotary.rotary_embedding_qk_store`; without a rotation
    :func:`pdserve.kernels.kv_cache.store_kv_cache`), the gather of prefill contexts with cached
    tokens (:mod:`pdserve.kernels.kv_cache`) and batched decode attention
    (:mod:`pdserve.kernels.paged_decode`, split-K) with Triton kernels; prefill as in
    :class:`TorchAttentionBackend`.

    The decode split count depends on the batch size alone (no context-length hint), so eager and
    graph-replayed decode steps of the same batch size compute the same bits. An fp8 KV cache is
    written and read by the same kernels with the layer's scales (:meth:`kv_scale`).

    Raises:
        ImportError: Triton is not installed (at construction).
    """

    uses_triton_kernels = True
    supports_cuda_graphs = True

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, scale)
        # Module references (not functions): a test may reload them under Triton's interpreter.
        from pdserve.kernels import kv_cache, paged_decode, rotary

        self._kv_cache_kernels = kv_cache
        self._decode_kernels = paged_decode
        self._rotary_kernels = rotary

    def _packed_prefill_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, meta: AttentionMetadata
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the torch backend, with the contexts of cached prefills gathered by a Triton kernel
        (:func:`pdserve.kernels.kv_cache.gather_kv_cache`)."""
        if meta.prefill_kv_block is None:
            return super()._packed_prefill_kv(layer, key, value, kv_cache, meta)
        return self._kv_cache_kernels.gather_kv_cache(
            kv_cache, layer, meta.prefill_kv_block, meta.prefill_kv_offset, key.dtype,
            *self.kv_scale(layer))

    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sliding_window: int | None = None, out: torch.Tensor | None = None,
                rotation: QKRotation | None = None) -> torch.Tensor:
        """Same contract as :meth:`pdserve.attention.base.AttentionBackend.forward`; ``query``,
        ``key`` and ``value`` may be strided views (e.g. into a fused QKV projection), which
        ``rotation`` rotates in place."""
        k_scale, v_scale = self.kv_scale(layer)
        if rotation is None:
            self._kv_cache_kernels.store_kv_cache(key, value, kv_cache, layer, meta.slot_mapping,
                                                  k_scale, v_scale)
        else:
            self._rotary_kernels.rotary_embedding_qk_store(
                query, key, value, kv_cache=kv_cache, layer=layer, slot_mapping=meta.slot_mapping,
                k_scale=k_scale, v_scale=v_scale, **rotation.kernel_args())
        if out is None:
            out = torch.empty_like(query)
        self._prefill_into(layer, query, key, value, kv_cache, meta, out, sliding_window)
        if meta.num_decodes:
            p = meta.num_prefill_tokens
            self._decode_kernels.paged_decode_attention(
                query[p:], kv_cache, layer, meta.decode_block_tables, meta.decode_seq_lens,
                self.scale, out=out[p:], sliding_window=sliding_window,
                k_scale=k_scale, v_scale=v_scale)
        return out
