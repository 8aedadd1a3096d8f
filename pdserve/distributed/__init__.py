"""Tensor parallelism's process group and collectives (docs/architecture.md, "Tensor
parallelism").

- :mod:`.parallel_state`: the TP group of this process (``torch.distributed``: NCCL on CUDA,
  gloo on CPU, plus a gloo group for Python objects), its rank and size;
- :mod:`.communication`: all-reduce, all-gather and gather over that group, identities at TP 1;
- :mod:`.sharding` (torch-free): which heads, rows and vocabulary entries a rank owns, and the
  start-up check that a model divides over a TP size.

At TP 1 nothing is initialised: :func:`get_tp_size` is 1 and every collective returns its input
unchanged, so the one-process path pays nothing.
"""

from pdserve.distributed.communication import (
    tp_all_gather,
    tp_all_gather_object,
    tp_all_reduce,
    tp_gather,
)
from pdserve.distributed.parallel_state import (
    destroy_tensor_parallel,
    get_tp_cpu_group,
    get_tp_group,
    get_tp_rank,
    get_tp_size,
    init_tensor_parallel,
)

__all__ = ["destroy_tensor_parallel", "get_tp_cpu_group", "get_tp_group", "get_tp_rank",
           "get_tp_size", "init_tensor_parallel", "tp_all_gather", "tp_all_gather_object",
           "tp_all_reduce", "tp_gather"]
