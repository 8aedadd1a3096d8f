"""Command lines of tensor parallelism: ``pdserve serve -tp N`` into EngineConfig, the device
check of N ranks, and ``pdserve up --prefill-tp N --decode-tp M`` (arguments, GPU sets)."""

from __future__ import annotations

import socket

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args
from pdserve.launcher.cli import parse_args
from pdserve.launcher.plan import ChildCommands, LaunchError, build_plan
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
    # DP rank d's TP rank r: base + d * tp + r
    dp = EngineConfig(tensor_parallel_size=2, extra={"data_parallel_rank": 1})
    assert tp_device(torch.device("cuda"), dp, 1) == torch.device("cuda", 3)
    assert tp_device(torch.device("cpu"), cfg, 1) == torch.device("cpu")
    check_tp_devices(cfg, torch.device("cuda"), 2)
    check_tp_devices(EngineConfig(tensor_parallel_size=8), torch.device("cpu"), 0)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs CUDA devices 0\.\.1, "
                                         r"but 1 device\(s\) are present"):
        check_tp_devices(cfg, torch.device("cuda"), 1)
    with pytest.raises(ValueError, match=r"needs CUDA devices 1\.\.2"):
        check_tp_devices(cfg, cuda, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(argv: list[str], gpus: list[str]):
    return build_plan(parse_args(["--port", str(_free_port()), *argv]), ChildCommands(python="py"),
                      gpus=gpus)


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
