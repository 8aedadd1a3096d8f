"""Command lines of tensor parallelism: ``pdserve serve -tp N`` into EngineConfig, the device
check of N ranks, and ``pdserve up --prefill-tp N --decode-tp M`` (arguments, GPU sets)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.support.ports import free_port
from pdserve.types.engine_config import EngineConfig
from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args
from pdserve.launcher.cli import parse_args
from pdserve.launcher.errors import LaunchError
from pdserve.launcher.plan import ChildCommands, build_plan
from pdserve.engine.core_client import rank_devices
from pdserve.models.loader import check_tp_devices, tp_device


def _serve_config(argv: list[str]) -> EngineConfig:
    return engine_config_from_args(build_parser().parse_args(argv), None)


def test_serve_tensor_parallel_size_option():
    assert _serve_config([]).tensor_parallel_size == 1
    assert _serve_config(["m", "-tp", "2"]).tensor_parallel_size == 2
    assert _serve_config(["m", "--tensor-parallel-size", "4"]).tensor_parallel_size == 4
    with pytest.raises(SystemExit):
        build_parser().parse_args(["m", "-tp", "0"])


def test_rank_devices_and_the_check_that_they_exist():
    cfg = EngineConfig(tensor_parallel_size=2)
    cuda = torch.device("cuda", 1)
    assert [tp_device(cuda, cfg, r) for r in (0, 1)] == [torch.device("cuda", 1),
                                                          torch.device("cuda", 2)]
    # A data-parallel rank's engine core sees only its own devices (CUDA_VISIBLE_DEVICES):
    # its TP rank r is device base + r whatever its DP rank; the DP rank's devices are
    # d * tp + r of the host's.
    dp = EngineConfig(tensor_parallel_size=2, data_parallel_size=2, data_parallel_rank=1)
    assert tp_device(torch.device("cuda"), dp, 1) == torch.device("cuda", 1)
    assert rank_devices(1, 2) == [2, 3]
    assert tp_device(torch.device("cpu"), cfg, 1) == torch.device("cpu")
    check_tp_devices(cfg, torch.device("cuda"), 2)
    check_tp_devices(EngineConfig(tensor_parallel_size=8), torch.device("cpu"), 0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs CUDA devices 0\.\.1, "
                                         r"but 1 device\(s\) are present"):
        check_tp_devices(cfg, torch.device("cuda"), 1)
    with pytest.raises(ValueError, match=r"needs CUDA devices 1\.\.2"):
        check_tp_devices(cfg, cuda, 2)


def _plan(argv: list[str], gpus: list[str]):
    # a model the launcher cannot read: its TP split is the engine's to check
    return build_plan(parse_args(["--port", str(free_port()), *argv, "my-model"]),
                      ChildCommands(python="py"), gpus=gpus)


def _tp_of(argv: list[str]) -> int:
    return int(argv[argv.index("--tensor-parallel-size") + 1]) \
        if "--tensor-parallel-size" in argv else 1


def test_up_prefill_and_decode_tp():
    opts = parse_args(["--prefill-tp", "2", "--decode-tp", "1", "my-model"])
    assert (opts.prefill_tp, opts.decode_tp, opts.model) == (2, 1, "my-model")
    # enough GPUs: each engine its own disjoint set
    prefill, decode, proxy = _plan(["--prefill-tp", "2", "--decode-tp", "1"], ["0", "1", "2"])
    assert (_tp_of(prefill.argv), _tp_of(decode.argv), _tp_of(proxy.argv)) == (2, 1, 1)
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2")
    specs = _plan(["--num-prefillers", "2", "--prefill-tp", "2", "--decode-tp", "2"],
                  ["a", "b", "c", "d", "e", "f"])
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs[:3]] == ["a,b", "c,d", "e,f"]
    # too few GPUs: a clear error with the numbers
    with pytest.raises(LaunchError, match=r"1 prefiller\(s\) x TP 2 \+ 1 decoder\(s\) x TP 1 "
                                          r"need 3 GPUs, but 2 are available"):
        _plan(["--prefill-tp", "2"], ["0", "1"])
    # on the CPU any size
    prefill, decode, _ = _plan(["--device", "cpu", "--prefill-tp", "2", "--decode-tp", "3"],
                               ["0"])
    assert (_tp_of(prefill.argv), _tp_of(decode.argv)) == (2, 3)
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env
    # the launcher owns the engines' TP sizes
    with pytest.raises(LaunchError, match="--prefill-tp/--decode-tp"):
        _plan(["--", "-tp", "2"], [])
    with pytest.raises(SystemExit):
        parse_args(["--decode-tp", "0"])


def _model_dir(tmp_path, heads: int, kv_heads: int, vocab: int = 64, intermediate: int = 32):
    d = tmp_path / f"m{heads}-{kv_heads}-{vocab}-{intermediate}"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "vocab_size": vocab, "intermediate_size": intermediate,
        "hidden_size": 16 * heads, "num_hidden_layers": 1}))
    return str(d)


def test_up_refuses_a_tp_size_the_model_does_not_split_over_before_starting(tmp_path, capsys):
    """Heads, KV heads and vocabulary are checked from config.json (or, for the built-in model
    before its conversion, its GGUF metadata) before any process starts: one line, exit 2."""
    from pdserve.launcher.cli import main as up_main

    port = str(free_port())
    for argv, flag in ((["--prefill-tp", "2"], "--prefill-tp 2"),
                       (["--decode-tp", "2"], "--decode-tp 2")):
        with pytest.raises(LaunchError, match=f"{flag}: .*9 attention heads are not divisible"):
            build_plan(parse_args(["--port", port, *argv]), ChildCommands(python="py"),
                       gpus=["0", "1", "2"])  # the built-in SmolLM2: 9 heads, 3 KV heads
        assert up_main(["--port", port, *argv], commands=ChildCommands(python="py"),
                       gpus=["0", "1", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"pdserve up: error: {flag}: "), err
    bad = _model_dir(tmp_path, heads=4, kv_heads=4, vocab=63)
    with pytest.raises(LaunchError, match="vocabulary of 63 tokens"):
        build_plan(parse_args(["--port", port, "--decode-tp", "2", bad]),
                   ChildCommands(python="py"), gpus=["0", "1", "2"])
    good = _model_dir(tmp_path, heads=4, kv_heads=1)  # one KV head replicated over 2 ranks
    build_plan(parse_args(["--port", port, "--prefill-tp", "2", "--decode-tp", "2", good]),
               ChildCommands(python="py"), gpus=["0", "1", "2", "3"])


@pytest.mark.slow
@pytest.mark.parametrize("converted", [True, False], ids=["converted", "gguf-metadata"])
def test_the_launchers_split_check_does_not_import_torch(tmp_path, converted):
    """The built-in model's numbers come from its converted config.json, or before the one-time
    conversion (an empty cache directory) from its packaged GGUF's metadata; neither imports
    torch, and nothing is converted."""
    code = ("import sys; from pdserve.model_files.tp_precheck import split_numbers; "
            "n = split_numbers('smollm2-135m-instruct'); "
            "assert (n.num_heads, n.num_kv_heads, n.vocab_size) == (9, 3, 49152), n; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    if not converted:
        env["PDSERVE_CACHE_DIR"] = str(tmp_path)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert converted or list(tmp_path.iterdir()) == []


def test_serve_refuses_a_tp_size_the_model_does_not_split_over_before_starting(capsys):
    from pdserve.entrypoints.server import main as serve_main

    assert serve_main(["-tp", "2", "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("pdserve serve: error: the model cannot run with "
                             "tensor_parallel_size 2: 9 attention heads"), err
