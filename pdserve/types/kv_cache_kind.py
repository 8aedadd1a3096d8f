"""What a paged KV cache holds per token: per-head keys and values, or one multi-head latent
(MLA) entry shared by every query head (docs/architecture.md, "MLA latent cache")."""

from __future__ import annotations

import enum


class KVCacheKind(enum.Enum):
    """The content of a KV cache block (two instances exchange blocks only of the same kind).

    Both kinds share the tensor layout ``[num_blocks, num_layers, 2, num_kv_heads, block_size,
    head_dim]``; what the K and V slots mean differs.
    """

    #: keys in the K slot and values in the V slot, per KV head (Llama, Qwen, Gemma).
    PER_HEAD = "per_head"
    #: one KV "head" per token: the latent ``[c | k_pe]`` split in halves over the K and V slots
    #: (DeepSeek's multi-head latent attention, :mod:`pdserve.attention.mla`).
    MLA_LATENT = "mla_latent"
