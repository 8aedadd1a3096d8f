"""Fixtures for the kernel tests: torch runs single-threaded (tests/support/torch_threads.py); every
kernel compiled for sm_90 once per session, in the background (``hopper_compile``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests.support.torch_threads import _one_torch_thread  # noqa: F401  (autouse session fixture)

#: the background compile: its process ("proc") and Triton cache directory ("cache")
_COMPILE: dict = {}


def pytest_collection_finish(session):
    """Start the sm_90 compile (tests/kernels/compile_for_hopper.py) in the background when a
    selected test uses ``hopper_compile``: it then runs beside the interpreter tests."""
    if importlib.util.find_spec("triton") is None:
        return
    if any("hopper_compile" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_compile()


def _start_compile() -> subprocess.Popen:
    if "proc" not in _COMPILE:
        _COMPILE["cache"] = tempfile.TemporaryDirectory(prefix="triton-cache-")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["TRITON_CACHE_DIR"] = _COMPILE["cache"].name
        # the pdserve under test: the repository holding these tests
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        _COMPILE["proc"] = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("compile_for_hopper.py"))], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return _COMPILE["proc"]


@pytest.fixture(scope="session")
def hopper_compile() -> tuple[dict[str, set[str]], dict[str, set[str]], str]:
    """Every pdserve Triton kernel compiled for sm_90 in one fresh process with the interpreter
    off: ``(ok, failed, stderr)``, ``ok`` / ``failed`` mapping a group (``attention``, ``moe``)
    to the configuration labels that compiled / did not. Skips without Triton's NVIDIA backend."""
    pytest.importorskip("triton.backends.nvidia")
    proc = _start_compile()
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    ok: dict[str, set[str]] = {}
    failed: dict[str, set[str]] = {}
    for line in out.splitlines():
        status, _, rest = line.partition(" ")
        if status in ("ok", "FAIL"):
            group, _, label = rest.partition(" ")
            (ok if status == "ok" else failed).setdefault(group, set()).add(label)
    if "done" not in out.splitlines():
        failed.setdefault("script", set()).add(f"exit {proc.returncode}")
    return ok, failed, err


def pytest_sessionfinish(session):
    proc = _COMPILE.get("proc")
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait()
    if "cache" in _COMPILE:
        _COMPILE["cache"].cleanup()
