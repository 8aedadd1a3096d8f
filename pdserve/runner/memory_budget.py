"""GPU memory budget of one engine instance: the bytes its KV cache may take under
``--gpu-memory-utilization`` (torch-free arithmetic, unit-tested on any machine).

The flag has vLLM's meaning: the fraction of the GPU's *total* memory that this instance may
use for its weights, activations and KV cache. Memory other processes hold (another engine on
the same GPU, for example the prefiller and decoder of a one-GPU P/D pair) is not subtracted
from this instance's budget; it only matters at start, where the instance refuses to start when
its share is not free. So two engines with ``0.4`` each on one GPU get the same KV cache size
whichever starts first.

Arithmetic (all in bytes)::

    requested = total * utilization                       # must be <= free at start
    kv        = requested - weights - peak_activations - non_torch_growth - graphs

``weights`` is what torch allocated when the model was loaded; ``peak_activations`` is the
allocation peak of a profiling forward pass above the weights; ``graphs`` is the memory pool of
the CUDA graphs captured before the KV cache (the pieces between attentions of steps with
prefills, :mod:`pdserve.runner.piecewise_graphs`: for a large MoE model several GiB, which a
share that left them out overran); ``non_torch_growth`` is device
memory this process took outside torch's allocator during that pass (library workspaces, JIT
modules), at most :data:`NON_TORCH_GROWTH_CAP` (the device-wide figure it is read from also
moves when another process allocates, so a larger growth is taken to be someone else's).
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30
# Growth of non-torch device memory during the profiling pass that is charged to this instance
# at most (bytes). Library workspaces and kernel modules take tens of MiB; anything beyond this
# is another process allocating at the same moment (both engines of a one-GPU pair start
# together).
NON_TORCH_GROWTH_CAP = 1 * GiB


class GpuMemoryBudgetError(ValueError):
    """This instance's share of the GPU cannot hold what it needs (the message has the
    numbers and the flag to change)."""


def _gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


def requested_bytes(total_bytes: int, free_bytes: int, utilization: float) -> int:
    """The bytes this instance may use: ``total_bytes * utilization``, checked against what is
    free at start.

    Args:
        total_bytes: the GPU's total memory.
        free_bytes: free memory on the GPU when this instance starts (before it loads weights).
        utilization: ``--gpu-memory-utilization``, in (0, 1].

    Returns:
        ``int(total_bytes * utilization)``.

    Raises:
        GpuMemoryBudgetError: ``utilization`` outside (0, 1], or less than the requested share is
            free (other processes hold the rest).
    """
    if not 0.0 < utilization <= 1.0:
        raise GpuMemoryBudgetError(
            f"--gpu-memory-utilization must be in (0, 1], got {utilization!r}")
    requested = int(total_bytes * utilization)
    if free_bytes < requested:
        raise GpuMemoryBudgetError(
            f"--gpu-memory-utilization {utilization:g} asks for {_gib(requested)} of the GPU's "
            f"{_gib(total_bytes)}, but only {_gib(free_bytes)} are free at start (other "
            f"processes hold {_gib(total_bytes - free_bytes)}); lower --gpu-memory-utilization "
            f"to at most {free_bytes / total_bytes:.3f} or free the GPU")
    return requested


@dataclass(frozen=True)
class KVCacheBudget:
    """How an instance's share of the GPU is spent (bytes).

    Attributes:
        total: the GPU's total memory.
        utilization: ``--gpu-memory-utilization``.
        requested: ``total * utilization``.
        weights: model weights.
        peak_activations: profiling pass peak above the weights.
        non_torch: non-torch growth charged to this instance (capped).
        graphs: the memory pool of the CUDA graphs captured before the KV cache.
        kv_cache: what is left for the KV cache.
    """

    total: int
    utilization: float
    requested: int
    weights: int
    peak_activations: int
    non_torch: int
    kv_cache: int
    graphs: int = 0

    def describe(self) -> str:
        """One log line with every term, in GiB."""
        return (f"GPU memory: {self.utilization:g} of {_gib(self.total)} = "
                f"{_gib(self.requested)} for this instance: weights {_gib(self.weights)}, "
                f"activations peak {_gib(self.peak_activations)}, non-torch "
                f"{_gib(self.non_torch)}, CUDA graphs {_gib(self.graphs)}, "
                f"KV cache {_gib(self.kv_cache)}")


def kv_cache_budget(total_bytes: int, free_at_start_bytes: int, weights_bytes: int,
                    peak_activation_bytes: int, utilization: float,
                    non_torch_growth_bytes: int = 0, graphs_bytes: int = 0,
                    free_now_bytes: int | None = None) -> KVCacheBudget:
    """The KV cache budget of one instance (see the module docstring for the formula).

    Args:
        total_bytes: the GPU's total memory.
        free_at_start_bytes: free memory when the instance started, before its weights.
        weights_bytes: this process's weights (torch allocation after loading).
        peak_activation_bytes: the profiling pass's allocation peak above the weights.
        utilization: ``--gpu-memory-utilization``, in (0, 1].
        non_torch_growth_bytes: device memory this process gained outside torch during the
            profiling pass (charged up to :data:`NON_TORCH_GROWTH_CAP`).
        graphs_bytes: the memory pool of the CUDA graphs captured before the KV cache.
        free_now_bytes: free memory now, just before the KV cache is allocated (None: not
            checked).

    Returns:
        The budget; ``kv_cache`` is positive.

    Raises:
        GpuMemoryBudgetError: the share was not free at start (:func:`requested_bytes`), the
            weights and activations leave nothing for the KV cache, or the KV cache is larger
            than what is free now (another process took memory since the start).
    """
    requested = requested_bytes(total_bytes, free_at_start_bytes, utilization)
    non_torch = min(max(0, int(non_torch_growth_bytes)), NON_TORCH_GROWTH_CAP)
    weights = max(0, int(weights_bytes))
    peak = max(0, int(peak_activation_bytes))
    graphs = max(0, int(graphs_bytes))
    kv = requested - weights - peak - non_torch - graphs
    budget = KVCacheBudget(total=int(total_bytes), utilization=float(utilization),
                           requested=requested, weights=weights, peak_activations=peak,
                           non_torch=non_torch, kv_cache=kv, graphs=graphs)
    if kv <= 0:
        raise GpuMemoryBudgetError(
            f"no room for the KV cache: {budget.describe()}; raise --gpu-memory-utilization "
            f"or lower --max-num-batched-tokens (or --piecewise-cuda-graph-max-tokens)")
    if free_now_bytes is not None and kv > free_now_bytes:
        raise GpuMemoryBudgetError(
            f"the KV cache needs {_gib(kv)} ({budget.describe()}) but only "
            f"{_gib(free_now_bytes)} are free now: another process took GPU memory after this "
            f"instance started; lower --gpu-memory-utilization of the instances sharing the GPU "
            f"so that together they stay below 1")
    return budget
