"""Joining the TP group (pdserve/distributed/parallel_state.py): a rendezvous that fails after
torch created the default process group leaves none behind, so the process can start an
instance again."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pdserve.distributed import parallel_state


def test_a_rendezvous_failing_half_way_leaves_no_default_group(monkeypatch, tmp_path):
    real_init = dist.init_process_group

    def init_then_fail(backend, *, init_method, rank, world_size, timeout):
        # the default group exists (a world of one, so that nothing waits for a peer), then
        # the rendezvous fails, as when a peer goes away while the group is being set up
        real_init(backend, init_method=f"file://{tmp_path}/one", rank=0, world_size=1,
                  timeout=timeout)
        raise RuntimeError("peer went away")

    monkeypatch.setattr(parallel_state.dist, "init_process_group", init_then_fail)
    with pytest.raises(RuntimeError, match="peer went away"):
        parallel_state.init_tensor_parallel(0, 2, torch.device("cpu"),
                                            f"file://{tmp_path}/dist-init")
    assert not dist.is_initialized()
    assert parallel_state.get_tp_size() == 1
