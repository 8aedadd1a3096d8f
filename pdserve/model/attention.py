"""Paged attention over one KV cache tensor.

KV cache layout (DESIGN §5): one tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; index 0 of the third
dimension holds keys, 1 holds values. One block is contiguous across all layers, so a KV transfer
moves one descriptor per block. Token ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's batch is flattened into ``T`` tokens: first the prefill tokens (requests computing more
than one token this step, whole prompts or chunks of a chunked prefill), then one token per
decode request (requests computing exactly one token, including a single-token prompt or the
last prompt token recomputed after a KV transfer). :class:`AttentionMetadata` describes that
split; it is built once per step and shared by all layers.

:class:`TorchAttentionBackend` runs everywhere with ``torch.nn.functional.scaled_dot_product_attention``:
each prefill request attends over its gathered context (causal, offset by the tokens already in
the cache, grouped-query attention), and all decode requests run in one padded, batched call.
A CUDA backend (e.g. a Triton paged-decode kernel) only needs to provide the same ``forward``.

On CUDA with 16-bit activations every prefill of a step runs in one variable-length FlashAttention
call per layer (:func:`flash_varlen_prefill`): queries packed as ``[T_prefill, H, D]``, keys and
values packed per request, cumulative sequence lengths from the metadata, causal masking aligned
to the bottom right so a chunk attends to its cached context. Going through
``scaled_dot_product_attention`` request by request instead lets recent torch releases dispatch
to cuDNN attention first on sm90/sm100 GPUs with a recent cuDNN; cuDNN builds and caches an
execution plan per ``(batch, seq_len_q, seq_len_kv, strides)``, so every new prompt length costs
tens of milliseconds of host time (``benchmarks/profile_prefill.py`` compares the modes). Where
the varlen kernel cannot run (float32, CPU) prefill stays per request on SDPA, with cuDNN
excluded on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import logging
import os

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

logger = logging.getLogger("pdserve.model")

# SDPA backends allowed for the per-request prefill on CUDA: everything but cuDNN attention, whose
# per-shape plan build costs tens of milliseconds for every new prompt length.
_SDPA_BACKENDS_NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                           SDPBackend.MATH]


@dataclass
class PrefillSpan:
    """One prefill request inside the flattened batch.

    Attributes:
        query_start: index of its first token in the flattened batch.
        query_len: tokens computed this step (> 1).
        num_computed: tokens already in the KV cache before this step (prefix-cache hits,
            earlier chunks, transferred KV).
        block_table: physical block ids covering ``num_computed + query_len`` tokens, int64
            tensor on the model device, shape ``[ceil((num_computed + query_len) / block_size)]``.
        mask: ``[query_len, num_computed + query_len]`` bool (True = attend), or None when
            ``num_computed == 0`` (plain causal attention over the new tokens).
    """

    query_start: int
    query_len: int
    num_computed: int
    block_table: torch.Tensor
    mask: torch.Tensor | None = None

    @property
    def context_len(self) -> int:
        """Tokens attended to by the last query token."""
        return self.num_computed + self.query_len


@dataclass
class AttentionMetadata:
    """Per-step description of the flattened batch, shared by every layer.

    Attributes:
        slot_mapping: ``[T]`` int64, KV cache slot of each token
            (``block_id * block_size + offset``).
        slot_block: ``[T]`` int64, ``slot_mapping // block_size``.
        slot_offset: ``[T]`` int64, ``slot_mapping % block_size``.
        num_prefill_tokens: tokens ``0 .. num_prefill_tokens - 1`` belong to ``prefills``.
        prefills: the prefill requests, in batch order.
        num_decodes: requests with one token each, at ``num_prefill_tokens ..  T - 1``.
        decode_block_tables: ``[num_decodes, max_blocks]`` int32, padded with block 0 (padding is
            masked out), or None without decodes.
        decode_seq_lens: ``[num_decodes]`` int32, context length of each decode request including
            its new token, or None.
        decode_mask: ``[1, num_decodes, 1, max_blocks * block_size]`` bool (True = attend), or None.
        max_decode_seq_len: the largest entry of ``decode_seq_lens`` (0 without decodes).
        prefill_cu_seqlens_q: ``[P + 1]`` int32 on the device, cumulative query lengths of the
            ``P`` prefills (``[0, q_0, q_0 + q_1, ...]``), or None without prefills.
        prefill_cu_seqlens_k: ``[P + 1]`` int32, cumulative key lengths of the packed keys: the
            context lengths when ``prefill_kv_block`` is set, else equal to the query lengths.
        max_prefill_query_len: the longest prefill chunk (tokens; 0 without prefills).
        max_prefill_context_len: the longest prefill context (tokens; 0 without prefills).
        prefill_kv_block, prefill_kv_offset: ``[sum of context lengths]`` int64, cache block and
            in-block offset of every key of every prefill, request after request (the slots of
            positions ``0 .. context_len - 1``); None when no prefill has cached context (then
            the packed keys are this step's own prefill keys).
    """

    slot_mapping: torch.Tensor
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    num_prefill_tokens: int
    prefills: list[PrefillSpan] = field(default_factory=list)
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    max_decode_seq_len: int = 0
    prefill_cu_seqlens_q: torch.Tensor | None = None
    prefill_cu_seqlens_k: torch.Tensor | None = None
    max_prefill_query_len: int = 0
    max_prefill_context_len: int = 0
    prefill_kv_block: torch.Tensor | None = None
    prefill_kv_offset: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


def build_attention_metadata(
    prefills: list[tuple[int, list[int], int]],
    decodes: list[tuple[list[int], int]],
    block_size: int,
    device: torch.device,
) -> AttentionMetadata:
    """Build the metadata of one step.

    Args:
        prefills: per prefill request ``(num_computed, block_ids, query_len)`` (query_len > 1).
        decodes: per decode request ``(block_ids, num_computed)``; the new token sits at
            position ``num_computed``.
        block_size: tokens per block.
        device: the model device.

    Returns:
        The metadata, with the token order "all prefill tokens, then one token per decode".

    Raises:
        ValueError: a block table is too short for the positions it must hold.
    """
    slots: list[torch.Tensor] = []
    tables: list[torch.Tensor] = []
    kv_slots: list[torch.Tensor] = []
    query_lens: list[int] = []
    context_lens: list[int] = []
    any_cached = any(num_computed > 0 for num_computed, _, _ in prefills)
    for num_computed, block_ids, query_len in prefills:
        ctx = num_computed + query_len
        num_blocks = -(-ctx // block_size)
        if len(block_ids) < num_blocks:
            raise ValueError(
                f"block table of {len(block_ids)} blocks cannot hold {ctx} tokens "
                f"(block_size {block_size})"
            )
        table = torch.tensor(block_ids[:num_blocks], dtype=torch.int64)
        if any_cached:
            # Slots of the whole context (positions 0 .. ctx - 1): the keys of the packed
            # prefill attention; the new tokens are its tail.
            pos = torch.arange(ctx, dtype=torch.int64)
            ctx_slots = table[pos // block_size] * block_size + pos % block_size
            kv_slots.append(ctx_slots)
            slots.append(ctx_slots[num_computed:])
        else:  # num_computed == 0 for every prefill
            pos = torch.arange(query_len, dtype=torch.int64)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        tables.append(table)
        query_lens.append(query_len)
        context_lens.append(ctx)

    # One host-to-device copy for all block tables (views of it per request).
    spans: list[PrefillSpan] = []
    start = 0
    if prefills:
        dev_tables = torch.cat(tables).to(device).split([len(t) for t in tables])
        for (num_computed, _, query_len), table in zip(prefills, dev_tables):
            ctx = num_computed + query_len
            mask = None
            if num_computed > 0:
                q_pos = torch.arange(num_computed, ctx, dtype=torch.int64, device=device)
                mask = torch.arange(ctx, dtype=torch.int64, device=device)[None, :] <= q_pos[:, None]
            spans.append(PrefillSpan(start, query_len, num_computed, table, mask))
            start += query_len

    decode_tables = decode_lens = decode_mask = None
    max_len = 0
    if decodes:
        lens = [n + 1 for _, n in decodes]
        max_len = max(lens)
        max_blocks = -(-max_len // block_size)
        rows = []
        dslots = []
        for (block_ids, n), seq_len in zip(decodes, lens):
            if len(block_ids) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(block_ids)} blocks cannot hold {seq_len} tokens "
                    f"(block_size {block_size})"
                )
            row = block_ids[:max_blocks]
            rows.append(row + [0] * (max_blocks - len(row)))
            dslots.append(block_ids[n // block_size] * block_size + n % block_size)
        slots.append(torch.tensor(dslots, dtype=torch.int64))
        decode_tables = torch.tensor(rows, dtype=torch.int32).to(device, non_blocking=True)
        decode_lens = torch.tensor(lens, dtype=torch.int32).to(device, non_blocking=True)
        key_pos = torch.arange(max_blocks * block_size, dtype=torch.int32, device=device)
        decode_mask = (key_pos[None, :] < decode_lens[:, None])[None, :, None, :]

    slot_mapping = (
        torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    ).to(device)
    cu_q = cu_k = kv_block = kv_offset = None
    if prefills:
        zero = torch.zeros(1, dtype=torch.int32)
        q_lens = torch.tensor(query_lens, dtype=torch.int32)
        k_lens = torch.tensor(context_lens, dtype=torch.int32) if any_cached else q_lens
        cu = torch.cat([zero, q_lens.cumsum(0, dtype=torch.int32),
                        zero, k_lens.cumsum(0, dtype=torch.int32)]).to(device)
        cu_q, cu_k = cu[: len(prefills) + 1], cu[len(prefills) + 1:]
        if any_cached:
            kv = torch.cat(kv_slots).to(device)
            kv_block, kv_offset = kv // block_size, kv % block_size
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        slot_block=slot_mapping // block_size,
        slot_offset=slot_mapping % block_size,
        num_prefill_tokens=start,
        prefills=spans,
        num_decodes=len(decodes),
        decode_block_tables=decode_tables,
        decode_seq_lens=decode_lens,
        decode_mask=decode_mask,
        max_decode_seq_len=max_len,
        prefill_cu_seqlens_q=cu_q,
        prefill_cu_seqlens_k=cu_k,
        max_prefill_query_len=max(query_lens, default=0),
        max_prefill_context_len=max(context_lens, default=0),
        prefill_kv_block=kv_block,
        prefill_kv_offset=kv_offset,
    )


def write_kv(
    kv_cache: torch.Tensor,
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
) -> None:
    """Store this step's keys and values of one layer in their slots.

    Args:
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``.
        layer: layer index.
        key, value: ``[T, num_kv_heads, head_dim]``.
        meta: gives ``slot_block`` and ``slot_offset`` of each token.
    """
    # Advanced indices separated by a slice: the indexed view is [T, num_kv_heads, head_dim].
    kv_cache[meta.slot_block, layer, 0, :, meta.slot_offset] = key
    kv_cache[meta.slot_block, layer, 1, :, meta.slot_offset] = value


def packed_prefill_kv(
    layer: int,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every prefill, packed request after request, for a varlen kernel.

    Without cached context (no prefill has ``num_computed > 0``) they are this step's own prefill
    keys and values (views, no copy). Otherwise every prefill's whole context is gathered from
    the cache (this step's tokens must already be written there).

    Args:
        layer: layer index into ``kv_cache``.
        key, value: ``[T, num_kv_heads, head_dim]`` of the step (prefill tokens first).
        kv_cache: ``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``.
        meta: the step's metadata.

    Returns:
        ``(k, v)``, each ``[meta.prefill_cu_seqlens_k[-1], num_kv_heads, head_dim]``.
    """
    if meta.prefill_kv_block is None:
        p = meta.num_prefill_tokens
        return key[:p], value[:p]
    blk, off = meta.prefill_kv_block, meta.prefill_kv_offset
    # Advanced indices separated by a slice: [sum of context lengths, num_kv_heads, head_dim].
    return kv_cache[blk, layer, 0, :, off], kv_cache[blk, layer, 1, :, off]


def flash_varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of several packed sequences in one FlashAttention-2 varlen call (the
    kernel torch bundles, ``aten::_flash_attention_forward`` with cumulative sequence lengths;
    Dao, *FlashAttention-2*, 2023).

    Sequence ``i`` has queries ``cu_seqlens_q[i] .. cu_seqlens_q[i+1] - 1`` and keys
    ``cu_seqlens_k[i] .. cu_seqlens_k[i+1] - 1``; with more keys than queries the causal mask is
    aligned to the bottom right (query ``j`` of a chunk sees the cached context and the chunk's
    tokens up to ``j``), which is chunked prefill's mask. Grouped-query attention is native.

    Args:
        query: ``[T_q, num_heads, head_dim]`` fp16/bf16 on CUDA (last dim contiguous).
        key, value: ``[T_k, num_kv_heads, head_dim]`` (``num_heads`` a multiple of
            ``num_kv_heads``).
        cu_seqlens_q, cu_seqlens_k: ``[N + 1]`` int32 on the same device.
        max_query_len, max_context_len: the longest query / key sequence (tokens).
        scale: softmax scale.

    Returns:
        ``[T_q, num_heads, head_dim]``.

    Raises:
        RuntimeError: from the kernel, e.g. an unsupported dtype, head size or GPU.
    """
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len, max_context_len,
        0.0,  # dropout
        True,  # causal (bottom-right aligned)
        False,  # no debug mask
        scale=scale,
    )[0]
    return out


_FLASH_DTYPES = (torch.float16, torch.bfloat16)
PREFILL_MODES = ("auto", "sdpa", "sdpa-default")


class TorchAttentionBackend:
    """Paged attention with torch SDPA (CPU and CUDA).

    Args:
        num_heads: query heads.
        num_kv_heads: KV heads (``num_heads`` must be a multiple: grouped-query attention).
        head_dim: head size.
        block_size: tokens per KV cache block.
        scale: softmax scale (``head_dim ** -0.5`` for Llama and Qwen3).

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
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                             f"({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = scale
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
    ) -> torch.Tensor:
        """Write this step's K/V into the cache, then attend.

        Args:
            layer: layer index into ``kv_cache``.
            query: ``[T, num_heads, head_dim]`` (rotary embedding applied).
            key, value: ``[T, num_kv_heads, head_dim]``.
            kv_cache: the paged cache (see module docstring).
            meta: the step's metadata.

        Returns:
            ``[T, num_heads, head_dim]`` attention output.
        """
        write_kv(kv_cache, layer, key, value, meta)
        out = torch.empty_like(query)
        self._prefill_into(layer, query, key, value, kv_cache, meta, out)
        if meta.num_decodes:
            p = meta.num_prefill_tokens
            out[p:] = self._decode(layer, query[p:], kv_cache, meta)
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

    def _prefill_into(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                      out: torch.Tensor) -> None:
        """Attention of every prefill token (rows ``0 .. num_prefill_tokens - 1`` of ``query``,
        ``[T, H, D]``) into the same rows of ``out``; this step's K/V must be in the cache."""
        if not meta.prefills:
            return
        p = meta.num_prefill_tokens
        if self._can_use_varlen(query):
            k, v = packed_prefill_kv(layer, key, value, kv_cache, meta)
            try:
                out[:p] = flash_varlen_prefill(
                    query[:p], k, v, meta.prefill_cu_seqlens_q, meta.prefill_cu_seqlens_k,
                    meta.max_prefill_query_len, meta.max_prefill_context_len, self.scale)
                self.last_prefill_impl = "varlen"
                return
            except RuntimeError as exc:  # an unsupported GPU / build: keep serving on SDPA
                logger.warning("FlashAttention varlen prefill failed (%s); prefill falls back to "
                               "per-request SDPA", exc)
                self._varlen_ok[(query.device, query.dtype)] = False
        if query.is_cuda and self.prefill_mode != "sdpa-default":
            with sdpa_kernel(_SDPA_BACKENDS_NO_CUDNN):
                self._prefill_per_request(layer, query, key, value, kv_cache, meta, out)
            self.last_prefill_impl = "sdpa"
        else:
            self._prefill_per_request(layer, query, key, value, kv_cache, meta, out)
            self.last_prefill_impl = "sdpa" if not query.is_cuda else "sdpa-default"

    def _prefill_per_request(self, layer: int, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, kv_cache: torch.Tensor,
                             meta: AttentionMetadata, out: torch.Tensor) -> None:
        for span in meta.prefills:
            sl = slice(span.query_start, span.query_start + span.query_len)
            out[sl] = self._prefill(layer, query[sl], key[sl], value[sl], kv_cache, span)

    def _prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kv_cache: torch.Tensor, span: PrefillSpan) -> torch.Tensor:
        """Causal attention of one request's new tokens ``q`` ``[n, H, D]`` over its context."""
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if span.num_computed == 0:
            # No earlier context: attend over the new tokens themselves (same values as the cache).
            k = k.transpose(0, 1).unsqueeze(0)
            v = v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                               enable_gqa=self.group > 1)
        else:
            ctx = span.context_len
            # [nb, 2, Hkv, bs, D] -> [2, Hkv, nb * bs, D] -> first ctx tokens
            blocks = kv_cache[:, layer].index_select(0, span.block_table)
            kv = blocks.permute(1, 2, 0, 3, 4).reshape(2, self.num_kv_heads, -1, self.head_dim)
            k_ctx = kv[0, :, :ctx].unsqueeze(0)
            v_ctx = kv[1, :, :ctx].unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k_ctx, v_ctx, attn_mask=span.mask,
                                               scale=self.scale, enable_gqa=self.group > 1)
        return o.squeeze(0).transpose(0, 1)

    # ------------------------------------------------------------------ decode
    def _decode(self, layer: int, q: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """One new token per request, batched: ``q`` ``[B, H, D]`` -> ``[B, H, D]``.

        The padded gather produces ``[2, Hkv, B, max_blocks, bs, D]``; viewed as
        ``[Hkv, B, S, D]`` it is contiguous, and the ``group`` query heads that share a KV head
        play the role of ``group`` query positions, so SDPA needs no GQA expansion.
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
        # [B, H, D] -> [B, Hkv, G, D] -> [Hkv, B, G, D]
        qg = q.view(b, self.num_kv_heads, self.group, self.head_dim).transpose(0, 1)
        o = F.scaled_dot_product_attention(qg, k, v, attn_mask=meta.decode_mask, scale=self.scale)
        return o.transpose(0, 1).reshape(b, self.num_heads, self.head_dim)


class TritonAttentionBackend(TorchAttentionBackend):
    """CUDA backend: KV writes and batched decode attention with the Triton kernels of
    :mod:`pdserve.model.triton_attention` (split-K paged decode); prefill as in
    :class:`TorchAttentionBackend` (one FlashAttention varlen call per layer on CUDA).

    The decode split count depends on the batch size alone (no context-length hint), as in the
    CUDA-graph decode path, so eager and graph-replayed decode steps of the same batch size
    compute the same bits."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from pdserve.model import triton_attention

        self._ta = triton_attention

    def forward(self, layer, query, key, value, kv_cache, meta):
        """Same contract as :meth:`TorchAttentionBackend.forward`."""
        self._ta.store_kv_cache(key, value, kv_cache, layer, meta.slot_mapping)
        out = torch.empty_like(query)
        self._prefill_into(layer, query, key, value, kv_cache, meta, out)
        if meta.num_decodes:
            p = meta.num_prefill_tokens
            self._ta.paged_decode_attention(
                query[p:], kv_cache, layer, meta.decode_block_tables, meta.decode_seq_lens,
                self.scale, out=out[p:])
        return out


def make_attention_backend(device: torch.device, num_heads: int, num_kv_heads: int,
                           head_dim: int, block_size: int, scale: float
                           ) -> TorchAttentionBackend:
    """The attention backend for ``device``: Triton on CUDA when ``triton`` is importable,
    torch SDPA otherwise. ``PDSERVE_ATTENTION_BACKEND=torch`` forces the SDPA backend."""
    args = (num_heads, num_kv_heads, head_dim, block_size, scale)
    choice = os.environ.get("PDSERVE_ATTENTION_BACKEND", "auto").lower()
    if device.type == "cuda" and choice in ("auto", "triton"):
        try:
            return TritonAttentionBackend(*args)
        except ImportError:
            if choice == "triton":
                raise
    return TorchAttentionBackend(*args)
