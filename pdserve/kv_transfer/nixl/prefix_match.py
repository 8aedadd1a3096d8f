"""Which of a remote instance's cached tokens are a true prefix of a new prompt (bidirectional
KV transfer, docs/architecture.md, "Multi-turn: bidirectional transfer").

The remote (a decoder that kept a finished turn's blocks) advertises the chained hashes of its
FULL blocks (``remote_block_hashes``), computed with
:func:`pdserve.types.block_hash.block_hashes`: hash ``i`` identifies tokens
``0 .. (i+1)*block_size - 1``, so equal hashes at index ``i`` mean the whole prefix up to the end
of block ``i`` is equal. The reader hashes its own prompt the same way and reuses only the
longest run of equal leading hashes; a client that rewrote the history (for example stripped a
reasoning model's thinking text) therefore never gets KV of tokens that differ. A trailing
partial block is never reused (it has no hash).

Hashes travel as 16-digit lowercase hex strings (JSON numbers above 2**53 lose precision in
many clients); integers are accepted as well.
"""

from __future__ import annotations

from typing import Sequence

from pdserve.types.block_hash import block_hashes


def matched_prefix_tokens(
    prompt_token_ids: Sequence[int],
    block_size: int,
    remote_hashes: Sequence[int],
    remote_num_tokens: int | None = None,
) -> int:
    """Leading prompt tokens whose KV the remote holds, for the same tokens at the same
    positions.

    Args:
        prompt_token_ids: the new prompt.
        block_size: tokens per block (must equal the remote's; the handshake checks that).
        remote_hashes: the remote's chained full-block hashes, in token order.
        remote_num_tokens: tokens whose KV the remote holds (caps the result), or None.

    Returns:
        ``k * block_size`` where ``k`` is the number of leading blocks whose hashes are equal on
        both sides (0 when the first block already differs).
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    max_blocks = len(remote_hashes)
    if remote_num_tokens is not None:
        max_blocks = min(max_blocks, remote_num_tokens // block_size)
    max_blocks = min(max_blocks, len(prompt_token_ids) // block_size)
    if max_blocks <= 0:
        return 0
    local = block_hashes(prompt_token_ids[: max_blocks * block_size], block_size)
    k = 0
    while k < max_blocks and local[k] == remote_hashes[k]:
        k += 1
    return k * block_size


def tokens_to_pull(
    prompt_len: int, num_local_tokens: int, num_matched_tokens: int
) -> int:
    """Tokens a reader should load from the remote: the matched prefix beyond its own prefix
    cache hit, leaving at least the last prompt token to compute (for its logits).

    Args:
        prompt_len: tokens in the new prompt.
        num_local_tokens: the reader's own prefix-cache hit (tokens, block-aligned).
        num_matched_tokens: :func:`matched_prefix_tokens`.

    Returns:
        ``max(0, min(num_matched_tokens, prompt_len - 1) - num_local_tokens)``.
    """
    return max(0, min(num_matched_tokens, prompt_len - 1) - num_local_tokens)


def seconds_left(expiry_time_remote: float, clock_offset_s: float, now_local: float) -> float:
    """Seconds until the remote frees its blocks, on the local clock.

    Args:
        expiry_time_remote: the remote's ``time.time()`` at which its blocks are freed.
        clock_offset_s: remote clock minus local clock (measured at the handshake; 0 when
            unknown, i.e. clocks assumed synchronised).
        now_local: local ``time.time()``.
    """
    return (expiry_time_remote - clock_offset_s) - now_local
