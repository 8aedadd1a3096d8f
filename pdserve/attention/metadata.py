"""Attention metadata: the per-step description of the flattened batch, and its builder.

KV cache layout (docs/architecture.md, "KV cache layout"): one tensor ``kv_cache`` of shape
``[num_blocks, num_layers, 2, num_kv_heads, block_size, head_dim]``; index 0 of the third
dimension holds keys, 1 holds values. One block is contiguous across all layers, so a KV transfer
moves one descriptor per block. Token ``p`` of a request lives in slot
``block_table[p // block_size] * block_size + p % block_size``.

A step's batch is flattened into ``T`` tokens: first the prefill tokens (requests computing more
than one token this step, whole prompts or chunks of a chunked prefill), then one token per
decode request (requests computing exactly one token, including a single-token prompt or the
last prompt token recomputed after a KV transfer). :class:`AttentionMetadata` describes that
split; it is built once per step (:func:`build_attention_metadata` on the host, or
:func:`decode_metadata` from device tensors for a CUDA-graph decode step) and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.attention.host_tensors import int_tensor, padded_rows


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
        slot_block: ``[T]`` int64, ``slot_mapping // block_size`` (None in
            :func:`decode_metadata`, whose backends write through ``slot_mapping``).
        slot_offset: ``[T]`` int64, ``slot_mapping % block_size`` (None likewise).
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
    slot_block: torch.Tensor | None
    slot_offset: torch.Tensor | None
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
        table = int_tensor(block_ids[:num_blocks])
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
        dev_tables = torch.cat(tables).to(device, non_blocking=True).split([len(t) for t in tables])
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
        dslots = []
        for (block_ids, n), seq_len in zip(decodes, lens):
            if len(block_ids) * block_size < seq_len:
                raise ValueError(
                    f"block table of {len(block_ids)} blocks cannot hold {seq_len} tokens "
                    f"(block_size {block_size})"
                )
            dslots.append(block_ids[n // block_size] * block_size + n % block_size)
        slots.append(int_tensor(dslots))
        decode_tables = padded_rows([b for b, _ in decodes], max_blocks, torch.int32).to(
            device, non_blocking=True)
        decode_lens = int_tensor(lens, torch.int32).to(device, non_blocking=True)
        key_pos = torch.arange(max_blocks * block_size, dtype=torch.int32, device=device)
        decode_mask = (key_pos[None, :] < decode_lens[:, None])[None, :, None, :]

    slot_mapping = (
        torch.cat(slots) if slots else torch.empty(0, dtype=torch.int64)
    ).to(device, non_blocking=True)
    cu_q = cu_k = kv_block = kv_offset = None
    if prefills:
        zero = torch.zeros(1, dtype=torch.int32)
        q_lens = int_tensor(query_lens, torch.int32)
        k_lens = int_tensor(context_lens, torch.int32) if any_cached else q_lens
        cu = torch.cat([zero, q_lens.cumsum(0, dtype=torch.int32),
                        zero, k_lens.cumsum(0, dtype=torch.int32)]).to(device, non_blocking=True)
        cu_q, cu_k = cu[: len(prefills) + 1], cu[len(prefills) + 1:]
        if any_cached:
            kv = torch.cat(kv_slots).to(device, non_blocking=True)
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


def decode_metadata(slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor) -> AttentionMetadata:
    """The metadata of a pure-decode step (one token per sequence) from device tensors, with no
    host work: what the runner builds on a CUDA graph's static input buffers, for backends with
    ``supports_cuda_graphs``.

    Args:
        slot_mapping: ``[B]`` int64 KV cache slots of the new tokens (negative = padding row: its
            K/V is not written).
        block_tables: ``[B, max_blocks]`` int32 block ids.
        context_lens: ``[B]`` int32 tokens to attend to, the new one included (0 = padding row:
            attention output zeros).

    Returns:
        Metadata with ``num_decodes = B``, no prefills, and neither ``slot_block`` /
        ``slot_offset`` nor ``decode_mask`` (the Triton backend does not read them).
    """
    return AttentionMetadata(
        slot_mapping=slot_mapping, slot_block=None, slot_offset=None, num_prefill_tokens=0,
        num_decodes=int(slot_mapping.shape[0]), decode_block_tables=block_tables,
        decode_seq_lens=context_lens)
