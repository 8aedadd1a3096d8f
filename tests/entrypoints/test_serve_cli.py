"""``pdserve serve`` command line: option parsing and clear startup errors."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys

import pytest

from pdserve.types.engine_config import DEFAULT_MODEL, EngineConfig
from pdserve.commands.parser import parse_size, writable_dir
from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args
from pdserve.entrypoints.server import StartupError, check_paths, main

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


@pytest.mark.parametrize("text,expected", [
    ("4096", 4096), ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1.5 GiB", 3 * 2**29),
    ("4G", 4 * 10**9), ("3gb", 3 * 10**9), ("1e9", 10**9), ("64KiB", 65536), ("10k", 10000),
])
def test_parse_size(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "abc", "2XB", "-1GiB", "0", "GiB"])
def test_parse_size_rejects(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        parse_size(text)


def test_defaults_match_engine_config() -> None:
    args = build_parser().parse_args([])
    cfg = engine_config_from_args(args, None)
    assert cfg == EngineConfig()
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 8000, None)
    assert cfg.model == DEFAULT_MODEL


def test_every_option_reaches_engine_config() -> None:
    args = build_parser().parse_args([
        "/models/x", "--served-model-name", "x", "--tokenizer", "/tok", "--load-format", "dummy",
        "--dtype", "bfloat16", "--device", "cpu", "--seed", "5", "--block-size", "32",
        "--no-enable-prefix-caching", "--max-model-len", "1024", "--max-num-batched-tokens",
        "512", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5", "--kv-cache-memory",
        "1GiB", "--num-gpu-blocks-override", "64", "--enforce-eager", "--trust-remote-code",
        "--no-async-scheduling",
    ])
    kv = object()
    cfg = engine_config_from_args(args, kv)
    assert cfg == EngineConfig(
        model="/models/x", served_model_name="x", tokenizer="/tok", load_format="dummy",
        dtype="bfloat16", device="cpu", seed=5, block_size=32, enable_prefix_caching=False,
        max_model_len=1024, max_num_batched_tokens=512, max_num_seqs=8,
        gpu_memory_utilization=0.5, kv_cache_memory=2**30, num_gpu_blocks_override=64,
        enforce_eager=True, kv_transfer_config=kv, trust_remote_code=True,
        async_scheduling=False)
    on = build_parser().parse_args(["--async-scheduling"])
    assert engine_config_from_args(on, None).async_scheduling is True


@pytest.mark.parametrize("argv", [
    ["--dtype", "float8"], ["--block-size", "0"], ["--port", "70000"],
    ["--kv-cache-memory", "lots"], ["--gpu-memory-utilization", "1.5"], ["--bogus"],
])
def test_bad_options_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pdserve serve" in err and "error" in err


def test_bad_kv_transfer_config_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--kv-transfer-config", "{not json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pdserve serve: error:") and "kv-transfer-config" in err
    assert main(["--kv-transfer-config.kv_role", "kv_sideways"]) == 2
    assert "kv_sideways" in capsys.readouterr().err


def test_kv_offloading_flags_reach_engine_config(tmp_path) -> None:
    disk = str(tmp_path / "tiers" / "disk")  # not there yet: created at start-up
    args = build_parser().parse_args([
        "--kv-offloading-size", "2", "--kv-offloading-backend", "Native",
        "--kv-offloading-disk-dir", disk, "--kv-offloading-disk-size", "0.5"])
    off = engine_config_from_args(args, None).kv_offloading
    assert (off.host_bytes, off.disk_dir, off.disk_bytes) == (2 * 2**30, disk, 2**29)


def test_a_disk_tier_directory_through_a_file_exits_2(tmp_path, capsys) -> None:
    afile = tmp_path / "afile"
    afile.write_text("")
    argv = ["--kv-offloading-size", "1", "--kv-offloading-disk-dir", str(afile / "sub"),
            "--kv-offloading-disk-size", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--kv-offloading-disk-dir" in err and "is not a directory" in err


@pytest.mark.parametrize("path", ["/proc/pdserve-no-such-dir", "/sys/kernel/pdserve-x"])
def test_a_disk_tier_directory_that_cannot_be_created_is_refused(path) -> None:
    """Under /proc or /sys even root cannot create it: refused when the options are parsed
    (it failed with PermissionError / FileNotFoundError after the model had loaded)."""
    with pytest.raises(argparse.ArgumentTypeError, match="cannot be created|not writable"):
        writable_dir(path)
    assert not os.path.exists(path)


def test_writable_dir_check_leaves_nothing_behind(tmp_path) -> None:
    assert writable_dir(str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()
    assert writable_dir(str(tmp_path)) == str(tmp_path) and not any(tmp_path.iterdir())


def test_a_directory_that_is_not_a_model_is_refused(tmp_path) -> None:
    """The model loader takes a directory with config.json or a .gguf file; anything else is
    refused before the engine starts (exit code 2)."""
    with pytest.raises(StartupError, match="config.json"):
        check_paths(EngineConfig(model=str(tmp_path)))
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(StartupError, match=".gguf"):
        check_paths(EngineConfig(model=str(tmp_path / "weights.bin")))
    (tmp_path / "config.json").write_text("{}")
    check_paths(EngineConfig(model=str(tmp_path)))


@pytest.mark.parametrize("argv, message", [
    (["--kv-offloading-size", "0"], "--kv-offloading-size"),
    (["--kv-offloading-size", "inf"], "finite"),
    (["--kv-offloading-size", "nan"], "finite"),
    (["--kv-offloading-size", "1", "--kv-offloading-disk-dir", ".",
      "--kv-offloading-disk-size", "inf"], "finite"),
    (["--kv-offloading-size", "1", "--kv-offloading-backend", "lmcache"], "must be 'native'"),
    (["--kv-offloading-size", "1", "--kv-offloading-backend", ""], "must be 'native'"),
    (["--kv-offloading-disk-size", "1"], "need --kv-offloading-size"),
    (["--kv-offloading-size", "1", "--kv-offloading-disk-size", "1"], "go together"),
])
def test_bad_kv_offloading_flags_exit_2(argv, message, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pdserve serve" in err and message in err


def test_help_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "--kv-cache-memory" in out and "--kv-transfer-config" in out


def _serve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", *argv],
                          capture_output=True, text=True, timeout=120, env=ENV)


@pytest.mark.slow
def test_missing_model_path_is_one_clear_line(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    p = _serve(str(missing), "--port", "0")
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert str(missing) in p.stderr and "not found" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.slow
def test_port_in_use_is_one_clear_line() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        p = _serve("--port", str(port))
    assert p.returncode == 1
    assert "Traceback" not in p.stderr
    assert f"127.0.0.1:{port}" in p.stderr and "in use" in p.stderr.lower()
