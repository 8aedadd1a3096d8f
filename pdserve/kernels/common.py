"""Small host-side helpers shared by the Triton kernel launchers (no Triton import)."""

from __future__ import annotations

import functools

import torch


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); Triton block shapes must be one."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=16)
def multiprocessor_count(device: torch.device, cpu_stand_in: int) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (asked once per device), or
    ``cpu_stand_in`` for a CPU device (Triton's interpreter in tests), which launchers use to size
    their grids."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return cpu_stand_in
