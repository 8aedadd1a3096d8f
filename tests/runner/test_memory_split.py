"""The runner's CUDA KV cache sizing wired to pdserve/runner/memory_budget.py, on CPU: torch.cuda's
memory queries are replaced by a fake GPU that another process already half fills."""

from __future__ import annotations

import types

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.memory_budget import GpuMemoryBudgetError
from pdserve.runner import memory_profile
from pdserve.runner import model_runner as runner_mod

GiB = 1 << 30


class FakeGpu:
    """100 GiB; another process holds ``other``; this one allocates through torch."""

    def __init__(self, other: int):
        self.total = 100 * GiB
        self.other = other
        self.allocated = 0
        self.peak = 0

    def mem_get_info(self, device=None):
        return self.total - self.other - self.allocated, self.total


def _install(monkeypatch, gpu: FakeGpu) -> None:
    cuda = torch.cuda
    monkeypatch.setattr(memory_profile, "resolve_device", lambda name: torch.device("cuda", 0))
    monkeypatch.setattr(cuda, "mem_get_info", gpu.mem_get_info)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: gpu.allocated)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: gpu.allocated)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: gpu.peak)
    for name in ("synchronize", "empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(cuda, name, lambda device=None: None)


def _runner(config: EngineConfig, gpu: FakeGpu, weights: int, activations: int):
    """A ModelRunner whose model "loads" ``weights`` bytes and whose profiling pass peaks at
    ``activations`` bytes above them (block: 1 MiB)."""
    start = memory_profile.cuda_memory_at_start(config)
    gpu.allocated = gpu.peak = weights
    r = object.__new__(runner_mod.ModelRunner)
    r.config = config
    r._cuda_mem_at_start = start
    r._weights_bytes = weights
    r._held_before = 0  # nothing held before this instance loaded
    r.device = torch.device("cuda", 0)
    r.dtype = r.kv_cache_dtype = torch.bfloat16
    r.block_size = 16
    r.max_model_len = 4096
    r.arch = types.SimpleNamespace(num_layers=16, num_kv_heads=8, head_dim=128)  # 1 MiB/block

    def profile(num_tokens, num_seqs):
        gpu.peak = weights + activations

    r._profile_run = profile
    r.use_cuda_graphs = False
    r._piecewise_captured = False
    return r


def test_second_engine_on_a_shared_gpu_gets_its_full_share(monkeypatch):
    # The first engine of the pair already holds 40 GiB; this one asks for 0.4 of 100 GiB.
    gpu = FakeGpu(other=40 * GiB)
    _install(monkeypatch, gpu)
    r = _runner(EngineConfig(device="cuda", gpu_memory_utilization=0.4), gpu,
                weights=10 * GiB, activations=2 * GiB)
    assert r.block_bytes == 1 << 20
    assert r.determine_num_blocks() == (40 - 10 - 2) * 1024  # 28 GiB of 1 MiB blocks


def test_share_not_free_at_start_is_a_clear_error(monkeypatch):
    gpu = FakeGpu(other=40 * GiB)
    _install(monkeypatch, gpu)
    with pytest.raises(GpuMemoryBudgetError, match=r"asks for 70\.00 GiB.*only 60\.00 GiB"):
        memory_profile.cuda_memory_at_start(EngineConfig(device="cuda", gpu_memory_utilization=0.7))
    # a fixed KV size or block count is not checked against the fraction
    assert memory_profile.cuda_memory_at_start(
        EngineConfig(device="cuda", gpu_memory_utilization=0.7, kv_cache_memory=GiB)) is None


def test_memory_the_process_held_before_loading_is_not_this_instances_weights(monkeypatch):
    # An earlier engine of this process (not yet garbage-collected) still holds 30 GiB when this
    # one starts: its share (0.4 of 100 GiB) is free, its weights are its own 10 GiB.
    gpu = FakeGpu(other=0)
    _install(monkeypatch, gpu)
    gpu.allocated = 30 * GiB
    config = EngineConfig(device="cuda", gpu_memory_utilization=0.4)
    start = memory_profile.cuda_memory_at_start(config)
    r = _runner(config, gpu, weights=10 * GiB, activations=2 * GiB)
    r._cuda_mem_at_start = start
    r._held_before = 30 * GiB
    gpu.allocated = 40 * GiB  # held before + weights

    def profile(num_tokens, num_seqs):
        gpu.peak = 40 * GiB + 2 * GiB

    r._profile_run = profile
    assert r.determine_num_blocks() == (40 - 10 - 2) * 1024


def test_cuda_graphs_captured_before_the_kv_cache_are_charged_to_it(monkeypatch):
    # The pieces between attentions take a 3 GiB pool: the KV cache gets 3 GiB less, and the
    # pieces are not captured a second time when the cache is allocated.
    gpu = FakeGpu(other=40 * GiB)
    _install(monkeypatch, gpu)
    r = _runner(EngineConfig(device="cuda", gpu_memory_utilization=0.4), gpu,
                weights=10 * GiB, activations=2 * GiB)
    captured = []

    def capture(model, config):
        gpu.allocated += 3 * GiB  # the graphs' pool stays reserved
        captured.append(config)
        return "pieces"

    monkeypatch.setattr(runner_mod, "capture_piecewise_graphs", capture)
    r.use_cuda_graphs, r.model = True, None
    assert r.determine_num_blocks() == (40 - 10 - 2 - 3) * 1024
    assert r.piecewise_graphs == "pieces" and len(captured) == 1
    r._capture_piecewise_graphs()
    assert len(captured) == 1
