"""The engine-core sockets' temp folder: named after its owner, removed when the owner died
(by its engine core, and by the next start-up's sweep), including after ``kill -9`` of
``pdserve serve``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.engine import ipc_dir


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _folder(root: Path, pid: int) -> Path:
    path = root / f"{ipc_dir.PREFIX}{pid}-abc123_x"
    path.mkdir()
    (path / "input-0").write_text("")
    (path / "output-0").write_text("")
    return path


@pytest.mark.slow
def test_create_names_the_owner_and_sweeps_dead_owners(tmp_path):
    dead = _folder(tmp_path, _dead_pid())
    alive = _folder(tmp_path, os.getppid())
    unrelated = tmp_path / f"{ipc_dir.PREFIX}abcdef"  # an older name without a pid: left alone
    unrelated.mkdir()
    made = ipc_dir.create(str(tmp_path))
    assert ipc_dir.owner_pid(made) == os.getpid()
    assert not dead.exists()
    assert alive.exists() and unrelated.exists() and Path(made).is_dir()


def test_remove_owned_by_removes_only_that_owners_folders(tmp_path):
    mine = _folder(tmp_path, 4242)
    other = _folder(tmp_path, 4343)
    ipc_dir.remove_owned_by(4242, str(tmp_path))
    assert not mine.exists() and other.exists()


def test_owner_pid_of_other_names():
    assert ipc_dir.owner_pid("/tmp/pdserve-engine-12-ab_c") == 12
    assert ipc_dir.owner_pid("/tmp/pdserve-engine-abc") is None
    assert ipc_dir.owner_pid("/tmp/pdserve-up-12-abc") is None


def _engine_folders(root: Path) -> set[Path]:
    return {p for p in root.iterdir() if p.name.startswith(ipc_dir.PREFIX)}


@pytest.mark.slow
def test_kill_9_of_serve_leaves_no_socket_folder(tiny_llama_path, tmp_path):
    from tests.support.servers import EngineServer

    tmp_root = tmp_path / "tmp"
    tmp_root.mkdir()
    args = ["--dtype", "float32", "--device", "cpu", "--max-model-len", "256",
            "--kv-cache-memory", "8MiB"]
    server = EngineServer(tiny_llama_path, tmp_path / "serve.log", None, args,
                          env={"TMPDIR": str(tmp_root)})
    try:
        server.wait_ready()
        folders = _engine_folders(tmp_root)
        assert len(folders) == 1 and ipc_dir.owner_pid(str(next(iter(folders)))) == server.proc.pid
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 30
        while _engine_folders(tmp_root) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _engine_folders(tmp_root), server.log_tail()
    finally:
        server.stop()
