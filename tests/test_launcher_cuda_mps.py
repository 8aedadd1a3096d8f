"""``pdserve up --cuda-mps`` (pdserve/launcher/cuda_mps.py) with a stand-in for
``nvidia-cuda-mps-control`` on ``PATH`` that records what it is asked: the daemon is started
with pipe and log directories under the log directory before any engine, every engine (not the
proxy) gets them in its environment, and the daemon is told to quit when the deployment stops;
a missing executable, a daemon that fails, and engines without GPUs are startup errors."""

from __future__ import annotations

import os
import signal
import stat
import sys
from pathlib import Path

import pytest

from pdserve import launcher
from pdserve.launcher.cuda_mps import CONTROL, CudaMps
from pdserve.launcher.errors import LaunchError

from tests.test_launcher import FakeCommands, _proxy_port, _record, _signal_when_ready

pytestmark = pytest.mark.slow  # the stand-in daemon is a process

#: The stand-in daemon: "-d" makes the control pipe (unless FAIL_MPS is set) and returns; a
#: "quit" on stdin is recorded. Every call appends a line to $MPS_RECORD.
FAKE_CONTROL = """#!{python}
import os, sys
record = os.environ["MPS_RECORD"]
pipe = os.environ.get("CUDA_MPS_PIPE_DIRECTORY", "-")
if sys.argv[1:] == ["-d"]:
    if os.environ.get("FAIL_MPS"):
        print("An instance of this daemon is already running", file=sys.stderr)
        sys.exit(1)
    open(os.path.join(pipe, "control"), "w").close()
    what = "start"
else:
    what = sys.stdin.read().strip()
with open(record, "a") as f:
    f.write(f"{{what}} {{pipe}} {{os.environ.get('CUDA_MPS_LOG_DIRECTORY', '-')}}\\n")
"""


@pytest.fixture
def fake_control(tmp_path, monkeypatch) -> Path:
    """Puts the stand-in on PATH; returns the file it records its calls in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / CONTROL
    exe.write_text(FAKE_CONTROL.format(python=os.path.realpath(sys.executable)))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "mps-calls.txt"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("MPS_RECORD", str(record))
    return record


def _calls(record: Path) -> list[list[str]]:
    return [line.split() for line in record.read_text().splitlines()] if record.exists() else []


def test_the_daemon_is_started_in_its_own_directories_and_told_to_quit(tmp_path, fake_control):
    mps = CudaMps(tmp_path / "mps")
    env = mps.start()
    pipe, log = str(tmp_path / "mps" / "pipe"), str(tmp_path / "mps" / "log")
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": pipe, "CUDA_MPS_LOG_DIRECTORY": log}
    assert _calls(fake_control) == [["start", pipe, log]]
    mps.stop()
    mps.stop()  # idempotent
    assert _calls(fake_control) == [["start", pipe, log], ["quit", pipe, log]]


def test_a_failing_daemon_or_a_missing_executable_is_a_launch_error(tmp_path, fake_control,
                                                                    monkeypatch):
    monkeypatch.setenv("FAIL_MPS", "1")
    with pytest.raises(LaunchError, match="exited with 1: An instance of this daemon"):
        CudaMps(tmp_path / "mps").start()
    with pytest.raises(LaunchError, match="no-such-mps-control not found on PATH"):
        CudaMps(tmp_path / "mps", control="no-such-mps-control").start()
    with pytest.raises(LaunchError, match="too long for a Unix socket"):
        CudaMps(tmp_path / ("x" * 120)).start()


def test_up_runs_the_engines_under_the_daemon_and_stops_it(tmp_path, fake_control, capsys):
    log_dir = tmp_path / "logs"
    thread = _signal_when_ready(log_dir, signal.SIGINT)
    rc = launcher.main(["--log-dir", str(log_dir), "--port", str(_proxy_port()), "--cuda-mps"],
                       commands=FakeCommands(tmp_path), gpus=["0"])
    thread.join(5)
    assert rc == 0
    pipe, log = str(log_dir / "cuda-mps" / "pipe"), str(log_dir / "cuda-mps" / "log")
    assert _calls(fake_control) == [["start", pipe, log], ["quit", pipe, log]]
    for name in ("prefill-0", "decode-0"):
        env = _record(tmp_path, name)["env"]
        assert env["CUDA_MPS_PIPE_DIRECTORY"] == pipe and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert "CUDA_MPS_PIPE_DIRECTORY" not in _record(tmp_path, "proxy")["env"]
    assert f"CUDA MPS daemon in {log_dir / 'cuda-mps'}" in capsys.readouterr().out


def test_up_refuses_cuda_mps_without_gpus_or_when_the_daemon_fails(tmp_path, fake_control,
                                                                  monkeypatch, capsys):
    argv = ["--log-dir", str(tmp_path / "logs"), "--port", str(_proxy_port()), "--cuda-mps"]
    assert launcher.main(argv, commands=FakeCommands(tmp_path), gpus=[]) == 2
    assert "--cuda-mps needs engines on GPUs" in capsys.readouterr().err
    monkeypatch.setenv("FAIL_MPS", "1")
    assert launcher.main(argv, commands=FakeCommands(tmp_path), gpus=["0"]) == 2
    assert "pdserve up: error: --cuda-mps: " in capsys.readouterr().err
    assert _calls(fake_control) == []  # nothing was started, nothing to stop
    assert not list(tmp_path.glob("*.json"))  # no child started
