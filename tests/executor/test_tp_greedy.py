"""Greedy tokens of a tensor-parallel instance (CPU, gloo) equal those of one process, token
for token: tiny Llama and tiny Qwen3 at TP 2 (also a tiny Llama with one KV head, replicated on
both ranks) and the embedded SmolLM2 (9 heads, 3 KV heads) at TP 3, in-process (LLMEngine),
with a prompt longer than one step's token budget (chunked prefill) and multi-step decode
rounds; SmolLM2 at TP 2 is refused before any rank starts."""

from __future__ import annotations

import os
import random

import pytest

from pdserve.config import EngineConfig
from pdserve.distributed.sharding import TPShardingError
from pdserve.engine.core import EngineCore
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

from processes import descendants, still_running

#: a step computes at most this many tokens: the 45-token prompt is prefilled in 3 chunks
BUDGET = 16


def _prompts() -> list[list[int]]:
    rng = random.Random(13)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, 7, 45)]


def _generate(path: str, tp: int, max_tokens: int = 10) -> list[list[int]]:
    config = EngineConfig(model=path, device="cpu", tensor_parallel_size=tp, max_model_len=128,
                          num_gpu_blocks_override=64, block_size=16,
                          max_num_batched_tokens=BUDGET, num_scheduler_steps=3)
    engine = LLMEngine(config)
    try:
        outs = engine.generate(_prompts(), SamplingParams(temperature=0, max_tokens=max_tokens,
                                                          ignore_eos=True))
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen3"])
def test_tp2_greedy_equals_tp1(request, model):
    path = request.getfixturevalue(f"{model}_path")
    single = _generate(path, 1)
    assert all(len(t) == 10 for t in single)
    assert _generate(path, 2) == single
    assert not still_running(descendants(os.getpid()))


def test_tp2_greedy_equals_tp1_with_one_kv_head_replicated(tmp_path):
    from pdserve.testing.tiny_models import make_tiny_model

    path = str(make_tiny_model(tmp_path / "mqa", "llama", num_key_value_heads=1))
    assert _generate(path, 2) == _generate(path, 1)


def test_smollm2_tp3_greedy_equals_tp1(smollm2_path):
    single = _generate(smollm2_path, 1, max_tokens=6)
    assert _generate(smollm2_path, 3, max_tokens=6) == single


def test_smollm2_tp2_is_refused_naming_the_numbers(smollm2_path):
    config = EngineConfig(model=smollm2_path, device="cpu", tensor_parallel_size=2)
    with pytest.raises(TPShardingError, match=r"tensor_parallel_size 2: 9 attention heads are "
                                              r"not divisible by 2; 3 KV heads are neither "
                                              r"divisible by 2 nor a divisor of 2"):
        EngineCore(config)
    assert not still_running(descendants(os.getpid()))
