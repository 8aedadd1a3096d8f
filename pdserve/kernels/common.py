"""Small host-side helpers shared by the Triton kernel launchers (no Triton import)."""

from __future__ import annotations


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); Triton block shapes must be one."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
