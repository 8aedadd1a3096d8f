"""benchmarks/pd_multi_turn.py --kv-tiers without deployments: option checks, the block-count
arithmetic, the workload spec, the engine options given to P and D, the metrics parsing and
the report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import pd_multi_turn  # noqa: E402
import pd_multi_turn_tiers as tiers  # noqa: E402


def _args(*argv: str):
    ap = pd_multi_turn.argparse.ArgumentParser()
    ap.add_argument("--num-clients", type=int, default=4)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-args", default="")
    tiers.add_arguments(ap)
    return ap.parse_args(["--kv-tiers", *argv])


def test_plan_sizes_the_cache_from_the_overcommit():
    args = _args()  # 16 x 3 turns: 192 + 2 x 48 + 3 x 16 tokens + 7 messages x 12 template tokens
    p = tiers.plan(args)
    assert p["conversation_tokens"] == 192 + 96 + 48 + 84 == 420
    assert p["total_tokens"] == 16 * 420
    assert p["num_blocks"] == 240  # ceil(6720 / 1.75 / 16)
    assert p["min_blocks"] == 4 * 28  # ceil((420 + 16) / 16) per conversation in flight
    assert p["max_model_len"] == 436 and not p["fits"]
    fits = tiers.plan(_args("--overcommit", "0.8"))
    assert fits["num_blocks"] == 525 and not fits["fits"]  # 420 held + 4 x 28 in flight > 525
    assert tiers.plan(_args("--overcommit", "0.7"))["fits"]  # 600 blocks
    assert tiers.check(args) is None
    assert not args.tier_first and _args("--tier-first").tier_first
    assert args.lease_ttl == 15.0


@pytest.mark.parametrize("argv, message", [
    (("--conversations", "0"), "--conversations must be >= 1"),
    (("--overcommit", "0"), "--overcommit must be > 0"),
    (("--first-tokens", "10", "--user-tokens", "20"), "--first-tokens must be >= --user-tokens"),
    (("--offload-gib", "-1"), "--offload-gib must be > 0"),
    (("--lease-ttl", "0"), "--lease-ttl must be > 0"),
    (("--conversations", "4", "--overcommit", "2"), "cannot hold --num-clients 4"),
])
def test_check_refuses_bad_options(argv, message):
    assert message in tiers.check(_args(*argv))


def test_main_refuses_bad_options_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as e:
        pd_multi_turn.main(["--kv-tiers", "--overcommit", "-1"])
    assert e.value.code == 2
    assert "--overcommit must be > 0" in capsys.readouterr().err


def test_engine_args_are_the_same_on_both_cases_but_the_tier():
    args = _args()
    base = tiers.engine_args(args, None)
    assert base == ["--num-gpu-blocks-override", "240", "--block-size", "16",
                    "--max-model-len", "436",
                    "--kv-transfer-config.kv_connector_extra_config.decoder_kv_blocks_ttl", "15"]
    tier = tiers.engine_args(args, 0.25)
    assert tier == base + ["--kv-offloading-size", "0.250000", "--kv-offloading-backend", "native"]


def test_cases_in_order_with_the_depth_first_twins_and_the_device_cache():
    args = _args("--tier-first", "--depth-first-run", "--device-cache-run")
    got = tiers.cases(args, 0.25)
    assert [name for name, _, _ in got] == [
        "host tier", "no tier", "host tier, depth-first", "no tier, depth-first", "device cache"]
    assert got[0][1] == tiers.engine_args(args, 0.25) and got[1][1] == tiers.engine_args(args, None)
    assert got[2][1] == got[0][1] + ["--prefix-cache-eviction", "depth-first"]
    assert got[3][1] == got[1][1] + ["--prefix-cache-eviction", "depth-first"]
    assert [dc for _, _, dc in got] == [False, False, False, False, True]
    assert [name for name, _, _ in tiers.cases(_args(), 0.25)] == ["no tier", "host tier"]


def test_device_cache_run_holds_every_conversation():
    args = _args("--device-cache-run")
    assert args.device_cache_run and not _args().device_cache_run
    blocks = tiers.plan(args)["device_cache_blocks"]
    assert blocks == 16 * 27 + 4 * 28  # ceil(420 / 16) held, ceil(436 / 16) per request in flight
    assert tiers.plan(_args("--overcommit", str(16 * 420 / 16 / blocks)))["fits"]
    assert not tiers.plan(_args("--overcommit", str(16 * 420 / 16 / (blocks - 1))))["fits"]
    assert tiers.engine_args(args, None, blocks)[:2] == ["--num-gpu-blocks-override", str(blocks)]
    assert tiers.engine_args(args, None)[1] == "240"


def test_spec_and_bench_args_describe_the_workload():
    args = _args("--conversations", "8", "--turns", "4")
    s = tiers.spec(args)
    assert s["filetype"] == "generate_conversations" and s["num_conversations"] == 8
    assert s["prompt_input"]["num_turns"]["value"] == 8  # messages: user and assistant
    assert s["prompt_input"]["prefix_num_tokens"]["value"] == 192 - 48
    assert s["prompt_input"]["num_tokens"]["value"] == 48
    assert s["prompt_output"]["num_tokens"]["value"] == 16
    assert tiers.bench_args(args) == ["-k", "8", "--limit-min-tokens", "16",
                                      "--limit-max-tokens", "16"]


def test_offload_size_from_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 100}))
    assert tiers.kv_bytes_per_token(tmp_path, "cpu", []) == 2 * 2 * 2 * 16 * 4  # bytes per token
    assert tiers.kv_bytes_per_token(tmp_path, "cuda", []) == 2 * 2 * 2 * 16 * 2
    assert tiers.kv_bytes_per_token(tmp_path, "cuda", ["--dtype", "float32"]) == 2 * 2 * 2 * 16 * 4
    args = _args()
    assert tiers.offload_gib(args, tmp_path) == pytest.approx(1.25 * 6720 * 512 / (1 << 30))
    assert tiers.offload_gib(_args("--offload-gib", "3"), tmp_path) == 3


def test_series_parsing_delta_and_report():
    page = ('pdserve:prompt_tokens_total{model_name="m"} 100.0\n'
            'pdserve:kv_offload_hits_total{medium="CPU"} 7.0\n'
            'pdserve:kv_offload_turns_demoted_total 3.0\n# HELP x\n')
    s = tiers.parse_series(page)
    assert s["pdserve:prompt_tokens_total"] == 100 and s['pdserve:kv_offload_hits_total'] == 7
    assert s['pdserve:kv_offload_hits_total{medium="CPU"}'] == 7
    # the connector's counters are rendered without "_total" (the parser names them with it)
    counters = tiers.parse_series("# HELP pdserve:nixl_num_kv_expired_reqs x\n"
                                  "# TYPE pdserve:nixl_num_kv_expired_reqs counter\n"
                                  "pdserve:nixl_num_kv_expired_reqs 2.0\n"
                                  "# HELP pdserve:prompt_tokens_total x\n"
                                  "# TYPE pdserve:prompt_tokens_total counter\n"
                                  "pdserve:prompt_tokens_total 5.0\n")
    assert counters == {"pdserve:nixl_num_kv_expired_reqs": 2.0, "pdserve:prompt_tokens_total": 5.0}
    d = tiers.delta([s], [{"pdserve:prompt_tokens_total": 40.0}],
                    ["pdserve:prompt_tokens_total", "pdserve:kv_offload_turns_lost_total"])
    assert d == {"pdserve:prompt_tokens_total": 60.0, "pdserve:kv_offload_turns_lost_total": 0.0}

    def case(later):
        summary = {"sections": {"turn 1": {"ttft_ms": {"p50": 10.0, "p90": 20.0, "count": 4}},
                                "turns 2+": {"ttft_ms": {"p50": later[0], "p90": later[1],
                                                         "count": 8}}},
                   "output_tokens_per_sec": 50.0, "requests_per_sec": 2.0, "num_failed": 0}
        names = [*tiers.P_SERIES, *tiers.TIER_SERIES, *tiers.D_TURN_SERIES]
        return {"ttft": tiers.ttft_percentiles(summary), "prefill": dict.fromkeys(names, 1.0),
                "decode": dict.fromkeys(names, 2.0)}

    lines = tiers.report({"no tier": case((40.0, 80.0)), "host tier": case((10.0, 20.0)),
                          "device cache": case((8.0, 16.0))})
    assert lines[-1].startswith("summary: turns 2+ TTFT p50 40.0 -> 8.0 ms (5.00x), p90 80.0 -> "
                                "16.0 ms (5.00x); no tier / device cache")
    lines = tiers.report({"no tier": case((40.0, 80.0)), "host tier": case((10.0, 20.0))})
    assert lines[-1].startswith("summary: turns 2+ TTFT p50 40.0 -> 10.0 ms (4.00x), p90 "
                                "80.0 -> 20.0 ms (4.00x)")
    lines = tiers.report({"no tier": case((40.0, 80.0)), "host tier": case((10.0, 20.0)),
                          "no tier, depth-first": case((20.0, 40.0)),
                          "host tier, depth-first": case((8.0, 10.0))})
    assert lines[-3].endswith("(2.00x), p90 80.0 -> 40.0 ms (2.00x); no tier / no tier, "
                              "depth-first")
    assert lines[-2].endswith("(5.00x), p90 80.0 -> 10.0 ms (8.00x); no tier / host tier, "
                              "depth-first")
    assert lines[-1].endswith("p50 20.0 -> 8.0 ms (2.50x), p90 40.0 -> 10.0 ms (4.00x); both "
                              "depth-first: no tier / host tier")
    assert any("D turn leases: demoted 2, restored 2" in line for line in lines)
    assert any("pulled from D 1 (pulls given up 1)" in line for line in lines)
