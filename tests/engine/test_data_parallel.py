"""Data-parallel options, per-rank configuration, stats and metrics (no processes)."""

from __future__ import annotations

import pytest

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.core_client import rank_devices
from pdserve.engine.data_parallel import DataParallelConfigError, rank_config, validate
from pdserve.engine.output_processor import EngineStats
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.entrypoints.metrics import ServerMetrics


def kv() -> KVTransferConfig:
    return KVTransferConfig.from_dict({"kv_role": "kv_producer", "engine_id": "eng"})


@pytest.mark.parametrize("kwargs, needle", [
    (dict(data_parallel_size=2, data_parallel_size_local=3), "--data-parallel-size-local"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1), "--data-parallel-start-rank"),
    (dict(data_parallel_size=2, data_parallel_size_local=1), "--data-parallel-address"),
    (dict(data_parallel_size=2, headless=True, data_parallel_start_rank=1,
          data_parallel_size_local=1), "--data-parallel-address"),
    (dict(data_parallel_size=2, kv_events_endpoint="tcp://*:5557"), "--kv-events-endpoint"),
])
def test_bad_combinations_name_the_option(kwargs, needle):
    with pytest.raises(DataParallelConfigError, match=needle):
        validate(EngineConfig(**kwargs))


def test_multi_host_refuses_a_loopback_side_channel(monkeypatch):
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "localhost")
    cfg = EngineConfig(data_parallel_size=2, data_parallel_size_local=1,
                       data_parallel_address="10.0.0.1", kv_transfer_config=kv())
    with pytest.raises(DataParallelConfigError, match="PDSERVE_NIXL_SIDE_CHANNEL_HOST"):
        validate(cfg)
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.0.0.1")
    validate(cfg)
    # one host: the decoders may be local, loopback is allowed
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    validate(EngineConfig(data_parallel_size=2, kv_transfer_config=kv()))


def test_each_rank_is_its_own_engine():
    cfg = EngineConfig(data_parallel_size=2, kv_transfer_config=kv())
    assert [rank_config(cfg, r).kv_transfer_config.engine_id for r in (0, 1)] == ["eng_dp0", "eng_dp1"]
    assert rank_config(cfg, 1).data_parallel_rank == 1
    assert rank_config(EngineConfig(kv_transfer_config=kv()), 0).kv_transfer_config.engine_id == "eng"


def test_devices_of_a_tensor_parallel_rank():
    assert rank_devices(0) == [0] and rank_devices(3) == [3]
    assert rank_devices(1, tensor_parallel_size=2) == [2, 3]


def test_metrics_carry_a_rank_label_with_several_ranks():
    ranks = [EngineStats(num_running=1, num_blocks=10, num_free_blocks=8, kv_cache_usage=0.2,
                         prompt_tokens_total=5),
             EngineStats(num_running=0, num_blocks=10, num_free_blocks=10, prompt_tokens_total=7)]
    total = EngineStats.combine(ranks)
    assert (total.num_running, total.prompt_tokens_total, total.num_blocks) == (1, 12, 20)
    assert total.kv_cache_usage == pytest.approx(0.1)

    class Engine:
        def stats(self):
            return total

    text = ServerMetrics(Engine()).render()[0].decode()
    assert 'pdserve:prompt_tokens_total{dp_rank="0"} 5.0' in text
    assert 'pdserve:prompt_tokens_total{dp_rank="1"} 7.0' in text
    assert 'pdserve:num_requests_running{dp_rank="0"} 1.0' in text


def test_a_rank_sees_only_its_gpus(monkeypatch):
    import os

    from pdserve.engine.core_client import cuda_devices_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with cuda_devices_env(rank_devices(1, tensor_parallel_size=2)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with cuda_devices_env(rank_devices(5)):  # more ranks than GPUs: shared round robin
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU: nothing to hand out
    with cuda_devices_env(rank_devices(1)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
