"""Measure one engine instance's KV cache budget on CUDA: its share of the GPU at start, then a
profiling forward pass's peak and the CUDA graphs captured before the KV cache (the arithmetic
is torch-free, :mod:`pdserve.runner.memory_budget`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from pdserve.distributed.parallel_state import get_tp_rank
from pdserve.models.loader import resolve_device, tp_device
from pdserve.runner.memory_budget import KVCacheBudget, kv_cache_budget, requested_bytes
from pdserve.types.engine_config import EngineConfig


def cuda_memory_at_start(config: EngineConfig) -> tuple[int, int] | None:
    """``(total, free)`` bytes of the engine's CUDA device before it loads anything, after
    checking that its ``gpu_memory_utilization`` share is free (None on CPU or when
    ``kv_cache_memory`` / ``num_gpu_blocks_override`` size the cache instead).

    Raises:
        GpuMemoryBudgetError: the share is not free (the message has the numbers).
    """
    device = tp_device(resolve_device(config.device), config, get_tp_rank())
    if device.type != "cuda" or config.kv_cache_memory is not None \
            or config.num_gpu_blocks_override:
        return None
    free, total = torch.cuda.mem_get_info(device)
    requested_bytes(total, free, config.gpu_memory_utilization)
    return total, free


def measure_cuda_budget(device: torch.device, utilization: float,
                        memory_at_start: tuple[int, int] | None, weights_bytes: int,
                        held_before_bytes: int, profile_run: Callable[[], None],
                        capture_graphs: Callable[[], None]) -> KVCacheBudget:
    """Run ``profile_run`` (a forward pass of the largest step) and ``capture_graphs`` (the CUDA
    graphs that do not read the KV cache) and size the KV cache from what they took.

    Args:
        device: the engine's CUDA device.
        utilization: ``--gpu-memory-utilization``.
        memory_at_start: :func:`cuda_memory_at_start`'s ``(total, free)`` bytes (None: the
            device's total counts as free at start).
        weights_bytes: the torch memory the weights' loading added.
        held_before_bytes: torch memory the process held before this instance loaded (an
            earlier engine not yet collected): not this instance's activations.
        profile_run: the profiling forward pass; its allocation peak above the weights is the
            activations' share.
        capture_graphs: captures the graphs kept for the engine's life; the growth of torch's
            reserved memory across it (after freeing the allocator's cached blocks before and
            after) is their pool.

    Returns:
        The budget (:class:`~pdserve.runner.memory_budget.KVCacheBudget`, bytes).

    Raises:
        GpuMemoryBudgetError: nothing is left for the KV cache, or the share is no longer free.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free0, total = torch.cuda.mem_get_info(device)
    non_torch0 = (total - free0) - torch.cuda.memory_reserved(device)
    profile_run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch1 = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved(device)
    capture_graphs()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # the warm-ups' cached blocks; the graphs' pool stays reserved
    graphs = torch.cuda.memory_reserved(device) - reserved0
    total_start, free_start = memory_at_start or (total, total)
    return kv_cache_budget(
        total_start, free_start, weights_bytes, peak - weights_bytes - held_before_bytes,
        utilization, non_torch_growth_bytes=non_torch1 - non_torch0, graphs_bytes=graphs,
        free_now_bytes=torch.cuda.mem_get_info(device)[0])
