"""The ``KV Transfer metrics: ...`` summary line (``kv_metrics_log_interval``) is written for an
interval with transfer activity even when the engine goes idle right after it, and only once."""

from __future__ import annotations

import time

import pytest

from tests.support.servers import EngineServer, decode_leg, nixl_config, prefill_leg, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

INTERVAL_S = 1.0
COMMON = ["--block-size", "16", "--num-gpu-blocks-override", "256", "--max-model-len", "512"]
LINE = "KV Transfer metrics: Num successful transfers="


def summary_lines(server: EngineServer) -> list[str]:
    return [line for line in server.log_path.read_text(errors="replace").splitlines()
            if LINE in line]


def test_summary_line_after_one_short_transfer_then_idle(server_pool, tiny_llama_path, tmp_path):
    # the line checked is the decoder's (it reads the KV): the session's pooled producer serves
    d = EngineServer(tiny_llama_path, tmp_path / "d.log",
               nixl_config("kv_consumer", kv_metrics_log_interval=INTERVAL_S), COMMON)
    try:
        p = server_pool.get("p")["p"]
        start_all([d])
        body = {"model": tiny_llama_path, "prompt": list(range(1000, 1200)), "max_tokens": 2,
                "temperature": 0}
        params = prefill_leg(p, "completions", body)
        out = decode_leg(d, "completions", body, params)
        done = time.monotonic()
        assert out["status"] == 200, out
        assert d.metrics()["pdserve:nixl_xfer_time_seconds_count"] == 1
        # the engine is idle now; the line of the transfer's interval still comes in time
        while not summary_lines(d):
            assert time.monotonic() - done <= INTERVAL_S + 1.0, (
                f"no summary line within {INTERVAL_S + 1.0} s:\n{d.log_tail()}")
            time.sleep(0.05)
        assert "Num successful transfers=1," in summary_lines(d)[0]
        # idle: no further line in the next intervals
        time.sleep(3 * INTERVAL_S)
        assert len(summary_lines(d)) == 1, summary_lines(d)
    finally:
        d.stop()
