"""Paged attention with torch SDPA (CPU and CUDA): the KV write, per-request or packed prefill
attention, and batched decode attention.

Each prefill request attends over its gathered context (causal, offset by the tokens already in
the cache, grouped-query attention), and all decode requests run in one padded, batched call.

On CUDA with 16-bit activations every prefill of a step runs in one variable-length FlashAttention
call per layer (:func:`pdserve.kernels.prefill_attention.flash_varlen_prefill`): queries packed as
``[T_prefill, H, D]``, keys and values packed per request, cumulative sequence lengths from the
metadata, causal masking aligned to the bottom right so a chunk attends to its cached context.
Going through ``scaled_dot_product_attention`` request by request instead lets recent torch
releases dispatch to cuDNN attention first on sm90/sm100 GPUs with a recent cuDNN; cuDNN builds and
caches an execution plan per ``(batch, seq_len_q, seq_len_kv, strides)``, so every new prompt
length costs host time (``benchmarks/profile_prefill.py`` compares the modes; docs/benchmarks.md,
"Measurements moved out of code comments"). Where the varlen kernel cannot run (float32, CPU)
prefill stays per request on SDPA, with cuDNN excluded on CUDA.

With an fp8 KV cache (``--kv-cache-dtype fp8``) keys and values are quantized on write with the
layer's scales and dequantized to the activations' dtype (float32 on CPU) wherever attention reads
them; prefill attends over the values as stored, also for tokens of the step itself, so a prompt
gives the same result whether it is prefilled at once, in chunks, or over a prefix-cache hit
(:mod:`pdserve.attention.kv_quant`).
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from pdserve.attention.base import AttentionBackend
from pdserve.attention.kv_quant import FP8_KV_DTYPE, dequantize, quantize, round_trip
from pdserve.attention.metadata import AttentionMetadata, PrefillSpan
from pdserve.kernels.prefill_attention import flash_varlen_prefill

if TYPE_CHECKING:
    from pdserve.layers.rotary import QKRotation

logger = logging.getLogger("pdserve.model")

# SDPA backends allowed for the per-request prefill on CUDA: everything but cuDNN attention, whose
# per-shape plan build costs host time at every new prompt length (module docstring).
_SDPA_BACKENDS_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH]


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store this step's keys and values of one layer in their slots.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``, in the
            dtype of ``key`` or fp8.
        layer: layer index.
        key, value: ``[T, num_kv_heads, head_dim]``.
        meta: gives ``slot_block`` and ``slot_offset`` of each token.
        k_scale, v_scale: the layer's scales, used when ``kv_cache`` is fp8
            (:func:`pdserve.attention.kv_quant.quantize`).
    """
    if kv_cache.dtype == FP8_KV_DTYPE:
        key, value = quantize(key, k_scale), quantize(value, v_scale)
    # Advanced indices separated by a slice: the indexed view is [T, num_kv_heads, head_dim].
    kv_cache[meta.slot_block, layer, 0, :, meta.slot_offset] = key
    kv_cache[meta.slot_block, layer, 1, :, meta.slot_offset] = value


def packed_prefill_kv(
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every prefill, packed request after request, for a varlen kernel.

    Without cached context (no prefill has ``num_computed > 0``) they are this step's own prefill
    keys and values (views, no copy; with an fp8 cache, their quantize-dequantize round trip).
    Otherwise every prefill's whole context is gathered from the cache (this step's tokens must
    already be written there) and, from an fp8 cache, dequantized.

    Args:
        layer: layer index into ``kv_cache``.
        key, value: ``[T, num_kv_heads, head_dim]`` of the step (prefill tokens first).
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``.
        meta: the step's metadata.
        k_scale, v_scale: the layer's fp8 scales.

    Returns:
        ``(k, v)``, each ``[meta.prefill_cu_seqlens_k[-1], num_kv_heads, head_dim]`` in the
        dtype of ``key``.
    """
    if meta.prefill_kv_block is None:
        p = meta.num_prefill_tokens
        return (round_trip(key[:p], k_scale, kv_cache.dtype),
                round_trip(value[:p], v_scale, kv_cache.dtype))
    blk, off = meta.prefill_kv_block, meta.prefill_kv_offset
    # Advanced indices separated by a slice: [sum of context lengths, num_kv_heads, head_dim].
    k, v = kv_cache[blk, layer, 0, :, off], kv_cache[blk, layer, 1, :, off]
    if kv_cache.dtype == FP8_KV_DTYPE:
        k, v = dequantize(k, k_scale, key.dtype), dequantize(v, v_scale, key.dtype)
    return k, v


def sliding_window_mask(num_computed: int, query_len: int, window: int,
                        device: torch.device) -> torch.Tensor:
    """The causal sliding-window mask of a prefill chunk: query ``i`` (position
    ``num_computed + i``) attends key position ``j`` iff ``q - window < j <= q``.

    Returns:
        ``[query_len, num_computed + query_len]`` bool (True = attend).
    """
    q_pos = torch.arange(num_computed, num_computed + query_len, device=device)[:, None]
    k_pos = torch.arange(num_computed + query_len, device=device)[None, :]
    return (k_pos <= q_pos) & (k_pos > q_pos - window)


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
PREFILL_MODES = ("auto", "sdpa", "sdpa-default")


class TorchAttentionBackend(AttentionBackend):
    """Paged attention with torch SDPA (CPU and CUDA).

    Args: those of :class:`pdserve.attention.base.AttentionBackend`.

    Raises:
        ValueError: a bad head geometry, or a bad ``PDSERVE_PREFILL_ATTENTION``.

    Attributes:
        prefill_mode: how prefills are attended (``PDSERVE_PREFILL_ATTENTION``, default
            ``auto``): ``auto`` = one FlashAttention varlen call for all prefills of a step where
            it runs (CUDA, fp16/bf16, head_dim <= 256), else per-request SDPA without cuDNN;
            ``sdpa`` = always per-request SDPA without cuDNN; ``sdpa-default`` = per-request SDPA
            with torch's own backend choice (for measurements).
        last_prefill_impl: ``varlen``, ``sdpa`` or ``sdpa-default``: what the last prefill used.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, scale)
        mode = os.environ.get("PDSERVE_PREFILL_ATTENTION", "auto").lower()
        if mode not in PREFILL_MODES:
            raise ValueError(f"PDSERVE_PREFILL_ATTENTION must be one of {PREFILL_MODES}, "
                             f"got {mode!r}")
        self.prefill_mode = mode
        self.last_prefill_impl = ""
        self._varlen_ok: dict[tuple[torch.device, torch.dtype], bool] = {}

    def forward(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        sliding_window: int | None = None,
        out: torch.Tensor | None = None,
        rotation: QKRotation | None = None,
    ) -> torch.Tensor:
        """Rotate, write this step's K/V into the cache, then attend (contract of
        :meth:`pdserve.attention.base.AttentionBackend.forward`)."""
        if rotation is not None:
            query, key = rotation.apply(query, key)
        value = value.contiguous()
        write_kv(kv_cache, layer, key, value, meta, *self.kv_scale(layer))
        if out is None:
            out = torch.empty_like(query)
        self._prefill_into(layer, query, key, value, kv_cache, meta, out, sliding_window)
        if meta.num_decodes:
            p = meta.num_prefill_tokens
            out[p:] = self._decode(layer, query[p:], kv_cache, meta, sliding_window)
        return out

    # ------------------------------------------------------------------ prefill
    def _can_use_varlen(self, query: torch.Tensor) -> bool:
        if self.prefill_mode != "auto" or not query.is_cuda or query.dtype not in _FLASH_DTYPES:
            return False
        key = (query.device, query.dtype)
        ok = self._varlen_ok.get(key)
        if ok is None:
            ok = (self.head_dim <= 256 and self.head_dim % 8 == 0
                  and hasattr(torch.ops.aten, "_flash_attention_forward")
                  and torch.cuda.get_device_capability(query.device)[0] >= 8)
            self._varlen_ok[key] = ok
        return ok

    def _packed_prefill_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, meta: AttentionMetadata
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """The varlen prefill's keys and values: :func:`packed_prefill_kv` with the layer's
        scales (a backend with a gather kernel overrides it)."""
        return packed_prefill_kv(layer, key, value, kv_cache, meta, *self.kv_scale(layer))

    def _prefill_into(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      out: torch.Tensor, sliding_window: int | None = None) -> None:
        """Attention of every prefill token (rows ``0 .. num_prefill_tokens - 1`` of ``query``,
        ``[T, H, D]``) into the same rows of ``out``; this step's K/V must be in the cache.
        ``sliding_window``: as :meth:`pdserve.attention.base.AttentionBackend.forward`."""
        if not meta.prefills:
            return
        p = meta.num_prefill_tokens
        # A window no shorter than every context masks nothing: plain causal attention.
        window = (sliding_window if sliding_window and sliding_window < meta.max_prefill_context_len
                  else None)
        if self._can_use_varlen(query):
            k, v = self._packed_prefill_kv(layer, key, value, kv_cache, meta)
            try:
                out[:p] = flash_varlen_prefill(
                    query[:p], k, v, meta.prefill_cu_seqlens_q, meta.prefill_cu_seqlens_k,
                    meta.max_prefill_query_len, meta.max_prefill_context_len, self.scale,
                    sliding_window=window)
                self.last_prefill_impl = "varlen"
                return
            except RuntimeError as exc:  # an unsupported GPU / build: keep serving on SDPA
                logger.warning("FlashAttention varlen prefill failed (%s); prefill falls back to "
                               "per-request SDPA", exc)
                self._varlen_ok[(query.device, query.dtype)] = False
        if query.is_cuda and self.prefill_mode != "sdpa-default":
            with sdpa_kernel(_SDPA_BACKENDS_NO_CUDNN):
                self._prefill_per_request(layer, query, key, value, kv_cache, meta, out,
                                          window)
            self.last_prefill_impl = "sdpa"
        else:
            self._prefill_per_request(layer, query, key, value, kv_cache, meta, out, window)
            self.last_prefill_impl = "sdpa" if not query.is_cuda else "sdpa-default"

    def _prefill_per_request(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, kv_cache: torch.Tensor,
                             meta: AttentionMetadata, out: torch.Tensor,
                             sliding_window: int | None = None) -> None:
        for span in meta.prefills:
            sl = slice(span.query_start, span.query_start + span.query_len)
            out[sl] = self._prefill(layer, query[sl], key[sl], value[sl], kv_cache, span,
                                    sliding_window)

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, span: PrefillSpan,
                 sliding_window: int | None = None) -> torch.Tensor:
        """Causal attention of one request's new tokens ``q`` ``[n, H, D]`` over its context
        (within ``sliding_window`` tokens when given)."""
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        window = (sliding_window if sliding_window and sliding_window < span.context_len
                  else None)
        k_scale, v_scale = self.kv_scale(layer)
        if span.num_computed == 0:
            # No earlier context: attend over the new tokens themselves (same values as the cache).
            k = round_trip(k, k_scale, kv_cache.dtype).transpose(0, 1).unsqueeze(0)
            v = round_trip(v, v_scale, kv_cache.dtype).transpose(0, 1).unsqueeze(0)
            if window is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                   enable_gqa=self.group > 1)
            else:
                mask = sliding_window_mask(0, span.query_len, window, q.device)
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale,
                                                   enable_gqa=self.group > 1)
        else:
            ctx = span.context_len
            # [nb, 2, Hkv, bs, D] -> [2, Hkv, nb * bs, D] -> first ctx tokens
            blocks = kv_cache[:, layer].index_select(0, span.block_table)
            kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, self.num_kv_heads, -1, self.head_dim)
            k_ctx = kv[0, :, :ctx].unsqueeze(0)
            v_ctx = kv[1, :, :ctx].unsqueeze(0)
            if kv_cache.dtype == FP8_KV_DTYPE:
                k_ctx = dequantize(k_ctx, k_scale, q.dtype)
                v_ctx = dequantize(v_ctx, v_scale, q.dtype)
            mask = span.mask
            if window is not None:
                mask = sliding_window_mask(span.num_computed, span.query_len, window, q.device)
            o = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=mask,
                                               scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)

    # ------------------------------------------------------------------ decode
    def _decode(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, sliding_window: int | None = None) -> torch.Tensor:
        """One new token per request, batched: ``q`` ``[B, H, D]`` -> ``[B, H, D]`` (over the
        last ``sliding_window`` positions of each context when given).

        The padded gather produces ``[2, Hkv, B, max_blocks, bs, D]``; viewed as
        ``[Hkv, B, S, D]`` it is contiguous, and the ``group`` query heads that share a KV head
        play the role of ``group`` query positions, so SDPA needs no GQA expansion. An fp8 cache
        is gathered as fp8 (half the bytes) and dequantized after the gather.
        """
        b = q.shape[0]
        tables = meta.decode_block_tables
        assert tables is not None and meta.decode_mask is not None
        m = tables.shape[1]
        s = m * self.block_size
        # index_select on the block dim copies whole [2, Hkv, bs, D] blocks (fast memcpy; advanced
        # indexing on an inner dim is several times slower on CPU), then one permute-copy.
        blocks = kv_cache[:, layer].index_select(0, tables.flatten())  # [B*M, 2, Hkv, bs, D]
        gathered = (blocks.view(b, m, 2, self.num_kv_heads, self.block_size, self.head_dim)
                    .permute(2, 3, 0, 1, 4, 5).contiguous())  # [2, Hkv, B, M, bs, D]
        k = gathered[0].view(self.num_kv_heads, b, s, self.head_dim)
        v = gathered[1].view(self.num_kv_heads, b, s, self.head_dim)
        if kv_cache.dtype == FP8_KV_DTYPE:
            k_scale, v_scale = self.kv_scale(layer)
            k, v = dequantize(k, k_scale, q.dtype), dequantize(v, v_scale, q.dtype)
        # [B, H, D] -> [B, Hkv, G, D] -> [Hkv, B, G, D]
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        mask = meta.decode_mask
        if sliding_window and sliding_window < meta.max_decode_seq_len:
            key_pos = torch.arange(s, dtype=torch.int32, device=q.device)
            lens = meta.decode_seq_lens
            mask = mask & (key_pos[None, :] >= lens[:, None] - sliding_window)[None, :, None, :]
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=mask, scale=self.scale)
        return o.transpose(0, 1).reshape(b, self.num_heads, self.head_dim)
