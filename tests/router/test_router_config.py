"""`pdserve proxy` flags: host/port pairing, singular/plural forms, defaults and bad input."""

import subprocess
import sys

import pytest

from pdserve.router.config import ProxyConfig, base_url, pair_instances, parse_args


def test_pairs_equal_lists_position_by_position():
    assert pair_instances(["a", "b"], [1, 2], "prefiller") == ("http://a:1", "http://b:2")


def test_single_host_serves_every_port_and_single_port_every_host():
    assert pair_instances(["h"], [1, 2, 3], "decoder") == ("http://h:1", "http://h:2", "http://h:3")
    assert pair_instances(["a", "b"], [9], "decoder") == ("http://a:9", "http://b:9")
    assert pair_instances(None, [5, 6], "decoder") == ("http://127.0.0.1:5", "http://127.0.0.1:6")


@pytest.mark.parametrize("hosts,ports,needle", [
    (["a", "b", "c"], [1, 2], "3 entries but --prefiller-ports has 2"),
    (["a"], [], "at least one prefiller port"),
    (["a", "a"], [1, 1], "duplicate prefiller instance"),
])
def test_pairing_errors(hosts, ports, needle):
    with pytest.raises(ValueError, match=needle):
        pair_instances(hosts, ports, "prefiller")


def test_base_url_accepts_scheme_and_ipv6():
    assert base_url("https://node1/", 443) == "https://node1:443"
    assert base_url("::1", 8100) == "http://[::1]:8100"
    assert base_url("10.0.0.2", 8100) == "http://10.0.0.2:8100"


def test_singular_plural_and_repeated_flags():
    cfg = parse_args(["--prefiller-host", "p1", "--prefiller-port", "8100", "8101",
                      "--decoder-hosts", "d1", "d2", "--decoder-port", "8200", "--decoder-port", "8201"])
    assert cfg.prefillers == ("http://p1:8100", "http://p1:8101")
    assert cfg.decoders == ("http://d1:8200", "http://d2:8201")


def test_defaults():
    cfg = parse_args(["--prefiller-port", "1", "--decoder-port", "2"])
    assert (cfg.host, cfg.port, cfg.routing, cfg.multi_turn) == ("127.0.0.1", 8000, "round-robin", False)
    assert cfg.conversation_ttl == 480.0 and cfg.api_key is None and cfg.upstream_api_key is None
    assert cfg.migration_limit == 0 and cfg.stall_timeout == 30.0  # migration off, as in Dynamo
    assert cfg == ProxyConfig(prefillers=("http://127.0.0.1:1",), decoders=("http://127.0.0.1:2",))


def test_all_flags():
    cfg = parse_args(["--host", "0.0.0.0", "--port", "9000", "--prefiller-port", "1",
                      "--decoder-port", "2", "--routing", "least-loaded", "--multi-turn",
                      "--api-key", "k", "--upstream-api-key", "u", "--max-conversations", "7",
                      "--conversation-ttl", "30", "--timeout", "2.5", "--migration-limit", "3",
                      "--stall-timeout", "4.5"])
    assert cfg == ProxyConfig(host="0.0.0.0", port=9000, prefillers=("http://127.0.0.1:1",),
                              decoders=("http://127.0.0.1:2",), routing="least-loaded",
                              multi_turn=True, api_key="k", upstream_api_key="u",
                              max_conversations=7, conversation_ttl=30.0, timeout=2.5,
                              migration_limit=3, stall_timeout=4.5)


@pytest.mark.parametrize("argv,needle", [
    (["--decoder-port", "2"], "at least one prefiller port"),
    (["--prefiller-port", "1"], "at least one decoder port"),
    (["--prefiller-port", "1", "--decoder-port", "2", "3", "--decoder-hosts", "a", "b", "c"],
     "--decoder-hosts has 3 entries but --decoder-ports has 2"),
    (["--prefiller-port", "70000", "--decoder-port", "2"], "must be 1..65535"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--routing", "random"], "invalid choice"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--conversation-ttl", "0"], "must be > 0"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--max-conversations", "0"], "must be >= 1"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--prefill-port", "3"], "unrecognized"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--migration-limit", "-1"], "must be >= 0"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--stall-timeout", "0"], "must be > 0"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--timeout", "inf"], "finite"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--timeout", "nan"], "finite"),
    (["--prefiller-port", "1", "--decoder-port", "2", "--breaker-backoff", "inf"], "finite"),
])
def test_bad_flags_exit_2_with_message(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.slow
def test_cli_dispatch_does_not_import_torch():
    code = ("import sys; from pdserve.cli import main\n"
            "try:\n    main(['proxy', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
            "assert 'torch' not in sys.modules, 'pdserve proxy imported torch'\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--prefiller-hosts" in out.stdout and "--multi-turn" in out.stdout


def test_failover_flags():
    base = ["--prefiller-ports", "1", "--decoder-ports", "2"]
    c = parse_args(base)
    assert (c.max_retries, c.breaker_failures, c.breaker_backoff, c.enforce_disagg) == (2, 3, 5.0,
                                                                                      False)
    c = parse_args(base + ["--max-retries", "0", "--breaker-failures", "5", "--breaker-backoff",
                           "0.5", "--enforce-disagg"])
    assert (c.max_retries, c.breaker_failures, c.breaker_backoff, c.enforce_disagg) == (0, 5, 0.5,
                                                                                      True)
    for bad in (["--max-retries", "-1"], ["--breaker-backoff", "0"]):
        with pytest.raises(SystemExit):
            parse_args(base + bad)


def test_handoff_flag():
    from pdserve.router.handoff import HandoffMode

    base = ["--prefiller-port", "1", "--decoder-port", "2"]
    assert parse_args(base).handoff is HandoffMode.CONCURRENT
    assert parse_args(base + ["--handoff", "sequential"]).handoff is HandoffMode.SEQUENTIAL
    with pytest.raises(SystemExit):
        parse_args(base + ["--handoff", "pushed"])
