"""``--kv-cache-dtype fp8`` end to end in one engine on CPU: the cache is stored as float8 e4m3,
the same memory holds more blocks, and greedy tokens and log-probs stay close to those of the
full-precision cache (the embedded SmolLM2, chat prompts)."""

from __future__ import annotations

import math

import pytest
import torch

from pdserve.types.engine_config import EngineConfig, KVCacheDtype
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.sampling_params import SamplingParams
from pdserve.runner.model_runner import ModelRunner

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in two sentences.",
    "List three prime numbers greater than 10.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a short tip for learning to cook.",
]
NUM_TOKENS = 16


def test_kv_cache_dtype_spellings():
    assert KVCacheDtype.parse("auto") is KVCacheDtype.AUTO
    assert KVCacheDtype.parse("fp8") is KVCacheDtype.FP8_E4M3
    assert KVCacheDtype.parse("FP8_E4M3") is KVCacheDtype.FP8_E4M3
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        KVCacheDtype.parse("fp8_e5m2")


def test_fp8_cache_is_stored_as_fp8_and_holds_more_blocks_in_the_same_memory(tiny_llama_path):
    runners = {}
    for kind in KVCacheDtype:
        runner = ModelRunner(EngineConfig(model=tiny_llama_path, dtype="bfloat16",
                                          kv_cache_dtype=kind, kv_cache_memory=4 << 20,
                                          max_model_len=256))
        runner.allocate_kv_cache(runner.determine_num_blocks())
        runners[kind] = runner
    full, fp8 = runners[KVCacheDtype.AUTO], runners[KVCacheDtype.FP8_E4M3]
    assert full.kv_cache.dtype == torch.bfloat16
    assert fp8.kv_cache.dtype == torch.float8_e4m3fn
    assert (fp8.kv_cache_spec.dtype, fp8.kv_cache_spec.element_size) == ("float8_e4m3fn", 1)
    assert fp8.kv_cache_spec.block_bytes * 2 == full.kv_cache_spec.block_bytes
    assert fp8.determine_num_blocks() == 2 * full.determine_num_blocks()


def _greedy(model: str, kind: KVCacheDtype, prompts: list[list[int]]):
    engine = LLMEngine(EngineConfig(model=model, kv_cache_dtype=kind, max_model_len=512,
                                    kv_cache_memory=32 << 20))
    assert engine.core.runner.kv_cache.dtype == (
        torch.float8_e4m3fn if kind is KVCacheDtype.FP8_E4M3 else torch.float32)
    out = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_TOKENS,
                                                  ignore_eos=True, logprobs=0))
    if kind is KVCacheDtype.FP8_E4M3:  # the scales from the weights bound every stored value
        scales = engine.core.runner.model.attn_backend.kv_scales
        assert all(math.log2(s).is_integer() for s in scales.k + scales.v)
        assert engine.core.runner.kv_cache.float().abs().max() < 448
    return out


@pytest.mark.slow
def test_fp8_greedy_tokens_and_logprobs_agree_with_the_full_precision_cache(smollm2_path):
    from pdserve.model_files.tokenizer import load_tokenizer

    tok = load_tokenizer(EngineConfig(model=smollm2_path))
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for q in QUESTIONS]
    full = _greedy(smollm2_path, KVCacheDtype.AUTO, prompts)
    fp8 = _greedy(smollm2_path, KVCacheDtype.FP8_E4M3, prompts)
    first = sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(full, fp8))
    diffs, exact = [], 0
    for a, b in zip(full, fp8):
        for la, lb in zip(a.logprobs, b.logprobs):
            if la.token_id != lb.token_id:
                break  # contexts differ from here on
            diffs.append(abs(la.logprob - lb.logprob))
            exact += la.logprob == lb.logprob
    common = len(diffs)
    # a 135M model has near-ties: some continuations part ways, but most tokens agree and the
    # log-probs of the agreeing ones barely move
    assert first >= len(prompts) - 2, f"only {first}/{len(prompts)} first tokens agree"
    assert common >= 0.5 * NUM_TOKENS * len(prompts), f"{common} tokens before divergence"
    assert sum(diffs) / len(diffs) < 0.06
    assert exact < len(diffs), "fp8 gave bit-identical log-probs: the cache was not quantized"


def test_fp8_scales_bound_gemma3_whose_norms_scale_by_one_plus_weight(tiny_gemma3_path):
    """Gemma's RMSNorms multiply by ``1 + weight``: the scales must bound what those norms let
    through, so nothing saturates at e4m3's largest value (448)."""
    engine = LLMEngine(EngineConfig(model=tiny_gemma3_path, kv_cache_dtype=KVCacheDtype.FP8_E4M3,
                                    max_model_len=128, kv_cache_memory=8 << 20))
    try:
        engine.generate([[5 + 7 * i for i in range(40)], [900 + i for i in range(25)]],
                        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        assert float(engine.core.runner.kv_cache.float().abs().max()) < 448
    finally:
        engine.shutdown()
