"""Paged attention: the abstract backend, the torch (SDPA) and Triton backends, the per-step
metadata and the backend selector (docs/architecture.md)."""

from pdserve.attention.base import AttentionBackend
from pdserve.attention.metadata import (
    AttentionMetadata,
    PrefillSpan,
    build_attention_metadata,
    decode_metadata,
)
from pdserve.attention.selector import select_attention_backend
from pdserve.attention.torch_backend import TorchAttentionBackend, packed_prefill_kv, write_kv
from pdserve.attention.triton_backend import TritonAttentionBackend

__all__ = [
    "AttentionBackend", "AttentionMetadata", "PrefillSpan", "TorchAttentionBackend",
    "TritonAttentionBackend", "build_attention_metadata", "decode_metadata", "packed_prefill_kv",
    "select_attention_backend", "write_kv",
]
