"""``--kv-transfer-config`` parsing and validation."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.types.kv_transfer_config import KVTransferConfig, KVTransferConfigError
from pdserve.kv_transfer.config_cli import extract_kv_transfer_args
from pdserve.kv_transfer.factory import create_connector


def test_json_form_and_defaults():
    cfg, rest = extract_kv_transfer_args(
        ["model", "--kv-transfer-config",
         '{"kv_connector":"NixlConnector","kv_role":"kv_producer"}', "--port", "8000"]
    )
    assert rest == ["model", "--port", "8000"]
    assert cfg.kv_role == "kv_producer" and cfg.is_producer and not cfg.is_consumer
    assert cfg.kv_load_failure_policy == "fail"
    assert cfg.backends == ["UCX"]
    assert cfg.kv_lease_duration == 30.0
    assert cfg.bidirectional_kv_xfer is False
    assert cfg.kv_recompute_threshold == 64
    assert cfg.kv_pull_wait_factor == 1.0
    assert cfg.decoder_kv_blocks_ttl == 480.0
    assert cfg.kv_metrics_log_interval == 10.0
    assert cfg.same_host_transport == "auto"
    assert cfg.engine_id  # random default
    assert KVTransferConfig(kv_role="kv_consumer").engine_id != cfg.engine_id


def test_equals_form_and_dotted_keys_override_in_order():
    cfg, rest = extract_kv_transfer_args([
        '--kv-transfer-config={"kv_role":"kv_producer","engine_id":"e1"}',
        "--kv-transfer-config.kv_role", "kv_consumer",
        "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration", "5",
        "--kv-transfer-config.kv_connector_extra_config.bidirectional_kv_xfer=true",
        "--kv-transfer-config.kv_load_failure_policy=recompute",
        "--other",
    ])
    assert rest == ["--other"]
    assert cfg.kv_role == "kv_consumer" and cfg.is_consumer
    assert cfg.engine_id == "e1"
    assert cfg.kv_lease_duration == 5.0
    assert cfg.bidirectional_kv_xfer is True
    assert cfg.kv_load_failure_policy == "recompute"


@pytest.mark.parametrize("key", ["kv_lease_duration", "decoder_kv_blocks_ttl",
                                 "kv_metrics_log_interval", "kv_handshake_timeout",
                                 "kv_transfer_timeout"])
def test_sub_second_durations_are_accepted(key):
    cfg, _ = extract_kv_transfer_args([
        "--kv-transfer-config.kv_role", "kv_producer",
        f"--kv-transfer-config.kv_connector_extra_config.{key}", "0.25",
    ])
    assert cfg.kv_connector_extra_config[key] == 0.25
    cfg = KVTransferConfig(kv_role="kv_consumer", kv_connector_extra_config={key: 0.5})
    assert cfg.kv_connector_extra_config[key] == 0.5


def test_list_append():
    cfg, _ = extract_kv_transfer_args([
        "--kv-transfer-config.kv_role", "kv_consumer",
        "--kv-transfer-config.kv_connector_extra_config.backends+", "LIBFABRIC",
    ])
    assert cfg.backends == ["UCX", "LIBFABRIC"]
    cfg, _ = extract_kv_transfer_args([
        "--kv-transfer-config", '{"kv_role":"kv_consumer","kv_connector_extra_config":'
                                '{"backends":["POSIX"]}}',
        "--kv-transfer-config.kv_connector_extra_config.backends+", '["UCX","GDS"]',
    ])
    assert cfg.backends == ["POSIX", "UCX", "GDS"]


def test_engine_id_number_is_rejected_but_json_string_accepted():
    with pytest.raises(KVTransferConfigError, match="engine_id"):
        extract_kv_transfer_args(
            ["--kv-transfer-config.kv_role", "kv_producer", "--kv-transfer-config.engine_id", "123"]
        )
    cfg, _ = extract_kv_transfer_args(
        ["--kv-transfer-config.kv_role", "kv_producer",
         "--kv-transfer-config.engine_id", '"123"']
    )
    assert cfg.engine_id == "123"


def test_absent_flag_returns_none_and_stops_at_double_dash():
    assert extract_kv_transfer_args(["a", "--port", "1"]) == (None, ["a", "--port", "1"])
    cfg, rest = extract_kv_transfer_args(["--", "--kv-transfer-config", "{}"])
    assert cfg is None and rest == ["--", "--kv-transfer-config", "{}"]


def test_kv_both_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="pdserve.types.kv_transfer_config"):
        cfg = KVTransferConfig.from_dict({"kv_role": "kv_both"})
    assert cfg.is_producer and cfg.is_consumer
    assert any("deprecated" in r.message for r in caplog.records)


def test_vllms_push_connector_name_is_the_nixl_connector(caplog):
    """vLLM's ``NixlPushConnector`` name gives pdserve's one connector (the concurrent hand-off
    starts D's read the moment P holds the KV), said once in the log."""
    with caplog.at_level(logging.INFO, logger="pdserve.types.kv_transfer_config"):
        cfg = KVTransferConfig.from_dict({"kv_connector": "NixlPushConnector",
                                          "kv_role": "kv_consumer"})
    assert cfg.kv_connector == "NixlConnector" and cfg.to_dict()["kv_connector"] == "NixlConnector"
    assert "NixlPushConnector runs as NixlConnector" in caplog.text
    assert create_connector(cfg, "scheduler") is not None


def test_round_trip():
    cfg = KVTransferConfig.from_dict({"kv_role": "kv_consumer",
                                      "kv_connector_extra_config": {"kv_lease_duration": 2}})
    again = KVTransferConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again == cfg


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--kv-transfer-config", '{"kv_connector":"LMCache","kv_role":"kv_producer"}'],
         "unknown kv_connector 'LMCache'"),
        (["--kv-transfer-config", '{"kv_role":"kv_prefill"}'], "unknown kv_role 'kv_prefill'"),
        (["--kv-transfer-config", '{"kv_connector":"NixlConnector"}'], "kv_role is required"),
        (["--kv-transfer-config", '{"kv_role":"kv_producer","kv_rol":"x"}'],
         r"unknown --kv-transfer-config key\(s\) \['kv_rol'\]"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.lease", "3"],
         r"unknown kv_connector_extra_config key\(s\) \['lease'\]"),
        (["--kv-transfer-config", "{not json"], "not valid JSON"),
        (["--kv-transfer-config", "[1,2]"], "must be a JSON object"),
        (["--kv-transfer-config"], "needs a value"),
        (["--kv-transfer-config.kv_role"], "needs a value"),
        (["--kv-transfer-config", '{"kv_role":"kv_producer","kv_load_failure_policy":"retry"}'],
         "unknown kv_load_failure_policy 'retry'"),
        (["--kv-transfer-config", '{"kv_role":"kv_producer","enable_permute_local_kv":"yes"}'],
         "enable_permute_local_kv must be true or false"),
        (["--kv-transfer-config", '{"kv_role":"kv_producer","kv_buffer_device":"tpu"}'],
         "unknown kv_buffer_device 'tpu'"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration", "soon"],
         "kv_lease_duration must be a positive number"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration", "-1"],
         "kv_lease_duration must be a positive number"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.bidirectional_kv_xfer", "1"],
         "bidirectional_kv_xfer must be true or false"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_recompute_threshold", "1.5"],
         "kv_recompute_threshold must be a non-negative integer"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_pull_wait_factor", "-0.5"],
         "kv_pull_wait_factor must be a non-negative number"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_pull_wait_factor", "true"],
         "kv_pull_wait_factor must be a non-negative number"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.kv_pull_wait_factor", "NaN"],
         "kv_pull_wait_factor must be a non-negative number"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.backends", "[]"],
         "backends must be a non-empty list"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.backends", "[1]"],
         "backends must be a non-empty list"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config", "5"],
         "kv_connector_extra_config must be a JSON object"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_role.sub", "x"], "not an object"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_role+", "x"], "cannot append"),
        (["--kv-transfer-config..kv_role", "kv_producer"], "malformed option"),
        (["--kv-transfer-config.kv_role", "kv_producer",
          "--kv-transfer-config.kv_connector_extra_config.same_host_transport", "shm"],
         "same_host_transport must be one of"),
    ],
)
def test_invalid_configs_raise_clear_errors(argv, match):
    with pytest.raises(KVTransferConfigError, match=match):
        extract_kv_transfer_args(argv)


def test_same_host_transport_override():
    cfg, _ = extract_kv_transfer_args(
        ["--kv-transfer-config.kv_role", "kv_consumer",
         "--kv-transfer-config.kv_connector_extra_config.same_host_transport", "nixl"])
    assert cfg.same_host_transport == "nixl"


@pytest.mark.parametrize("value", [True, False])
def test_nixl_progress_thread_values(value):
    cfg = KVTransferConfig.from_dict(
        {"kv_role": "kv_consumer", "kv_connector_extra_config": {"nixl_progress_thread": value}})
    assert cfg.nixl_progress_thread is value
    assert KVTransferConfig(kv_role="kv_consumer").nixl_progress_thread is True


@pytest.mark.parametrize("bad", ["yes", "auto", 1, 0, None])
def test_nixl_progress_thread_rejects_other_values(bad):
    with pytest.raises(KVTransferConfigError, match="nixl_progress_thread"):
        KVTransferConfig.from_dict(
            {"kv_role": "kv_consumer", "kv_connector_extra_config": {"nixl_progress_thread": bad}})


def test_error_is_a_value_error():
    assert issubclass(KVTransferConfigError, ValueError)


def test_side_channel_env(monkeypatch):
    cfg = KVTransferConfig(kv_role="kv_producer")
    for name in ("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "PDSERVE_NIXL_SIDE_CHANNEL_PORT",
                 "VLLM_NIXL_SIDE_CHANNEL_HOST", "VLLM_NIXL_SIDE_CHANNEL_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("localhost", 5600)
    assert cfg.side_channel_port_for(3) == 5603
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "10.0.0.2")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "7000")
    assert (cfg.side_channel_host, cfg.side_channel_port) == ("10.0.0.2", 7000)
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_HOST", "10.0.0.3")
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "7100")
    assert (cfg.side_channel_host, cfg.side_channel_port_for(1)) == ("10.0.0.3", 7101)
    monkeypatch.setenv("PDSERVE_NIXL_SIDE_CHANNEL_PORT", "many")
    with pytest.raises(KVTransferConfigError, match="PDSERVE_NIXL_SIDE_CHANNEL_PORT"):
        _ = cfg.side_channel_port
