"""Greedy tokens of a tensor-parallel instance (CPU, gloo) equal those of one process, token
for token: tiny Llama and tiny Qwen3 at TP 2 (also a tiny Llama with one KV head, replicated on
both ranks), tiny Qwen2, Qwen3-MoE and Gemma 3 at TP 2, and the embedded SmolLM2 (9 heads, 3 KV heads) at TP 3, in-process (LLMEngine),
with a prompt longer than one step's token budget (chunked prefill) and multi-step decode
rounds; SmolLM2 at TP 2 is refused before any rank starts."""

from __future__ import annotations

import os
import random

import pytest

from pdserve.types.engine_config import EngineConfig, KVCacheDtype
from pdserve.distributed.sharding import TPShardingError
from pdserve.engine.core import EngineCore
from pdserve.engine.llm_engine import LLMEngine
from pdserve.executor import create_executor
from pdserve.types.sampling_params import SamplingParams

from tests.support.processes import descendants, new_descendants, still_running

#: a step computes at most this many tokens: the 45-token prompt is prefilled in 3 chunks
BUDGET = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 45)]


def _generate(path: str, tp: int, max_tokens: int = 10, **engine) -> list[list[int]]:
    config = EngineConfig(model=path, device="cpu", tensor_parallel_size=tp, max_model_len=128,
                          num_gpu_blocks_override=64, block_size=16,
                          max_num_batched_tokens=BUDGET, num_scheduler_steps=3, **engine)
    engine = LLMEngine(config)
    try:
        outs = engine.generate(_prompts(), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_tp2_greedy_equals_tp1(request, model):
    path = request.getfixturevalue(f"{model}_path")
    before = descendants(os.getpid())
    single = _generate(path, 1)
    assert all(len(t) == 10 for t in single)
    assert _generate(path, 2) == single
    assert not still_running(new_descendants(before))


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_with_one_kv_head_replicated(tmp_path):
    from pdserve.testing.tiny_models import make_tiny_model

    path = str(make_tiny_model(tmp_path / "mqa", "llama", num_key_value_heads=1))
    assert _generate(path, 2) == _generate(path, 1)


@pytest.mark.slow
def test_smollm2_tp3_greedy_equals_tp1(smollm2_path):
    single = _generate(smollm2_path, 1, max_tokens=6)
    assert _generate(smollm2_path, 3, max_tokens=6) == single


def test_smollm2_tp2_is_refused_naming_the_numbers(smollm2_path):
    config = EngineConfig(model=smollm2_path, device="cpu", tensor_parallel_size=2)
    before = descendants(os.getpid())
    with pytest.raises(TPShardingError, match=r"tensor_parallel_size 2: 9 attention heads are "
                                              r"not divisible by 2; 3 KV heads are neither "
                                              r"divisible by 2 nor a divisor of 2"):
        EngineCore(config, create_executor)
    assert not still_running(new_descendants(before))


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "gemma3"])
def test_tp2_greedy_equals_tp1_for_the_other_families(tmp_path, arch):
    """Qwen2 (q/k/v bias, tied embeddings), Qwen3-MoE (experts replicated on every rank, dense
    layers sharded) and Gemma 3 (sliding-window layers, row-parallel o_proj and down_proj)."""
    from pdserve.testing.tiny_models import make_tiny_model

    path = str(make_tiny_model(tmp_path / arch, arch))
    single = _generate(path, 1)
    assert all(len(t) == 10 for t in single)
    assert _generate(path, 2) == single


@pytest.mark.slow
def test_tp2_greedy_equals_tp1_with_an_fp8_kv_cache(tiny_gemma3_path):
    """With ``--kv-cache-dtype fp8`` every rank stores with the scales of TP 1 (the largest of
    the ranks' per-head bounds), so the tokens stay those of one process (Gemma 3: its norms'
    gain is ``1 + weight``)."""
    single = _generate(tiny_gemma3_path, 1, kv_cache_dtype=KVCacheDtype.FP8_E4M3)
    assert all(len(t) == 10 for t in single)
    assert _generate(tiny_gemma3_path, 2, kv_cache_dtype=KVCacheDtype.FP8_E4M3) == single
