"""``pdserve up --routing POLICY`` (pdserve/launcher/): the planned proxy command line gets
``--routing POLICY`` (and, for ``kv-aware``, the served model as ``--tokenizer``, once even with
``--local-prefill-max-tokens``) and parses as a valid ``pdserve proxy`` command line; the default
passes nothing. Plans only: no process is started."""

from __future__ import annotations

import pytest

from pdserve.launcher import parse_args
from pdserve.router.config import parse_args as parse_proxy_args

from tests.test_launcher_local_prefill import _proxy_argv, _value


@pytest.mark.parametrize("policy", ["least-loaded", "kv-aware"])
def test_the_proxy_gets_the_policy(policy):
    argv = _proxy_argv(["tiny-model", "--routing", policy])
    assert _value(argv, "--routing") == policy
    cfg = parse_proxy_args(argv[4:])
    assert cfg.routing == policy
    if policy == "kv-aware":  # the proxy tokenizes prompts with the served model
        assert _value(argv, "--tokenizer") == "tiny-model"
    else:
        assert "--tokenizer" not in argv


def test_kv_aware_with_local_prefill_passes_the_tokenizer_once():
    argv = _proxy_argv(["tiny-model", "--routing", "kv-aware", "--local-prefill-max-tokens",
                        "64", "--", "--tokenizer", "/models/tok"])
    assert _value(argv, "--tokenizer") == "/models/tok"
    cfg = parse_proxy_args(argv[4:])
    assert (cfg.routing, cfg.local_prefill_max_tokens, cfg.tokenizer) == ("kv-aware", 64,
                                                                          "/models/tok")


def test_the_default_is_round_robin_and_passes_nothing(capsys):
    argv = _proxy_argv(["tiny-model"])
    assert "--routing" not in argv and "--tokenizer" not in argv
    assert parse_proxy_args(argv[4:]).routing == "round-robin"
    with pytest.raises(SystemExit) as e:
        parse_args(["--routing", "nearest"])
    assert e.value.code == 2 and "--routing" in capsys.readouterr().err
