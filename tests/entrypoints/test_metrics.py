"""pdserve.entrypoints.metrics: exposed names, engine stats at scrape time, connector deltas."""

from __future__ import annotations

import re
import types

from prometheus_client.parser import text_string_to_metric_families

from pdserve.entrypoints import metrics as m
from pdserve.engine.async_engine import EngineStats

ALL_NAMES = [
    m.NUM_REQUESTS_RUNNING, m.NUM_REQUESTS_WAITING, m.KV_CACHE_USAGE_PERC,
    m.KV_CACHE_FREE_BLOCKS, m.KV_CACHE_TOTAL_BLOCKS, m.PROMPT_TOKENS_TOTAL,
    m.PROMPT_TOKENS_COMPUTED_TOTAL, m.PROMPT_TOKENS_CACHED_TOTAL,
    m.PROMPT_TOKENS_TRANSFERRED_TOTAL, m.GENERATION_TOKENS_TOTAL, m.NUM_PREEMPTIONS_TOTAL,
    m.NIXL_NUM_FAILED_TRANSFERS, m.NIXL_NUM_FAILED_NOTIFICATIONS, m.NIXL_NUM_KV_EXPIRED_REQS,
]
HISTOGRAMS = [
    m.TIME_TO_FIRST_TOKEN_SECONDS, m.TIME_PER_OUTPUT_TOKEN_SECONDS, m.E2E_REQUEST_LATENCY_SECONDS,
    m.NIXL_XFER_TIME_SECONDS, m.NIXL_POST_TIME_SECONDS, m.NIXL_BYTES_TRANSFERRED,
    m.NIXL_NUM_DESCRIPTORS,
]


class _Engine:
    def __init__(self, stats: object):
        self._stats = stats
        self.listeners: list = []

    def stats(self) -> object:
        return self._stats

    def add_stats_listener(self, fn: object) -> None:
        self.listeners.append(fn)


def _sample_lines(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value, from the raw exposition text."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_every_name_is_prefixed_and_exposed_exactly() -> None:
    engine = _Engine(EngineStats(num_blocks=8, num_free_blocks=8))
    sm = m.ServerMetrics(engine)
    sm.count_finished("stop")
    text = sm.render()[0].decode()
    lines = _sample_lines(text)
    for name in ALL_NAMES:
        assert name.startswith("pdserve:")
        assert name in lines, name
    for name in HISTOGRAMS:
        assert f"{name}_count" in lines and f"{name}_sum" in lines, name
    assert lines['pdserve:request_success_total{finish_reason="stop"}'] == 1
    assert lines['pdserve:request_success_total{finish_reason="length"}'] == 0
    # Every TYPE line names a family whose samples follow (a clean text exposition).
    for fam in text_string_to_metric_families(text):
        assert fam.samples, fam.name
    assert not re.search(r"_total_total", text)


def test_engine_stats_read_at_scrape_time() -> None:
    engine = _Engine(EngineStats(num_blocks=10, num_free_blocks=10))
    sm = m.ServerMetrics(engine)
    assert _sample_lines(sm.render()[0].decode())["pdserve:kv_cache_free_blocks"] == 10
    engine._stats = EngineStats(num_running=2, num_blocks=10, num_free_blocks=4,
                                kv_cache_usage=0.6, generation_tokens_total=17)
    lines = _sample_lines(sm.render()[0].decode())
    assert lines["pdserve:kv_cache_free_blocks"] == 4
    assert lines["pdserve:num_requests_running"] == 2
    assert lines["pdserve:kv_cache_usage_perc"] == 0.6
    assert lines["pdserve:generation_tokens_total"] == 17


def test_missing_stats_fields_are_not_invented_and_failures_do_not_break_scrape() -> None:
    sm = m.ServerMetrics(_Engine({"num_running": 1}))
    lines = _sample_lines(sm.render()[0].decode())
    assert lines["pdserve:num_requests_running"] == 1
    assert "pdserve:kv_cache_free_blocks" not in lines

    def broken() -> None:
        raise RuntimeError("engine gone")

    sm2 = m.ServerMetrics(types.SimpleNamespace(stats=broken))
    lines = _sample_lines(sm2.render()[0].decode())
    assert "pdserve:num_requests_running" not in lines
    assert "pdserve:time_to_first_token_seconds_count" in lines


def test_connector_deltas_accumulate() -> None:
    engine = _Engine(EngineStats())
    sm = m.ServerMetrics(engine)
    (listener,) = engine.listeners
    listener({"xfer_time_s": [0.001, 0.003], "post_time_s": [0.0001], "bytes": [1024, 2048],
              "num_descriptors": [1, 4], "num_failed_transfers": 1})
    listener({"num_failed_transfers": 2, "num_failed_notifications": 1,
              "num_kv_expired_reqs": 3, "unknown_key": 5})
    listener({})
    lines = _sample_lines(sm.render()[0].decode())
    assert lines["pdserve:nixl_xfer_time_seconds_count"] == 2
    assert abs(lines["pdserve:nixl_xfer_time_seconds_sum"] - 0.004) < 1e-12
    assert lines["pdserve:nixl_post_time_seconds_count"] == 1
    assert lines["pdserve:nixl_bytes_transferred_sum"] == 3072
    assert lines['pdserve:nixl_num_descriptors_bucket{le="4.0"}'] == 2
    assert lines['pdserve:nixl_num_descriptors_bucket{le="2.0"}'] == 1
    assert lines["pdserve:nixl_num_failed_transfers"] == 3
    assert lines["pdserve:nixl_num_failed_notifications"] == 1
    assert lines["pdserve:nixl_num_kv_expired_reqs"] == 3


def test_latency_observations() -> None:
    sm = m.ServerMetrics(_Engine(EngineStats()))
    sm.observe_first_token(0.2)
    sm.observe_finished(e2e_s=1.2, ttft_s=0.2, num_output_tokens=11)  # TPOT = 0.1 s
    sm.observe_finished(e2e_s=0.3, ttft_s=0.3, num_output_tokens=1)  # no TPOT for 1 token
    sm.count_finished("error")  # not a success
    lines = _sample_lines(sm.render()[0].decode())
    assert lines["pdserve:time_to_first_token_seconds_count"] == 1
    assert lines["pdserve:e2e_request_latency_seconds_count"] == 2
    assert lines["pdserve:time_per_output_token_seconds_count"] == 1
    assert abs(lines["pdserve:time_per_output_token_seconds_sum"] - 0.1) < 1e-9
    assert not any("error" in k for k in lines)


def test_registries_are_per_instance() -> None:
    a = m.ServerMetrics(_Engine(EngineStats()))
    b = m.ServerMetrics(_Engine(EngineStats()))
    a.observe_first_token(0.1)
    assert _sample_lines(b.render()[0].decode())["pdserve:time_to_first_token_seconds_count"] == 0


def test_transfer_path_of_each_peer_is_an_info_metric() -> None:
    engine = _Engine(EngineStats())
    sm = m.ServerMetrics(engine)
    (listener,) = engine.listeners
    assert "kv_transfer_path_info" not in sm.render()[0].decode()  # before any handshake
    listener({"transfer_paths": {"p1": {"transport": "nixl", "mem": "VRAM->VRAM",
                                        "read_gbps": None}}})
    listener({"transfer_paths": {"p2": {"transport": "cuda_ipc", "mem": "VRAM->VRAM",
                                        "read_gbps": 1500.5}}})
    listener({"transfer_paths": {"p1": {"transport": "nixl", "mem": "VRAM->VRAM",
                                        "read_gbps": 0.54}}})
    text = sm.render()[0].decode()
    lines = _sample_lines(text)
    assert lines['pdserve:kv_transfer_path_info{mem="VRAM->VRAM",peer_engine_id="p1",'
                 'transport="nixl"}'] == 1
    assert lines['pdserve:kv_transfer_read_gbps{peer_engine_id="p1",transport="nixl"}'] == 0.54
    assert lines['pdserve:kv_transfer_read_gbps{peer_engine_id="p2",transport="cuda_ipc"}'] \
        == 1500.5
    for fam in text_string_to_metric_families(text):
        assert fam.samples, fam.name


def test_kv_tier_metrics_from_the_engine_snapshot_summed_over_ranks() -> None:
    from pdserve.engine.kv_tiers import TierManager
    from pdserve.types.kv_tiers import KVTierReport

    tm = TierManager(host_blocks=2, disk_blocks=8, block_bytes=100)
    for b, h in enumerate([1, 2, 3]):
        tm.on_evict(b, h)
    tm.start_load("r", [2], [9])
    job = [j for j in tm.take_jobs().jobs if j.kind.value == "load"][0]
    tm.loads_reported(KVTierReport(finished_loads={job.job_id}, copy_times_s=[0.0003, 2.0]))
    snap = dict(tm.stats(), prompt_tokens_loaded=16, failed_loads=0)
    one = EngineStats(num_blocks=4, kv_tiers=snap)
    two = EngineStats.combine([one, EngineStats(num_blocks=4, kv_tiers=snap), EngineStats()])
    lines = _sample_lines(m.ServerMetrics(_Engine(two)).render()[0].decode())
    assert lines['pdserve:kv_offload_capacity_blocks{medium="CPU"}'] == 4
    assert lines['pdserve:kv_offload_used_blocks{medium="DISK"}'] == 2
    assert lines['pdserve:kv_offload_stored_blocks_total{medium="CPU"}'] == 6
    assert lines['pdserve:kv_offload_hits_total{medium="CPU"}'] == 2
    assert lines['pdserve:kv_offload_evictions_total{medium="CPU"}'] == 2
    assert lines['pdserve:kv_offload_bytes_total{medium="GPU"}'] == 200
    assert lines['pdserve:kv_offload_prompt_tokens_loaded_total'] == 32
    assert lines['pdserve:kv_offload_copy_seconds_bucket{le="0.0005"}'] == 2
    assert lines['pdserve:kv_offload_copy_seconds_count'] == 4
    assert lines['pdserve:kv_offload_copy_seconds_sum'] == 2 * 2.0003
    no_tiers = _sample_lines(m.ServerMetrics(_Engine(EngineStats())).render()[0].decode())
    assert not any("kv_offload" in k for k in no_tiers)


def test_demoted_turn_metrics_from_the_engine_snapshot() -> None:
    """A decoder's turn counters are rendered beside the tiers' families, and without tiers
    too (a decoder without tiers gives its turns up to the prefix cache)."""
    from pdserve.engine.kv_tiers import TierManager

    turns = {"turns_demoted": 3, "turns_restored": 2, "turn_blocks_from_gpu": 4,
             "turn_blocks_from_tiers": 5, "turns_lost": 1}
    snap = dict(TierManager(host_blocks=2).stats(), prompt_tokens_loaded=0, failed_loads=0)
    for tiers in (snap, None):
        two = EngineStats.combine([EngineStats(num_blocks=4, kv_tiers=tiers, kv_turns=turns)] * 2)
        lines = _sample_lines(m.ServerMetrics(_Engine(two)).render()[0].decode())
        assert lines["pdserve:kv_offload_turns_demoted_total"] == 6
        assert lines["pdserve:kv_offload_turns_restored_total"] == 4
        assert lines['pdserve:kv_offload_turn_blocks_restored_total{medium="GPU"}'] == 8
        assert lines['pdserve:kv_offload_turn_blocks_restored_total{medium="TIER"}'] == 10
        assert lines["pdserve:kv_offload_turns_lost_total"] == 2
        assert (lines.get('pdserve:kv_offload_used_blocks{medium="CPU"}') is not None) == \
            (tiers is not None)
    # an engine without a KV connector has no turn leases: no such family
    lines = _sample_lines(m.ServerMetrics(_Engine(EngineStats(num_blocks=4, kv_tiers=snap)))
                          .render()[0].decode())
    assert not any("kv_offload_turn" in k for k in lines)
