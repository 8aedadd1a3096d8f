"""``pdserve up --local-prefill-max-tokens N`` (pdserve/launcher/): the planned proxy command
line gets ``--local-prefill-max-tokens N --tokenizer MODEL`` (the engines' ``--tokenizer`` when
one is passed to them, else the served model), and parses as a valid ``pdserve proxy`` command
line; without the flag neither option appears. Plans only: no process is started."""

from __future__ import annotations

import pytest

from pdserve.launcher import ChildCommands, allocate_free_ports, build_plan, parse_args
from pdserve.router.config import parse_args as parse_proxy_args


def _plan(argv):
    port = allocate_free_ports(1)[0]
    return build_plan(parse_args(["--port", str(port), *argv]), ChildCommands(python="py"),
                      gpus=[])


def _proxy_argv(argv) -> list[str]:
    *engines, proxy = _plan(argv)
    assert proxy.role == "proxy" and all(s.role != "proxy" for s in engines)
    assert proxy.argv[:4] == ["py", "-m", "pdserve.cli", "proxy"]
    return proxy.argv


def _value(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, argv
    return argv[argv.index(name) + 1]


def test_the_proxy_gets_the_threshold_and_the_served_model_as_tokenizer():
    argv = _proxy_argv(["tiny-model", "--local-prefill-max-tokens", "256"])
    assert _value(argv, "--local-prefill-max-tokens") == "256"
    assert _value(argv, "--tokenizer") == "tiny-model"
    i = argv.index("--local-prefill-max-tokens")
    assert argv[i:i + 4] == ["--local-prefill-max-tokens", "256", "--tokenizer", "tiny-model"]
    # the default model too
    assert _value(_proxy_argv(["--local-prefill-max-tokens", "64"]),
                  "--tokenizer") == "smollm2-135m-instruct"


@pytest.mark.parametrize("engine_args", [["--tokenizer", "/models/tok"],
                                         ["--tokenizer=/models/tok"],
                                         ["--dtype", "float32", "--tokenizer", "/models/tok"]])
def test_the_engines_tokenizer_is_the_proxys(engine_args):
    specs = _plan(["tiny-model", "--local-prefill-max-tokens", "256", "--", *engine_args])
    *engines, proxy = specs
    assert _value(proxy.argv, "--tokenizer") == "/models/tok"
    assert _value(proxy.argv, "--local-prefill-max-tokens") == "256"
    for spec in engines:  # the engines keep theirs
        assert spec.argv[-len(engine_args):] == engine_args
        assert "--local-prefill-max-tokens" not in spec.argv


def test_the_planned_proxy_command_line_parses():
    argv = _proxy_argv(["tiny-model", "--multi-turn", "--local-prefill-max-tokens", "256",
                        "--num-decoders", "2"])
    cfg = parse_proxy_args(argv[4:])
    assert (cfg.local_prefill_max_tokens, cfg.tokenizer, cfg.multi_turn) == (256, "tiny-model",
                                                                             True)
    assert len(cfg.decoders) == 2 and not cfg.enforce_disagg


@pytest.mark.parametrize("argv", [[], ["--local-prefill-max-tokens", "0"],
                                  ["--", "--tokenizer", "/models/tok"]])
def test_without_the_flag_neither_option_is_passed(argv):
    proxy_argv = _proxy_argv(["tiny-model", *argv])
    assert "--local-prefill-max-tokens" not in proxy_argv
    assert "--tokenizer" not in proxy_argv
    assert parse_proxy_args(proxy_argv[4:]).local_prefill_max_tokens == 0


def test_parse_args_default_and_refusal(capsys):
    assert parse_args([]).local_prefill_max_tokens == 0
    assert parse_args(["--local-prefill-max-tokens", "128"]).local_prefill_max_tokens == 128
    with pytest.raises(SystemExit) as e:
        parse_args(["--local-prefill-max-tokens", "-5"])
    assert e.value.code == 2 and "--local-prefill-max-tokens" in capsys.readouterr().err
