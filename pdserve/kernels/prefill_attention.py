"""Packed (varlen) causal prefill attention: one FlashAttention-2 call for every prefill of a
step (the kernel torch bundles; no Triton)."""

from __future__ import annotations

import torch


def flash_varlen_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int | None = None,
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
        sliding_window: None, or ``W``: query position ``q`` attends only keys ``q - W + 1 .. q``
            (FlashAttention's ``window_size_left = W - 1``, ``window_size_right = 0``).

    Returns:
        ``[T_q, num_heads, head_dim]``.

    Raises:
        RuntimeError: from the kernel, e.g. an unsupported dtype, head size or GPU.
    """
    window = {} if sliding_window is None else {"window_size_left": sliding_window - 1,
                                                 "window_size_right": 0}
    out = torch.ops.aten._flash_attention_forward(
        query, key, value, cu_seqlens_q, cu_seqlens_k, max_query_len, max_context_len,
        0.0,  # dropout
        True,  # causal (bottom-right aligned)
        False,  # no debug mask
        scale=scale,
        **window,
    )[0]
    return out
