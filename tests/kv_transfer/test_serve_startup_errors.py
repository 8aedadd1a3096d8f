"""``pdserve serve`` refuses unusable KV transfer settings at start-up with a clear message and a
non-zero exit code (no server left running).

Each check starts a server on a model directory that cannot be loaded: the expected message
(instead of the model's load error) shows both that the check reports clearly and that it runs
before the model loads, with one process start per check."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def serve(model: str, kv_args: list[str], side_channel_port: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PDSERVE_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
               PDSERVE_NIXL_SIDE_CHANNEL_PORT=str(side_channel_port))
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", "0",
         "--num-gpu-blocks-override", "64", *kv_args],
        env=env, capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL,
    )


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_bad_config_exits_before_loading_anything(tiny_llama_path, busy_port):
    r = serve(tiny_llama_path, ["--kv-transfer-config.kv_role", "kv_prefill"], busy_port)
    assert r.returncode != 0
    assert "unknown kv_role 'kv_prefill'" in r.stderr


@pytest.fixture
def unloadable_model(tmp_path):
    """A model directory that exists (so the server starts the engine) but cannot be loaded:
    an error that comes from it means the KV transfer checks ran after the model load."""
    path = tmp_path / "not-a-model"
    path.mkdir()
    (path / "config.json").write_text("{}")
    return str(path)


def test_side_channel_port_in_use_is_found_before_the_model_loads(unloadable_model, busy_port):
    # the message names the busy address, and comes before the (failing) model load
    r = serve(unloadable_model, ["--kv-transfer-config", '{"kv_role":"kv_consumer"}'], busy_port)
    assert r.returncode != 0
    assert f"127.0.0.1:{busy_port}" in r.stderr and "already in use" in r.stderr, r.stderr


def test_missing_nixl_backend_is_found_before_the_model_loads(unloadable_model, busy_port):
    # the message names the missing backend, and comes before the (failing) model load (and
    # before the side channel's bind: the port is busy)
    r = serve(unloadable_model, ["--kv-transfer-config.kv_role", "kv_producer",
                                 "--kv-transfer-config.kv_connector_extra_config.backends+",
                                 "NO_SUCH_BACKEND"], busy_port)
    assert r.returncode != 0
    assert "NO_SUCH_BACKEND" in r.stderr and "not available" in r.stderr, r.stderr
