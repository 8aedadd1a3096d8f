"""The per-instance GPU memory budget (``--gpu-memory-utilization`` with vLLM's meaning)."""

import pytest

from pdserve.runner.memory_budget import (
    NON_TORCH_GROWTH_CAP,
    GpuMemoryBudgetError,
    kv_cache_budget,
    requested_bytes,
)

GiB = 1 << 30
TOTAL = 140 * GiB


def test_other_processes_memory_is_not_subtracted():
    # The second engine of a one-GPU pair: the first one holds 56 GiB, 84 GiB are free.
    first = kv_cache_budget(TOTAL, free_at_start_bytes=139 * GiB, weights_bytes=16 * GiB,
                            peak_activation_bytes=2 * GiB, utilization=0.4)
    second = kv_cache_budget(TOTAL, free_at_start_bytes=84 * GiB, weights_bytes=16 * GiB,
                             peak_activation_bytes=2 * GiB, utilization=0.4)
    assert first.kv_cache == second.kv_cache == int(TOTAL * 0.4) - 18 * GiB


def test_requested_share_must_be_free_at_start():
    with pytest.raises(GpuMemoryBudgetError) as e:
        requested_bytes(TOTAL, 50 * GiB, 0.4)
    msg = str(e.value)
    assert "56.00 GiB" in msg and "50.00 GiB" in msg and "0.357" in msg
    assert requested_bytes(TOTAL, 56 * GiB, 0.4) == int(TOTAL * 0.4)


@pytest.mark.parametrize("util", [0.0, -0.1, 1.5])
def test_utilization_out_of_range(util):
    with pytest.raises(GpuMemoryBudgetError, match="must be in"):
        requested_bytes(TOTAL, TOTAL, util)


def test_non_torch_growth_is_charged_up_to_the_cap():
    small = kv_cache_budget(TOTAL, TOTAL, 1 * GiB, 1 * GiB, 0.5, non_torch_growth_bytes=GiB // 4)
    assert small.non_torch == GiB // 4
    assert small.kv_cache == int(TOTAL * 0.5) - 2 * GiB - GiB // 4
    big = kv_cache_budget(TOTAL, TOTAL, 1 * GiB, 1 * GiB, 0.5, non_torch_growth_bytes=30 * GiB)
    assert big.non_torch == NON_TORCH_GROWTH_CAP
    assert big.kv_cache == int(TOTAL * 0.5) - 2 * GiB - NON_TORCH_GROWTH_CAP


def test_no_room_left_for_the_kv_cache():
    with pytest.raises(GpuMemoryBudgetError, match="no room for the KV cache"):
        kv_cache_budget(TOTAL, TOTAL, weights_bytes=14 * GiB, peak_activation_bytes=1 * GiB,
                        utilization=0.1)


def test_kv_cache_must_fit_in_what_is_free_now():
    ok = kv_cache_budget(TOTAL, TOTAL, 1 * GiB, 0, 0.5, free_now_bytes=100 * GiB)
    assert ok.kv_cache == 69 * GiB
    with pytest.raises(GpuMemoryBudgetError, match="free now"):
        kv_cache_budget(TOTAL, TOTAL, 1 * GiB, 0, 0.5, free_now_bytes=60 * GiB)


def test_describe_names_every_term():
    line = kv_cache_budget(TOTAL, TOTAL, 2 * GiB, 1 * GiB, 0.4).describe()
    for part in ("0.4 of 140.00 GiB", "56.00 GiB", "weights 2.00 GiB", "activations peak 1.00 GiB",
                 "KV cache 53.00 GiB"):
        assert part in line
