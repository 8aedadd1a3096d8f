"""Programmatic dependent launch (PDL, Hopper and later): the launch options every pdserve Triton
kernel adds, and the step each kernel begins with.

With PDL a kernel in a stream (or a CUDA graph captured from one) may be scheduled before the
kernel ahead of it has finished: as soon as every program of that kernel has signalled
``griddepcontrol.launch_dependents``. Its programs then wait in ``griddepcontrol.wait``, which
returns once the kernel ahead has completed and its memory writes are visible; so a kernel's
launch and start-up overlap the tail of the previous one, which hides part of the gap between the
short kernels of a decode step. Each kernel signals right after its own wait: the next kernel is
launched while this one runs, never before the one ahead of it is done, and because every kernel
waits for its predecessor, which waited for its own, a kernel also sees the writes of every
kernel before it. Kernels launched without the option (cuBLAS, torch's) are ordered as usual.
Source: CUDA C++ Programming Guide, "Programmatic Dependent Launch and Synchronization".
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=16)
def device_supports(device: torch.device) -> bool:
    """Whether ``device`` runs programmatic dependent launches: a CUDA GPU of compute capability
    9.0 or later (also the rule of the CUDA kernel in :mod:`pdserve.kernels.paged_decode_fp8`)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=16)
def launch_options(device: torch.device) -> dict:
    """Keyword arguments every pdserve Triton kernel launch on ``device`` adds: where
    :func:`device_supports`, ``launch_pdl=True`` and ``USE_PDL=True`` (the constexpr of
    :func:`enter`); elsewhere (older GPUs, a Triton without ``launch_pdl``, Triton's CPU
    interpreter) ``USE_PDL=False``. Reuse the returned dict read-only."""
    if not device_supports(device):
        return {"USE_PDL": False}
    from triton.backends.nvidia.compiler import CUDAOptions

    if "launch_pdl" not in {f.name for f in dataclasses.fields(CUDAOptions)}:
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


@triton.jit
def enter(USE_PDL: tl.constexpr):
    """The first step of every kernel: with ``USE_PDL``, wait until the kernel ahead in the
    stream has completed, then let the next one be launched (module docstring); nothing
    otherwise."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
