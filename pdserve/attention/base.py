"""The abstract attention backend: paged attention of one model over the shared KV cache.

A backend norms and rotates a step's queries and keys when the model hands it their rotation
(:class:`pdserve.layers.rotary.QKRotation`), writes the keys and values into the paged cache and
attends every token of the flattened batch (prefill tokens first, then one token per decode; see
:mod:`pdserve.attention.metadata`). The model calls :meth:`AttentionBackend.forward` once per
layer and never asks which backend it holds; :func:`pdserve.attention.selector.select_attention_backend`
picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

from pdserve.attention.kv_quant import KVCacheScales
from pdserve.types.kv_cache_kind import KVCacheKind
from pdserve.attention.metadata import AttentionMetadata, build_attention_metadata

if TYPE_CHECKING:  # the layers import no attention module; only the annotation needs this one
    from pdserve.layers.rotary import QKRotation


class AttentionBackend(ABC):
    """Paged attention for one model geometry.

    Args:
        num_heads: query heads.
        num_kv_heads: KV heads (``num_heads`` must be a multiple: grouped-query attention).
        head_dim: head size.
        block_size: tokens per KV cache block.
        scale: softmax scale (``head_dim ** -0.5`` for Llama and Qwen3).

    Raises:
        ValueError: ``num_heads`` is not a multiple of ``num_kv_heads``.

    Class attributes:
        uses_triton_kernels: the model's layers run their Triton ops with this backend (one
            switch, ``PDSERVE_ATTENTION_BACKEND``, picks the whole CUDA path).
        supports_cuda_graphs: a pure-decode :meth:`forward` on :func:`decode_metadata
            <pdserve.attention.metadata.decode_metadata>` launches fixed shapes without host
            synchronisation, so the runner may capture it in a CUDA graph.
        kv_cache_kind: what the backend stores in the cache (per-head K/V; the MLA backend's
            latent), for the KV connector's compatibility check.

    Attributes:
        kv_scales: per-layer scales of an fp8 KV cache (:mod:`pdserve.attention.kv_quant`), set
            by :meth:`set_kv_cache_scales`; None = 1.0 for every layer. They apply when
            ``kv_cache``'s dtype differs from the activations' (the cache stores fp8).
    """

    uses_triton_kernels: ClassVar[bool] = False
    supports_cuda_graphs: ClassVar[bool] = False
    kv_cache_kind: ClassVar[KVCacheKind] = KVCacheKind.PER_HEAD

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = scale
        self.kv_scales: KVCacheScales | None = None

    def set_kv_cache_scales(self, scales: KVCacheScales | None) -> None:
        """Use ``scales`` for the fp8 KV cache from now on (set before capturing CUDA graphs:
        the kernels take them as launch constants)."""
        self.kv_scales = scales

    def kv_scale(self, layer: int) -> tuple[float, float]:
        """``(k_scale, v_scale)`` of ``layer`` (1.0 each without :attr:`kv_scales`)."""
        return (1.0, 1.0) if self.kv_scales is None else self.kv_scales.of_layer(layer)

    def build_metadata(self, prefills: list[tuple[int, list[int], int]],
                       decodes: list[tuple[list[int], int]], device: torch.device
                       ) -> AttentionMetadata:
        """The metadata of one step (arguments and errors of
        :func:`pdserve.attention.metadata.build_attention_metadata`)."""
        return build_attention_metadata(prefills, decodes, self.block_size, device)

    @abstractmethod
    def forward(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                sliding_window: int | None = None, out: torch.Tensor | None = None,
                rotation: QKRotation | None = None) -> torch.Tensor:
        """Norm and rotate the queries and keys by ``rotation``, write this step's K/V of layer
        ``layer`` into the cache, then attend.

        Args:
            layer: layer index into ``kv_cache`` (dim 1).
            query: ``[T, num_heads, head_dim]`` (last dim contiguous): as projected when
                ``rotation`` is given (normed and rotated here, in place or into a new tensor),
                else already rotated.
            key, value: ``[T, num_kv_heads, head_dim]`` (last dim contiguous); ``key`` as
                ``query``.
            kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, in
                the activations' dtype or fp8 (stored with :meth:`kv_scale`).
            meta: the step's metadata.
            sliding_window: None (full causal attention) or ``W >= 1``: the token at position
                ``q`` attends only to positions ``q - W + 1 .. q`` (the window of Mistral and of
                Gemma 3's local layers, Hugging Face's ``kv_idx > q_idx - sliding_window``).
                Keys outside the window stay in the cache; they are only not attended.
            out: where to write the output (``[T, num_heads, head_dim]``, contiguous, the
                query's dtype), e.g. a CUDA graph's static buffer; None allocates it.
            rotation: the layer's q/k norms and rotary embedding at the step's positions, or
                None.

        Returns:
            ``[T, num_heads, head_dim]`` attention output (``out`` when given).
        """
