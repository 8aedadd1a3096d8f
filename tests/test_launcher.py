"""Unit tests of ``pdserve up`` (pdserve/launcher/) with fake child processes.

The fakes are tiny HTTP servers (``FAKE_CHILD`` below) that answer ``/health``, record the signals
they receive, and can be told to die, ignore SIGTERM, never become healthy or spawn a grandchild.
``FakeCommands`` replaces the real ``pdserve serve`` / ``pdserve proxy`` command lines, so the
real port allocation, environment, supervision and shutdown code runs unchanged.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pdserve import launcher
from pdserve.launcher import (
    ChildCommands,
    LaunchError,
    allocate_free_ports,
    assign_gpus,
    build_plan,
    kv_transfer_config,
    parse_args,
)

FAKE_CHILD = r"""
import argparse, http.server, json, os, signal, subprocess, sys, time, threading
HELPER = '''
import os, signal, time
signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.signal(signal.SIGINT, signal.SIG_IGN)
parent = os.getppid()
while os.getppid() == parent:
    time.sleep(0.05)
time.sleep(0.3)
'''
p = argparse.ArgumentParser()
p.add_argument("--name"); p.add_argument("--port", type=int); p.add_argument("--record")
p.add_argument("--exit-after", type=float); p.add_argument("--exit-code", type=int, default=3)
p.add_argument("--ignore-term", action="store_true"); p.add_argument("--never-healthy", action="store_true")
p.add_argument("--grandchild", action="store_true")
p.add_argument("--exit-once", action="store_true")  # --exit-after only in the first start
p.add_argument("--only", default=None)  # the flags above apply only to the child of this name
p.add_argument("--helper", action="store_true")  # like multiprocessing's resource tracker
p.add_argument("--say", action="append", default=[]); p.add_argument("--healthy-after", type=float)
a, rest = p.parse_known_args()
started = time.monotonic()
rec = os.path.join(a.record, a.name)
if a.only is not None and a.only != a.name:
    a.exit_after = None
if a.exit_once and os.path.exists(rec + ".died"):
    a.exit_after = None
def note(what):
    with open(rec + ".events", "a") as f:
        f.write(what + "\n")
with open(rec + ".json", "w") as f:
    json.dump({"pid": os.getpid(), "argv": sys.argv, "env": {k: v for k, v in os.environ.items()
               if k.startswith(("PDSERVE_", "CUDA_"))}}, f)
if a.grandchild:
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    open(rec + ".grandchild", "w").write(str(g.pid))
if a.helper:  # ignores SIGTERM/SIGINT and exits on its own shortly after its parent is gone
    h = subprocess.Popen([sys.executable, "-c", HELPER])
    open(rec + ".helper", "w").write(str(h.pid))
for line in a.say:
    print(line, flush=True)
def on_signal(sig, frame):
    note(signal.Signals(sig).name)
    if not a.ignore_term:
        os._exit(0)
signal.signal(signal.SIGTERM, on_signal); signal.signal(signal.SIGINT, on_signal)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.path == "/health" and not a.never_healthy and (
            a.healthy_after is None or time.monotonic() - started >= a.healthy_after)
        self.send_response(200 if ok else 503); self.end_headers()
    def log_message(self, *args):
        pass
srv = http.server.HTTPServer(("127.0.0.1", a.port), H)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print(f"fake {a.name} listening on {a.port}", flush=True)
if a.exit_after is not None:
    time.sleep(a.exit_after)
    print(f"fake {a.name} dying with code {a.exit_code}", flush=True)
    open(rec + ".died", "a").write("x")
    os._exit(a.exit_code)
while True:
    time.sleep(1)
"""


class FakeCommands(ChildCommands):
    """Child commands that start ``FAKE_CHILD`` instead of real servers.

    Args:
        record_dir: where the fakes write ``<name>.json`` (argv, env), ``<name>.events``
            (signals received) and ``<name>.grandchild`` (PID).
        behaviour: extra fake-child flags per role (``prefill``, ``decode``, ``proxy``).
    """

    def __init__(self, record_dir: Path, behaviour: dict[str, list[str]] | None = None):
        super().__init__()
        self.record_dir = Path(record_dir)
        self.behaviour = behaviour or {}
        self._counts: dict[str, int] = {}

    def _fake(self, role: str, port: int) -> list[str]:
        index = self._counts.get(role, 0)
        self._counts[role] = index + 1
        name = role if role == "proxy" else f"{role}-{index}"
        return [sys.executable, "-c", FAKE_CHILD, "--name", name, "--port", str(port),
                "--record", str(self.record_dir), *self.behaviour.get(role, [])]

    def engine(self, *, model, role, host, port, kv_config, device, engine_args):
        real = super().engine(model=model, role=role, host=host, port=port, kv_config=kv_config,
                              device=device, engine_args=engine_args)
        return self._fake(role, port) + ["--real"] + real[1:]

    def proxy(self, *, host, port, prefillers, decoders, multi_turn, **options):
        real = super().proxy(host=host, port=port, prefillers=prefillers, decoders=decoders,
                             multi_turn=multi_turn, **options)
        return self._fake("proxy", port) + ["--real"] + real[1:]


def _record(record_dir: Path, name: str) -> dict:
    return json.loads((record_dir / f"{name}.json").read_text())


def _events(record_dir: Path, name: str) -> list[str]:
    path = record_dir / f"{name}.events"
    return path.read_text().split() if path.exists() else []


def _alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _status(log_dir: Path) -> dict | None:
    path = log_dir / launcher.STATUS_FILE_NAME
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _signal_when_ready(log_dir: Path, sig: int = signal.SIGTERM) -> threading.Thread:
    """Sends ``sig`` to this process (the in-process launcher) once the status says ready."""

    def run():
        _wait_for(lambda: (_status(log_dir) or {}).get("state") == "ready", what="ready")
        os.kill(os.getpid(), sig)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _proxy_port() -> int:
    return allocate_free_ports(1)[0]


# ------------------------------------------------------------------ argument parsing / plan


def test_parse_args_defaults_and_passthrough():
    opts = parse_args([])
    assert opts.model == "smollm2-135m-instruct"
    assert (opts.num_prefillers, opts.num_decoders, opts.port) == (1, 1, 8000)
    assert not opts.multi_turn and opts.engine_args == []

    opts = parse_args(["--dtype", "float32", "my-model", "--num-decoders", "2",
                       "--max-model-len=512", "--multi-turn", "--", "--enforce-eager", "--x", "1"])
    assert opts.model == "my-model"
    assert opts.num_decoders == 2 and opts.multi_turn
    assert opts.engine_args == ["--dtype", "float32", "--max-model-len=512", "--enforce-eager",
                                "--x", "1"]


def test_parse_args_knows_which_engine_options_take_values():
    opts = parse_args(["--enforce-eager", "my-model", "--dtype", "float16",
                       "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration", "60"])
    assert opts.model == "my-model"
    assert opts.engine_args == ["--enforce-eager", "--dtype", "float16",
                                "--kv-transfer-config.kv_connector_extra_config.kv_lease_duration",
                                "60"]


def test_parse_args_port_lists():
    opts = parse_args(["--prefill-ports", "9001,9002", "--decode-ports", "9003",
                       "--num-prefillers", "2"])
    assert opts.prefill_ports == [9001, 9002] and opts.decode_ports == [9003]
    with pytest.raises(SystemExit):
        parse_args(["--prefill-ports", "abc"])


def test_kv_transfer_config_roles():
    assert kv_transfer_config("kv_producer", False) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_producer"}
    both = kv_transfer_config("kv_consumer", True)
    assert both["kv_role"] == "kv_consumer"
    assert both["kv_connector_extra_config"] == {"bidirectional_kv_xfer": True}


def _plan(argv, gpus=()):
    return build_plan(parse_args(argv), ChildCommands(python="py"), gpus=list(gpus))


def test_plan_ports_are_free_and_distinct():
    proxy_port = _proxy_port()
    specs = _plan(["--num-prefillers", "2", "--num-decoders", "3", "--port", str(proxy_port)])
    assert [s.name for s in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1",
                                       "decode-2", "proxy"]
    ports = [s.port for s in specs] + [s.side_channel_port for s in specs[:-1]]
    assert len(set(ports)) == len(ports) == 11
    assert specs[-1].port == proxy_port
    for spec in specs[:-1]:
        assert spec.env["PDSERVE_NIXL_SIDE_CHANNEL_PORT"] == str(spec.side_channel_port)
        assert spec.env["PDSERVE_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
        launcher.ensure_port_free("127.0.0.1", spec.port, "test")


def test_plan_engine_and_proxy_commands():
    specs = _plan(["tiny", "--multi-turn", "--device", "cpu", "--port", str(_proxy_port()),
                   "--", "--dtype", "float32"])
    prefill, decode, proxy = specs
    assert prefill.argv[:5] == ["py", "-m", "pdserve.cli", "serve", "tiny"]
    for spec, role in ((prefill, "kv_producer"), (decode, "kv_consumer")):
        argv = spec.argv
        cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
        assert cfg["kv_role"] == role and cfg["kv_connector"] == "NixlConnector"
        assert cfg["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        assert argv[argv.index("--port") + 1] == str(spec.port)
        assert argv[argv.index("--device") + 1] == "cpu"
        assert argv[-2:] == ["--dtype", "float32"]
    argv = proxy.argv
    assert argv[:4] == ["py", "-m", "pdserve.cli", "proxy"]
    assert argv[argv.index("--prefiller-ports") + 1] == str(prefill.port)
    assert argv[argv.index("--decoder-ports") + 1] == str(decode.port)
    assert "--multi-turn" in argv
    assert argv[argv.index("--migration-limit") + 1] == "3"


def test_plan_passes_the_api_key_to_the_proxy():
    *_, proxy = _plan(["--port", str(_proxy_port()), "--", "--api-key=sk-1"])
    assert proxy.argv[-2:] == ["--api-key", "sk-1"]


def test_plan_without_multi_turn_has_no_bidirectional():
    prefill, _, proxy = _plan(["--port", str(_proxy_port())], gpus=["0", "1"])
    cfg = json.loads(prefill.argv[prefill.argv.index("--kv-transfer-config") + 1])
    assert "kv_connector_extra_config" not in cfg
    assert "--multi-turn" not in proxy.argv


def test_plan_turns_nixl_progress_thread_off_for_engines_without_gpu():
    # the thread keeps a core busy; a CPU-only host needs its cores for the engines
    for gpus in ([], ["0", "1"]):
        prefill, decode, _ = _plan(["--port", str(_proxy_port())], gpus=gpus)
        for spec in (prefill, decode):
            cfg = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
            extra = cfg.get("kv_connector_extra_config", {})
            if gpus:
                assert "nixl_progress_thread" not in extra  # the default: on
            else:
                assert extra == {"nixl_progress_thread": False}
    assert kv_transfer_config("kv_consumer", True, progress_thread=False) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "nixl_progress_thread": False}}


def test_plan_given_ports_are_used_and_checked():
    p, d, s1, s2, proxy = allocate_free_ports(5)
    specs = _plan(["--port", str(proxy), "--prefill-ports", str(p), "--decode-ports", str(d),
                   "--prefill-side-channel-ports", str(s1), "--decode-side-channel-ports", str(s2)])
    assert [(s.port, s.side_channel_port) for s in specs] == [(p, s1), (d, s2), (proxy, None)]

    with pytest.raises(LaunchError, match="needs 2 port"):
        _plan(["--num-prefillers", "2", "--prefill-ports", str(p), "--port", str(proxy)])
    with pytest.raises(LaunchError, match="given twice"):
        _plan(["--prefill-ports", str(p), "--decode-ports", str(p), "--port", str(proxy)])
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(LaunchError, match="not free"):
            _plan(["--port", str(busy.getsockname()[1])])


def test_plan_rejects_options_the_launcher_owns():
    with pytest.raises(LaunchError, match="kv-transfer-config"):
        _plan(["--port", str(_proxy_port()), "--", "--kv-transfer-config", "{}"])
    with pytest.raises(LaunchError, match="kv_role and kv_connector"):
        _plan(["--port", str(_proxy_port()), "--", "--kv-transfer-config.kv_role", "kv_both"])
    with pytest.raises(LaunchError, match="--host/--port"):
        _plan(["--port", str(_proxy_port()), "--", "--port", "1234"])
    with pytest.raises(LaunchError, match="at least 1"):
        _plan(["--port", str(_proxy_port()), "--num-decoders", "0"])


def test_assign_gpus_separates_prefill_and_decode():
    assert assign_gpus(1, 1, []) == ([None], [None])
    assert assign_gpus(1, 1, ["0"]) == (["0"], ["0"])
    assert assign_gpus(1, 1, ["0", "1"]) == (["0"], ["1"])
    assert assign_gpus(2, 2, ["0", "1"]) == (["0", "0"], ["1", "1"])
    assert assign_gpus(1, 3, ["0", "1", "2", "3"]) == (["0"], ["1", "2", "3"])
    assert assign_gpus(2, 2, ["a", "b", "c", "d"]) == (["a", "b"], ["c", "d"])
    p, d = assign_gpus(3, 1, ["0", "1"])
    assert set(p).isdisjoint(d)


def test_plan_sets_cuda_visible_devices():
    port = str(_proxy_port())
    prefill, decode, proxy = _plan(["--port", port], gpus=["2", "5"])
    assert (prefill.env["CUDA_VISIBLE_DEVICES"], decode.env["CUDA_VISIBLE_DEVICES"]) == ("2", "5")
    assert "--gpu-memory-utilization" not in prefill.argv
    assert proxy.env["CUDA_VISIBLE_DEVICES"] == ""
    # one GPU shared by P and D: each engine gets half of the memory budget
    prefill, decode, _ = _plan(["--port", port], gpus=["0"])
    for spec in (prefill, decode):
        assert spec.env["CUDA_VISIBLE_DEVICES"] == "0"
        assert float(spec.argv[spec.argv.index("--gpu-memory-utilization") + 1]) == pytest.approx(
            launcher.SHARED_GPU_MEMORY_FRACTION / 2)
    # a given --gpu-memory-utilization is split too (each engine's flag is its own share)
    prefill, decode, _ = _plan(["--port", port, "--", "--gpu-memory-utilization", "0.8"],
                               gpus=["0"])
    for spec in (prefill, decode):
        assert float(spec.argv[len(spec.argv) - 1 - spec.argv[::-1].index(
            "--gpu-memory-utilization") + 1]) == pytest.approx(0.4)
        assert spec.gpu_memory_share == pytest.approx(0.4)
    # --kv-cache-memory sizes the cache instead: nothing to split
    prefill, _, _ = _plan(["--port", port, "--", "--kv-cache-memory", "1000000"], gpus=["0"])
    assert "--gpu-memory-utilization" not in prefill.argv and prefill.gpu_memory_share is None
    with pytest.raises(LaunchError, match="must be a number"):
        _plan(["--port", port, "--", "--gpu-memory-utilization", "lots"], gpus=["0"])
    # --device cpu: no GPU at all
    prefill, decode, _ = _plan(["--port", port, "--device", "cpu"], gpus=["0", "1"])
    assert "CUDA_VISIBLE_DEVICES" not in prefill.env and prefill.gpu is None


def test_detect_gpus_honours_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1,-1,2")
    assert launcher.detect_gpus() == ["3", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert launcher.detect_gpus() == []


def test_main_reports_bad_ports(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = launcher.main(["--port", str(busy.getsockname()[1])], gpus=[])
    assert rc == 2
    assert "not free" in capsys.readouterr().err


@pytest.mark.parametrize("engine_args", [["--piecewise-cuda-graph-max-tokens", "-1"],
                                         ["--max-num-seqs", "abc"], ["--no-such-option"],
                                         ["--kv-offloading-size", "1",
                                          "--kv-offloading-backend", "foo"],
                                         ["--kv-offloading-size", "1", "--kv-offloading-disk-size",
                                          "1", "--kv-offloading-disk-dir", "/dev/null/x"]])
def test_bad_engine_options_stop_before_anything_starts(engine_args, tmp_path, capsys):
    """An engine option ``pdserve serve`` would refuse is an error of ``pdserve up`` (exit code
    2, one usage line and the error), before any child starts."""
    cmds = FakeCommands(tmp_path)
    rc = launcher.main(["--log-dir", str(tmp_path / "logs"), "--", *engine_args],
                       commands=cmds, gpus=[])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == "usage: pdserve up [options] (see pdserve up --help)", err
    assert err[1].startswith("pdserve up: error: engine option: ") and len(err) == 2, err
    assert not (tmp_path / "logs").exists()  # nothing was started
    assert launcher.engine_args_error("m", ["--piecewise-cuda-graph-max-tokens", "0",
                                            "--kv-transfer-config.kv_connector_extra_config"
                                            ".kv_lease_duration", "60"]) is None


# ------------------------------------------------------------------ supervising fake children


@pytest.mark.slow
def test_sigterm_is_forwarded_to_every_child(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path)
    thread = _signal_when_ready(log_dir)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()), "--num-decoders",
                        "2", "--", "--dtype", "float32"], commands=cmds, gpus=[])
    thread.join(5)
    assert rc == 0
    out = capsys.readouterr().out
    assert "pdserve is up" in out and "from openai import OpenAI" in out and "curl" in out
    status = _status(log_dir)
    assert status["state"] == "stopped"
    names = [c["name"] for c in status["children"]]
    assert names == ["prefill-0", "decode-0", "decode-1", "proxy"]
    assert {c["state"] for c in status["children"]} == {"stopped"}
    for child in status["children"]:
        assert _events(tmp_path, child["name"]) == ["SIGTERM"]
        assert not _alive(child["pid"])
        assert Path(child["log"]).read_text().count(f"fake {child['name']} listening") == 1
    # the real engine options reached the (fake) engine, and its side-channel port is its own
    record = _record(tmp_path, "decode-1")
    assert record["argv"][-2:] == ["--dtype", "float32"]
    side = [c for c in status["children"] if c["name"] == "decode-1"][0]["side_channel_port"]
    assert record["env"]["PDSERVE_NIXL_SIDE_CHANNEL_PORT"] == str(side)


@pytest.mark.slow
def test_ctrl_c_is_forwarded_as_sigint(tmp_path):
    log_dir = tmp_path / "logs"
    thread = _signal_when_ready(log_dir, signal.SIGINT)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())],
                       commands=FakeCommands(tmp_path), gpus=[])
    thread.join(5)
    assert rc == 0
    for name in ("prefill-0", "decode-0", "proxy"):
        assert _events(tmp_path, name) == ["SIGINT"]


@pytest.mark.slow
def test_child_death_stops_the_rest_and_prints_its_log(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--exit-after", "1.0", "--exit-code", "7"]})
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())], commands=cmds,
                       gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "decode-0" in out and "exited with code 7" in out
    assert "fake decode-0 dying with code 7" in out  # the child's last log lines
    for name in ("prefill-0", "proxy"):
        assert _events(tmp_path, name) == ["SIGTERM"]
    for child in _status(log_dir)["children"]:
        assert not _alive(child["pid"])


@pytest.mark.slow
def test_child_ignoring_sigterm_is_killed(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"prefill": ["--ignore-term"]})
    thread = _signal_when_ready(log_dir)
    t0 = time.monotonic()
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--shutdown-timeout", "1"], commands=cmds, gpus=[])
    thread.join(5)
    assert rc == 0 and time.monotonic() - t0 < 30
    assert _events(tmp_path, "prefill-0") == ["SIGTERM"]  # got it, ignored it, was killed
    assert "killed (no exit after 1 s): prefill-0" in capsys.readouterr().out
    for child in _status(log_dir)["children"]:
        assert not _alive(child["pid"])


def _short_leftover_wait(monkeypatch) -> None:
    """Processes left in a stopped child's group are looked for after 0.5 s instead of
    :data:`~pdserve.launcher.supervisor.LEFTOVER_EXIT_S` (the fakes' leftovers never exit)."""
    from pdserve.launcher import supervisor

    monkeypatch.setattr(supervisor, "LEFTOVER_EXIT_S", 0.5)


@pytest.mark.slow
def test_grandchildren_are_stopped_with_their_parent(tmp_path, monkeypatch):
    _short_leftover_wait(monkeypatch)
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--grandchild"]})
    thread = _signal_when_ready(log_dir)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())], commands=cmds,
                       gpus=[])
    thread.join(5)
    assert rc == 0
    grandchild = int((tmp_path / "decode-0.grandchild").read_text())
    assert not _alive(grandchild)


@pytest.mark.slow
def test_startup_timeout_fails_and_cleans_up(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"proxy": ["--never-healthy"]})
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--startup-timeout", "2"], commands=cmds, gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "not ready after 2 s: proxy" in out and "fake proxy listening" in out
    status = _status(log_dir)
    assert status["state"] == "stopped"
    for child in status["children"]:
        assert not _alive(child["pid"])


_LAUNCHER_SUBPROCESS = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("fake_launcher_test", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
from pdserve.launcher import main
sys.exit(main(sys.argv[3:], commands=mod.FakeCommands(sys.argv[2]), gpus=[]))
"""


@pytest.mark.slow
def test_children_die_when_the_launcher_is_sigkilled(tmp_path):
    log_dir = tmp_path / "logs"
    proc = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER_SUBPROCESS, __file__, str(tmp_path), "--log-dir",
         str(log_dir), "--port", str(_proxy_port())],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_for(lambda: (_status(log_dir) or {}).get("state") == "ready" or
                  proc.poll() is not None, what="launcher ready")
        assert proc.poll() is None
        pids = [c["pid"] for c in _status(log_dir)["children"]]
        assert all(_alive(pid) for pid in pids)
        proc.kill()
        proc.wait()
        _wait_for(lambda: not any(_alive(pid) for pid in pids), timeout=10,
                  what="children to die with the launcher")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for child in (_status(log_dir) or {}).get("children", []):
            if child["pid"] and _alive(child["pid"]):
                os.kill(child["pid"], signal.SIGKILL)


class _UnstartableProxy(FakeCommands):
    def proxy(self, **kwargs):
        return [str(Path(self.record_dir) / "no-such-program")]


@pytest.mark.slow
def test_unstartable_child_is_a_clear_error(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())],
                       commands=_UnstartableProxy(tmp_path), gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "error: cannot start proxy" in out
    assert "killed" not in out, out  # the proxy never ran: nothing to wait out, nothing killed
    engines = [c for c in _status(log_dir)["children"] if c["role"] != "proxy"]
    assert len(engines) == 2
    for child in engines:  # started before the proxy failed, then stopped
        assert child["pid"] is not None and not _alive(child["pid"])


@pytest.mark.slow
def test_ctrl_c_reports_nothing_left_behind_when_helpers_exit_by_themselves(tmp_path, capsys):
    # a server's helper process (multiprocessing's resource tracker) ignores SIGTERM and exits
    # on its own a moment after the server: nothing was left behind
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--helper"]})
    thread = _signal_when_ready(log_dir, signal.SIGINT)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())], commands=cmds,
                       gpus=[])
    thread.join(5)
    assert rc == 0
    out = capsys.readouterr().out
    assert "left behind" not in out, out
    assert not _alive(int((tmp_path / "decode-0.helper").read_text()))


@pytest.mark.slow
def test_processes_really_left_behind_are_reported(tmp_path, capsys, monkeypatch):
    _short_leftover_wait(monkeypatch)
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--grandchild"]})
    thread = _signal_when_ready(log_dir, signal.SIGINT)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())], commands=cmds,
                       gpus=[])
    thread.join(5)
    assert rc == 0
    assert "stopped processes left behind by decode-0" in capsys.readouterr().out
    assert not _alive(int((tmp_path / "decode-0.grandchild").read_text()))


@pytest.mark.slow
def test_progress_says_when_the_model_is_being_converted(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    converting = ("INFO [engine-core] pdserve.model: converting /x/SmolLM2.gguf to safetensors in "
                  "/cache/smollm2-135m-instruct (one time)")
    cmds = FakeCommands(tmp_path, {"prefill": ["--say", converting, "--healthy-after", "2"]})
    thread = _signal_when_ready(log_dir)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port())], commands=cmds,
                       gpus=[])
    thread.join(5)
    assert rc == 0
    out = capsys.readouterr().out
    assert "prefill-0: converting the built-in model to safetensors (one time" in out, out
    assert out.count("converting the built-in model") == 1  # said once, not on every poll


@pytest.mark.slow
def test_banner_python_example_runs_as_pasted(tmp_path):
    banner = launcher.usage_banner("http://127.0.0.1:8000", "m", python="/venv/bin/python",
                                   openai_installed=True)
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if "<<'EOF'" in line)
    assert "virtual environment" in lines[start - 1] and "openai" in lines[start - 1]
    assert lines[start].split()[0] == "/venv/bin/python"
    end = lines.index("EOF", start)  # the here-document ends: its delimiter starts the line
    compile("\n".join(lines[start + 1:end]), "example", "exec")  # no indentation error
    script = tmp_path / "example.sh"
    script.write_text("\n".join(lines[start:end + 1]) + "\n")
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0 and not check.stderr, check.stderr
    missing = launcher.usage_banner("http://127.0.0.1:8000", "m", openai_installed=False)
    assert "pip install openai" in missing


def test_multi_turn_banner_examples_send_a_conversation_id():
    # The multi-turn proxy keeps a turn's KV on the decoder only for a request that names its
    # conversation; the stateless examples name none.
    multi = launcher.usage_banner("http://127.0.0.1:8000", "m", openai_installed=True,
                                  multi_turn=True)
    curl = next(line for line in multi.splitlines() if line.strip().startswith("-d '"))
    body = json.loads(curl.strip()[len("-d '"):-1])
    assert body["conversation_id"] == "demo-1"
    assert 'extra_body={"conversation_id": "demo-1"}' in multi
    stateless = launcher.usage_banner("http://127.0.0.1:8000", "m", openai_installed=True)
    assert "conversation_id" not in stateless
    compile_example = multi.split("<<'EOF'\n", 1)[1].split("\nEOF", 1)[0]
    compile(compile_example, "example", "exec")
def test_plan_turns_kv_events_on_with_distinct_ports():
    specs = _plan(["--num-prefillers", "2", "--num-decoders", "2", "--port", str(_proxy_port()),
                   "--", "--dtype", "float32"])
    endpoints = []
    for spec in specs[:-1]:
        argv = spec.argv
        endpoints += [argv[argv.index("--kv-events-endpoint") + 1],
                      argv[argv.index("--kv-events-snapshot-endpoint") + 1]]
        assert argv[-2:] == ["--dtype", "float32"]
    ports = [int(e.rpartition(":")[2]) for e in endpoints]
    others = [s.port for s in specs] + [s.side_channel_port for s in specs[:-1]]
    assert len(set(ports)) == 8 and not set(ports) & set(others)
    given = _plan(["--port", str(_proxy_port()), "--", "--kv-events-endpoint", "tcp://*:7000"])
    assert given[0].argv.count("--kv-events-endpoint") == 1


def test_plan_with_data_parallel_engines():
    specs = _plan(["--num-prefillers", "1", "--num-decoders", "2", "--prefill-dp", "2",
                   "--decode-dp", "3", "--port", str(_proxy_port())],
                  gpus=["0", "1", "2", "3", "4", "5", "6", "7"])
    prefill, d0, d1, proxy = specs
    assert prefill.argv[prefill.argv.index("--data-parallel-size") + 1] == "2"
    assert (prefill.data_parallel_size, d0.data_parallel_size, proxy.data_parallel_size) == (2, 3, 1)
    assert d0.argv[d0.argv.index("--data-parallel-size") + 1] == "3"
    # every rank has its own side-channel port base + r, all free and distinct
    side = [s.side_channel_port + r for s, n in ((prefill, 2), (d0, 3), (d1, 3)) for r in range(n)]
    assert len(set(side)) == 8
    assert not set(side) & {s.port for s in specs}
    for port in side:
        launcher.ensure_port_free("127.0.0.1", port, "test")
    # each rank is placed like an engine: P's two ranks on two GPUs, D's ranks on the rest
    assert prefill.env["CUDA_VISIBLE_DEVICES"] == "0,1"
    d_gpus = d0.env["CUDA_VISIBLE_DEVICES"].split(",") + d1.env["CUDA_VISIBLE_DEVICES"].split(",")
    assert set(d_gpus) <= {"2", "3", "4", "5", "6", "7"} and len(d_gpus) >= 4
    # an instance with several ranks publishes no KV events (one endpoint per instance)
    assert "--kv-events-endpoint" not in prefill.argv
    assert proxy.argv[proxy.argv.index("--prefiller-ports") + 1] == str(prefill.port)
    with pytest.raises(LaunchError, match="--prefill-dp"):
        _plan(["--port", str(_proxy_port()), "--prefill-dp", "0"])
    from tests.support.ports import free_consecutive_ports  # (the launcher subprocesses import this module)

    base = free_consecutive_ports(2)  # the proxy takes base + 1, rank 1's side channel too
    with pytest.raises(LaunchError, match="data-parallel rank"):
        _plan(["--port", str(base + 1), "--prefill-dp", "2",
               "--prefill-side-channel-ports", str(base)])


def _exit_code(call) -> int:
    try:
        return call()
    except SystemExit as e:  # argparse's errors exit (the console script's exit code)
        return e.code


def test_a_negative_count_says_it_must_be_a_positive_integer(capsys):
    """``--decode-dp -1`` is a value, not an option: the error names the option and says the
    value must be a positive integer (it said "expected one argument")."""
    for argv in (["--decode-dp", "-1"], ["--num-prefillers", "-2"], ["--prefill-dp", "0"],
                 ["--prefill-tp", "-1"]):
        assert _exit_code(lambda: launcher.main(argv, gpus=[])) == 2
        err = capsys.readouterr().err
        assert argv[0] in err and "positive integer" in err, err
        assert "expected one argument" not in err


@pytest.mark.parametrize("argv", [["serve", "--bogus"], ["proxy", "--bogus"],
                                  ["up", "--port", "x"], ["chat", "--bogus"],
                                  ["bench", "multi-turn", "--bogus"]],
                         ids=lambda argv: argv[0])
def test_argument_errors_print_one_short_usage_line(argv, capsys):
    """Every subcommand: an argument error prints ``usage: pdserve X [options] (see pdserve X
    --help)`` and the error, not the whole usage block; exit code 2."""
    from pdserve.cli import main as pdserve_main

    assert _exit_code(lambda: pdserve_main(argv)) == 2
    prog = "pdserve " + " ".join(a for a in argv if not a.startswith("-") and a != "x")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and err[0] == f"usage: {prog} [options] (see {prog} --help)", err
    assert err[1].startswith(f"{prog}: error: "), err


# ------------------------------------------------------------------ restarts of dead instances


@pytest.mark.slow
def test_dead_decoder_is_restarted_on_its_ports_while_the_other_serves(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--exit-after", "0.5", "--exit-once",
                                              "--only", "decode-1", "--exit-code", "9"]})
    seen: dict = {}

    def watch():  # the launcher runs in this (main) thread, which gets its signals
        _wait_for(lambda: (_status(log_dir) or {}).get("state") == "ready", what="ready")
        seen["first"] = {c["name"]: c for c in _status(log_dir)["children"]}
        _wait_for(lambda: any(c["restarts"] == 1 and c["state"] == "serving"
                              for c in (_status(log_dir) or {}).get("children", [])),
                  what="decode-1 serving again")
        seen["now"] = _status(log_dir)
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--num-decoders", "2"], commands=cmds, gpus=[])
    thread.join(5)
    assert rc == 0
    out = capsys.readouterr().out
    assert "decode-1 (pid" in out and "exited with code 9; restarting it in 1 s" in out
    assert "restart 1 of 3 within 300 s" in out and "decode-0 keeps serving" in out
    assert "decode-1 is serving again" in out
    first, status = seen["first"], seen["now"]
    assert status["state"] == "ready"
    now = {c["name"]: c for c in status["children"]}
    assert now["decode-1"]["pid"] != first["decode-1"]["pid"]
    assert now["decode-1"]["port"] == first["decode-1"]["port"]
    assert now["decode-1"]["side_channel_port"] == first["decode-1"]["side_channel_port"]
    for name in ("prefill-0", "decode-0", "proxy"):
        assert now[name]["pid"] == first[name]["pid"] and now[name]["restarts"] == 0
    log = Path(now["decode-1"]["log"]).read_text()
    assert log.count("fake decode-1 listening") == 2 and "[pdserve up] decode-1 (pid" in log
    assert _events(tmp_path, "decode-1") == ["SIGTERM"]  # the restarted one is stopped too
    assert not _alive(now["decode-1"]["pid"])


@pytest.mark.slow
def test_an_instance_that_keeps_dying_stops_the_deployment(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"prefill": ["--exit-after", "0.5", "--only", "prefill-1",
                                               "--exit-code", "4"]})
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--num-prefillers", "2", "--restart-limit", "1"], commands=cmds, gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "restarting it in 1 s (restart 1 of 1 within 300 s)" in out
    assert "it died 2 times within 300 s (restart limit 1); stopping the others." in out
    assert "fake prefill-1 dying with code 4" in out  # its last log lines
    for child in _status(log_dir)["children"]:
        assert not _alive(child["pid"])


@pytest.mark.slow
def test_a_role_without_live_instances_stops_the_deployment(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--exit-after", "0.6"]})
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--num-decoders", "2"], commands=cmds, gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "no other decode instance is serving; stopping the others." in out
    assert _events(tmp_path, "prefill-0") == ["SIGTERM"]


@pytest.mark.slow
def test_restart_limit_zero_keeps_the_old_stop_everything_behaviour(tmp_path, capsys):
    log_dir = tmp_path / "logs"
    cmds = FakeCommands(tmp_path, {"decode": ["--exit-after", "0.5", "--only", "decode-1"]})
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()),
                        "--num-decoders", "2", "--restart-limit", "0"], commands=cmds, gpus=[])
    assert rc == 1
    out = capsys.readouterr().out
    assert "restarting" not in out and "decode-1 (pid" in out


@pytest.mark.parametrize("argv, needle", [
    (["--startup-timeout", "nan"], "finite"), (["--startup-timeout", "inf"], "finite"),
    (["--startup-timeout", "0"], "must be > 0"), (["--shutdown-timeout", "-1"], "must be >= 0"),
    (["--shutdown-timeout", "nan"], "finite"), (["--restart-window", "nan"], "finite"),
])
def test_timeouts_must_be_finite_and_not_negative(argv, needle, capsys):
    """Seconds options: ``nan`` never timed out and ``-1`` was taken as given."""
    assert _exit_code(lambda: launcher.cli.parse_args(argv)) == 2
    err = capsys.readouterr().err
    assert argv[0] in err and needle in err, err


def test_a_log_dir_that_is_a_file_exits_2(tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("")
    assert _exit_code(lambda: launcher.cli.parse_args(["--log-dir", str(afile)])) == 2
    err = capsys.readouterr().err
    assert "--log-dir" in err and "is not a directory" in err and "Traceback" not in err
    opts = launcher.cli.parse_args(["--log-dir", str(tmp_path / "new" / "logs")])
    assert opts.log_dir == tmp_path / "new" / "logs" and not (tmp_path / "new").exists()


@pytest.mark.parametrize("argv", [["--kv-offloading-size", "inf"],
                                  ["--kv-offloading-size", "1", "--kv-offloading-disk-dir", "d",
                                   "--kv-offloading-disk-size", "inf"]])
def test_engine_option_inf_is_refused_up_front(argv):
    """``pdserve up`` checks engine options with the ``pdserve serve`` parser: ``inf`` GiB
    (an OverflowError traceback at start-up) is an argument error."""
    error = launcher.cli.engine_args_error("gemma3-270m", argv)
    assert error is not None and "finite" in error


def test_restart_backoff_doubles_up_to_its_cap():
    from pdserve.launcher.restarts import RestartPolicy

    policy = RestartPolicy(initial_backoff_s=1, max_backoff_s=5)
    assert [policy.backoff(n) for n in range(1, 6)] == [1, 2, 4, 5, 5]


def test_main_refuses_a_negative_restart_limit(capsys):
    assert launcher.main(["--restart-limit", "-1"], commands=FakeCommands(Path("/nonexistent")),
                         gpus=[]) == 2
    assert "--restart-limit" in capsys.readouterr().err


class _FakeProc:
    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None

    def poll(self):
        return self.returncode


class _FakeChild(launcher.Child):
    """A Child whose process is a stand-in: ``die(code)`` ends it, ``start()`` makes a new one."""

    next_pid = 1000

    def start(self) -> None:
        _FakeChild.next_pid += 1
        self.proc = _FakeProc(_FakeChild.next_pid)
        self.starts += 1

    def die(self, code: int) -> None:
        self.proc.returncode = code

    def signal_group(self, sig: int) -> None:
        self.group_signals = [*getattr(self, "group_signals", []), sig]


def _restarter(tmp_path, policy, healthy: set[str]):
    """A Restarter over fake decode-0, decode-1 and proxy, with a clock the test moves."""
    from pdserve.launcher.plan import ChildSpec
    from pdserve.launcher import restarts

    specs = [ChildSpec("decode-0", "decode", ["x"], port=1, side_channel_port=11),
             ChildSpec("decode-1", "decode", ["x"], port=2, side_channel_port=12),
             ChildSpec("proxy", "proxy", ["x"], port=3)]
    children = [_FakeChild(s, tmp_path / f"{s.name}.log") for s in specs]
    for c in children:
        c.start()
        c.ready = True
    clock = [100.0]
    lines: list[str] = []
    changes: list[int] = []
    r = restarts.Restarter(children, policy, health_check=lambda url: url in healthy,
                           say=lines.append, on_change=lambda: changes.append(1),
                           clock=lambda: clock[0])
    return r, children, clock, lines, changes


def test_restarter_backs_off_waits_for_ports_and_counts_deaths(tmp_path, monkeypatch):
    from pdserve.launcher import restarts
    from pdserve.launcher.restarts import InstanceState, RestartPolicy

    busy = {2}
    monkeypatch.setattr(restarts, "ports_free", lambda host, ports: not busy & set(ports))
    healthy: set[str] = set()
    policy = RestartPolicy(max_restarts=2, window_s=60, initial_backoff_s=1, port_wait_s=10,
                           startup_timeout_s=30)
    r, (d0, d1, proxy), clock, lines, changes = _restarter(tmp_path, policy, healthy)
    assert r.poll() is None
    d1.die(-9)
    first_pid = d1.pid
    assert r.poll() is None and r.state(d1) is InstanceState.BACKING_OFF
    assert d1.group_signals == [signal.SIGKILL]  # its engine cores go with it
    assert "restarting it in 1 s (restart 1 of 2 within 60 s); decode-0 keeps serving" in lines[-1]
    assert "[pdserve up] decode-1 (pid" in (tmp_path / "decode-1.log").read_text()
    clock[0] += 0.5
    assert r.poll() is None and d1.pid == first_pid  # still backing off
    clock[0] += 1
    assert r.poll() is None and d1.pid == first_pid and "waiting for its ports 2, 12" in lines[-1]
    busy.clear()
    clock[0] += 1
    assert r.poll() is None and d1.pid != first_pid and r.state(d1) is InstanceState.RESTARTING
    assert d1.starts == 2 and not d1.ready
    healthy.add(d1.spec.url + "/health")
    clock[0] += 1
    assert r.poll() is None and r.state(d1) is InstanceState.SERVING and d1.ready
    assert "decode-1 is serving again" in lines[-1] and "3.5 s after it died" in lines[-1]
    # second death in the window: twice the back-off; the third is past the limit
    d1.die(1)
    assert r.poll() is None and "restarting it in 2 s (restart 2 of 2" in lines[-1]
    clock[0] += 2
    r.poll()
    clock[0] += 1
    r.poll()
    d1.die(1)
    stop = r.poll()
    assert stop is not None and stop[0] is d1
    assert "died 3 times within 60 s (restart limit 2)" in stop[1]
    assert changes  # the status file was rewritten on every change


def test_restarter_gives_up_on_ports_health_and_the_last_instance(tmp_path, monkeypatch):
    from pdserve.launcher import restarts
    from pdserve.launcher.restarts import RestartPolicy

    policy = RestartPolicy(initial_backoff_s=1, port_wait_s=5, startup_timeout_s=20)
    monkeypatch.setattr(restarts, "ports_free", lambda host, ports: False)
    r, (d0, d1, proxy), clock, lines, _ = _restarter(tmp_path, policy, set())
    d1.die(3)
    r.poll()
    clock[0] += 1
    assert r.poll() is None
    clock[0] += 6
    stop = r.poll()
    assert stop[0] is d1 and "ports 2, 12 are still busy after 5 s" in stop[1]

    monkeypatch.setattr(restarts, "ports_free", lambda host, ports: True)
    r, (d0, d1, proxy), clock, lines, _ = _restarter(tmp_path, policy, set())
    d1.die(3)
    r.poll()
    clock[0] += 1
    r.poll()  # restarted, never healthy
    clock[0] += 21
    stop = r.poll()
    assert stop[0] is d1 and "not healthy 20 s after its restart" in stop[1]

    r, (d0, d1, proxy), clock, lines, _ = _restarter(tmp_path, policy, set())
    d1.die(3)
    r.poll()
    d0.die(3)  # the other decoder dies while decode-1 backs off: no decoder left
    stop = r.poll()
    assert stop[0] is d0 and "no other decode instance is serving" in stop[1]

    r, (d0, d1, proxy), clock, lines, _ = _restarter(tmp_path, policy, set())
    proxy.die(-15)
    stop = r.poll()
    assert stop[0] is proxy and "was killed by SIGTERM" in stop[1]
