"""The prefix cache's block hash: chained hashes of full token blocks, and their wire form.

Hash ``i`` of a sequence identifies its tokens ``0 .. (i+1)*block_size - 1``, so the prefix cache
(:mod:`pdserve.engine.block_manager`), the KV-cache events and the bidirectional transfer's prefix
match (:mod:`pdserve.kv_transfer.nixl.prefix_match`) all key blocks the same way.
Hashes travel as 16-digit lowercase hex strings (JSON numbers above 2**53 lose precision in
many clients); integers are accepted as well.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any, Sequence

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block.

    Args:
        parent_hash: hash of the previous block (0 for the first block).
        token_ids: the block's tokens (exactly ``block_size`` of them).

    Returns:
        An unsigned 64-bit int (first 8 bytes of a SHA-256 digest, little-endian).
    """
    payload = struct.pack(f"<Q{len(token_ids)}q", parent_hash, *token_ids)
    return int.from_bytes(hashlib.sha256(payload).digest()[:8], "little")


def block_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = ROOT_HASH) -> list[int]:
    """Chained hashes of the FULL blocks of ``token_ids`` (a trailing partial block has none).

    Args:
        token_ids: a token sequence.
        block_size: tokens per block.
        parent_hash: hash preceding the first block (0 for a sequence start).

    Returns:
        ``len(token_ids) // block_size`` hashes; hash ``i`` identifies tokens ``0 .. (i+1)*B - 1``.
    """
    num_tokens = len(token_ids) // block_size * block_size
    if num_tokens == 0:
        return []
    # One pack of all the tokens, then each block's hash over a slice of it: the same bytes as
    # hash_block's, without packing block by block (a few thousand tokens cost half as much).
    data = struct.pack(f"<{num_tokens}q", *token_ids[:num_tokens])
    step = 8 * block_size
    sha256, from_bytes = hashlib.sha256, int.from_bytes
    hashes: list[int] = []
    h = parent_hash
    for start in range(0, 8 * num_tokens, step):
        h = from_bytes(sha256(h.to_bytes(8, "little") + data[start:start + step]).digest()[:8],
                       "little")
        hashes.append(h)
    return hashes


class BlockHashError(ValueError):
    """``remote_block_hashes`` is not a list of 64-bit hashes (hex strings or integers)."""


def encode_block_hashes(hashes: Sequence[int]) -> list[str]:
    """Hashes from :func:`block_hashes` as 16-digit hex strings (the wire form)."""
    return [f"{h:016x}" for h in hashes]


def parse_block_hashes(raw: Any) -> list[int]:
    """Parse ``remote_block_hashes``.

    Args:
        raw: a list of hex strings (optionally ``0x``-prefixed) or non-negative integers.

    Returns:
        The hashes as unsigned ints.

    Raises:
        BlockHashError: not a list, or an element that is not a 64-bit hash.
    """
    if not isinstance(raw, list):
        raise BlockHashError("kv_transfer_params.remote_block_hashes must be a list")
    out: list[int] = []
    for h in raw:
        if isinstance(h, bool):
            raise BlockHashError("kv_transfer_params.remote_block_hashes holds a boolean")
        if isinstance(h, int):
            value = h
        elif isinstance(h, str):
            try:
                value = int(h, 16)
            except ValueError:
                raise BlockHashError(
                    f"kv_transfer_params.remote_block_hashes holds {h[:40]!r}, not a hex hash"
                ) from None
        else:
            raise BlockHashError(
                f"kv_transfer_params.remote_block_hashes holds a {type(h).__name__}"
            )
        if not 0 <= value < 2**64:
            raise BlockHashError("kv_transfer_params.remote_block_hashes holds a value out of "
                                 "the 64-bit range")
        out.append(value)
    return out
