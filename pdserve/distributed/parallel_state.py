"""The tensor-parallel group of this process: set up once per rank process, read by the layers.

One instance of TP size ``N`` runs ``N`` processes (rank 0 in the engine-core process, ranks
``1..N-1`` in worker processes, :mod:`pdserve.executor`). Each calls
:func:`init_tensor_parallel` once, before its model is built; the parallel layers read
:func:`get_tp_rank` / :func:`get_tp_size` when they are constructed. Without that call (TP 1)
the rank is 0, the size 1 and nothing of ``torch.distributed`` is touched.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("pdserve.distributed")

#: How long ``init_process_group`` waits for every rank to join (seconds). A rank that dies
#: during start-up is noticed sooner by the executor's watchdog (it watches the processes).
INIT_TIMEOUT_S = 600


@dataclass(frozen=True)
class _TPState:
    rank: int
    size: int
    group: Any  # the device group: NCCL on CUDA, gloo on CPU
    cpu_group: Any  # gloo, for Python objects (all_gather_object)


_state: _TPState | None = None


def init_tensor_parallel(rank: int, size: int, device: torch.device, init_method: str) -> None:
    """Join this process to its instance's TP group.

    Args:
        rank: this process's TP rank, ``0 <= rank < size``.
        size: the TP size (> 1; at 1 do not call this).
        device: this rank's device: NCCL for CUDA devices, gloo for CPU.
        init_method: a ``torch.distributed`` rendezvous shared by the ranks, e.g.
            ``file:///tmp/x/dist-init`` (one per instance).

    Raises:
        RuntimeError: already initialised, or the rendezvous failed.
        ValueError: ``rank`` or ``size`` out of range.
    """
    global _state
    if _state is not None:
        raise RuntimeError("the tensor-parallel group is already initialised")
    if size < 2 or not 0 <= rank < size:
        raise ValueError(f"TP rank {rank} of size {size} is out of range")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    try:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size,
                                timeout=timedelta(seconds=INIT_TIMEOUT_S))
        group = dist.group.WORLD
        if backend == "nccl":  # create the communicator now, never inside a CUDA graph capture
            dist.all_reduce(torch.zeros(1, device=device), group=group)
        cpu_group = (group if backend == "gloo"
                     else dist.new_group(list(range(size)), backend="gloo"))
    except BaseException:
        # a rendezvous that failed half-way (a peer gone) must not leave a default group
        # behind: the process may start an instance again (an in-process engine, a test)
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    _state = _TPState(rank, size, group, cpu_group)
    logger.info("tensor-parallel rank %d of %d on %s (%s)", rank, size, device, backend)


def destroy_tensor_parallel() -> None:
    """Leave the TP group (no-op when not initialised)."""
    global _state
    if _state is None:
        return
    _state = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    """This process's TP rank (0 without a TP group)."""
    return 0 if _state is None else _state.rank


def get_tp_size() -> int:
    """The TP size of this process's instance (1 without a TP group)."""
    return 1 if _state is None else _state.size


def get_tp_group() -> Any:
    """The device process group (NCCL on CUDA, gloo on CPU), or None at TP 1."""
    return None if _state is None else _state.group


def get_tp_cpu_group() -> Any:
    """The gloo process group for Python objects, or None at TP 1."""
    return None if _state is None else _state.cpu_group
