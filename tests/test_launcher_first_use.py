"""First-use fixes of ``pdserve up``: a model that does not exist is refused before anything
starts; a model without a chat template gets completions examples; engines without a GPU run
without NIXL's progress thread (the rule ``pdserve serve`` shares)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import launcher
from pdserve.entrypoints.cli_args import with_host_defaults
from pdserve.types.kv_transfer_config import KVTransferConfig
from pdserve.utils.host_devices import nixl_progress_thread_default


class _NoStart(launcher.ChildCommands):
    def engine(self, **kwargs):  # pragma: no cover - must not be reached
        raise AssertionError("an engine was planned for a model that does not exist")


def test_up_refuses_a_missing_model_before_planning(capsys, tmp_path):
    rc = launcher.main(["nosuchmodel", "--log-dir", str(tmp_path / "logs")],
                       commands=_NoStart(), gpus=[])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "model 'nosuchmodel' not found" in err[0] and "gemma3-270m" in err[0]
    assert not (tmp_path / "logs").exists()


def test_up_refuses_a_missing_tokenizer(capsys):
    rc = launcher.main(["--", "--tokenizer", "/no/such/dir"], commands=_NoStart(), gpus=[])
    assert rc == 2
    assert "tokenizer '/no/such/dir' not found" in capsys.readouterr().err


def test_model_error_accepts_builtins_and_paths(tmp_path):
    assert launcher.cli.model_error("gemma3-270m") is None
    (tmp_path / "config.json").write_text("{}")
    assert launcher.cli.model_error(str(tmp_path)) is None
    (tmp_path / "m.gguf").write_bytes(b"")
    assert launcher.cli.model_error(str(tmp_path / "m.gguf")) is None


def test_model_error_refuses_a_directory_that_is_not_a_model(tmp_path):
    """A directory without config.json (or a file that is not .gguf) is refused up front; it
    failed only after the engine had started."""
    error = launcher.cli.model_error(str(tmp_path))
    assert error is not None and "config.json" in error and str(tmp_path) in error
    (tmp_path / "notes.txt").write_text("")
    error = launcher.cli.model_error(str(tmp_path / "notes.txt"))
    assert error is not None and ".gguf" in error


def _python_example(banner: str) -> str:
    lines = banner.splitlines()
    start = next(i for i, line in enumerate(lines) if "<<'EOF'" in line)
    return "\n".join(lines[start + 1:lines.index("EOF", start)])


@pytest.mark.slow
def test_banner_without_chat_template_uses_completions(tmp_path):
    banner = launcher.usage_banner("http://127.0.0.1:8000", "gemma3-270m",
                                   python="/venv/bin/python", openai_installed=True,
                                   chat_template=False)
    assert "/v1/chat/completions" not in banner and "chat.completions" not in banner
    assert "/v1/completions" in banner and '"prompt"' in banner
    code = _python_example(banner)
    compile(code, "example", "exec")
    assert "client.completions.create(" in code and "choices[0].text" in code
    assert "pdserve chat --url http://127.0.0.1:8000 --completions" in banner
    script = tmp_path / "example.sh"
    script.write_text(banner.split("Try it:", 1)[1])
    check = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_banner_with_chat_template_keeps_chat():
    banner = launcher.usage_banner("http://127.0.0.1:8000", "m", openai_installed=True)
    assert "/v1/chat/completions" in banner and "--completions" not in banner


@pytest.mark.parametrize("device,gpus,expected", [
    (None, ["0"], True), ("auto", ["0"], True), ("cuda", ["0"], True),
    ("cpu", ["0"], False), (None, [], False), ("auto", [], False), ("cuda", [], False)])
def test_progress_thread_rule(device, gpus, expected):
    assert nixl_progress_thread_default(device, gpus) is expected


def test_serve_turns_the_progress_thread_off_without_a_gpu(monkeypatch):
    monkeypatch.setattr("pdserve.entrypoints.cli_args.detect_gpus", lambda: [])
    config = KVTransferConfig(kv_role="kv_producer")
    argv = ["--kv-transfer-config", '{"kv_role":"kv_producer"}']
    assert with_host_defaults(config, argv, "auto").nixl_progress_thread is False
    monkeypatch.setattr("pdserve.entrypoints.cli_args.detect_gpus", lambda: ["0"])
    assert with_host_defaults(config, argv, "auto").nixl_progress_thread is True
    assert with_host_defaults(config, argv, "cpu").nixl_progress_thread is False
    assert with_host_defaults(None, [], "cpu") is None


@pytest.mark.parametrize("argv", [
    ["--kv-transfer-config",
     '{"kv_role":"kv_producer","kv_connector_extra_config":{"nixl_progress_thread":true}}'],
    ["--kv-transfer-config.kv_role", "kv_producer",
     "--kv-transfer-config.kv_connector_extra_config.nixl_progress_thread", "true"]])
def test_an_explicit_progress_thread_value_wins(monkeypatch, argv):
    monkeypatch.setattr("pdserve.entrypoints.cli_args.detect_gpus", lambda: [])
    config = KVTransferConfig(kv_role="kv_producer",
                              kv_connector_extra_config={"nixl_progress_thread": True})
    assert with_host_defaults(config, argv, "cpu").nixl_progress_thread is True


def test_serve_main_applies_the_host_rule(monkeypatch):
    from pdserve.entrypoints import server

    seen = {}
    monkeypatch.setattr("pdserve.entrypoints.cli_args.detect_gpus", lambda: [])
    monkeypatch.setattr(server, "run_server",
                        lambda args: seen.setdefault("kv", args.kv_transfer_config) and 0)
    server.main(["--kv-transfer-config.kv_role", "kv_consumer"])
    assert seen["kv"].nixl_progress_thread is False


def test_up_plans_cpu_engines_without_the_progress_thread():
    import json

    opts = launcher.parse_args(["--port", "0"])
    specs = launcher.build_plan(opts, launcher.ChildCommands(python=sys.executable), gpus=[])
    for spec in specs[:-1]:
        config = json.loads(spec.argv[spec.argv.index("--kv-transfer-config") + 1])
        assert config["kv_connector_extra_config"]["nixl_progress_thread"] is False


def test_serve_help_lists_kv_transfer_config_and_builtin_models(capsys):
    from pdserve.entrypoints.cli_args import build_parser

    help_text = build_parser().format_help()
    assert "--kv-transfer-config JSON" in help_text.replace("\n", " ")
    assert "gemma3-270m" in help_text


@pytest.mark.slow
def test_up_nosuchmodel_process_exits_2_before_starting_anything(tmp_path):
    log_dir = tmp_path / "logs"
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "up", "nosuchmodel",
                          "--log-dir", str(log_dir)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [out.stderr.strip()]  # one line
    assert "model 'nosuchmodel' not found" in out.stderr
    assert not log_dir.exists() and "started" not in out.stdout


@pytest.mark.slow
def test_serve_help_process_lists_kv_transfer_config():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0
    assert "--kv-transfer-config JSON" in out.stdout and "gemma3-270m" in out.stdout
