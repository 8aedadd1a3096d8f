"""glibc heap tuning of a CPU runner process: keep freed large blocks mapped between the
forward passes' allocations (:func:`tune_cpu_malloc`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_cpu_malloc() -> bool:
    """Keep freed large blocks in the glibc heap instead of returning them to the OS.

    Every layer of a CPU forward pass allocates and frees tens of MB of temporaries (gathered
    KV blocks, MLP activations). With glibc's default dynamic thresholds those pages go back to
    the OS at each free and are page-faulted in again at the next allocation (docs/benchmarks.md,
    "Measurements moved out of code comments", runner/cpu_malloc.py, has the cost). Fixing
    ``M_MMAP_THRESHOLD`` at its maximum (32 MiB) and ``M_TRIM_THRESHOLD`` at 1 GiB keeps them
    mapped (the process keeps its peak RSS). No-op where glibc is absent.

    Returns:
        True when both settings were applied.
    """
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) == 1
        return bool(ok and libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1)
    except (OSError, AttributeError):
        return False
