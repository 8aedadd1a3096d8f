"""Greedy tokens of ModelRunner equal transformers' greedy tokens on the same weights.

Prompt lengths sit around the block size B=16 (1, B-1, B, B+1, 2B+1); requests join at
different steps so prefills and decodes share batches; the longest prompt is prefilled in two
chunks; a request reuses another's cached blocks (prefix cache hit at the runner level). The
tiny Gemma 3 has a sliding window of 8 tokens, shorter than most of these prompts.
"""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

B = 16
PROMPT_LENS = [1, B - 1, B, B + 1, 2 * B + 1]
NUM_NEW = 6
NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _runner(path: str) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, device="cpu", max_model_len=256, block_size=B,
                                      num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    return runner


def _hf(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _check_prefix(ours: list[int], ref: list[int], what: str) -> None:
    # transformers stops at EOS; the runner has no stop logic, so compare up to ref's length.
    assert ours[:len(ref)] == ref, f"{what}: runner {ours} != transformers {ref}"


@pytest.fixture(scope="module", params=["tiny_llama", "tiny_qwen3", "tiny_gemma3",
                                        pytest.param("smollm2", marks=pytest.mark.slow)])
def model_pair(request):
    path = request.getfixturevalue(f"{request.param}_path")
    return request.param, _runner(path), _hf(path)


def test_mixed_batch_matches_transformers(model_pair):
    name, runner, hf = model_pair
    reqs = []
    for i, length in enumerate(PROMPT_LENS):
        chunks = [B + 1, length - B - 1] if length == 2 * B + 1 else None
        reqs.append(DrivenRequest(f"r{i}", _prompt(length, seed=i), NUM_NEW, greedy(NUM_NEW),
                                  chunks=chunks, start_step=i))
    MiniScheduler(runner, NUM_BLOCKS).run(reqs)
    for r in reqs:
        ref = _hf_greedy(hf, r.prompt, NUM_NEW)
        assert len(ref) >= 1
        _check_prefix(r.output, ref, f"{name} prompt len {len(r.prompt)}")
    # the batch really mixed prefills and decodes: distinct outputs, not one repeated token
    assert len({tuple(r.output) for r in reqs}) > 1


def test_prefix_block_reuse_matches_transformers(model_pair):
    """A second request reads the first request's KV for a shared 2-block prefix."""
    name, runner, hf = model_pair
    base = _prompt(2 * B + 3, seed=100)
    first = DrivenRequest("a", base, 2, greedy(2))
    sched = MiniScheduler(runner, NUM_BLOCKS)
    sched.run([first])
    shared = first.block_ids[:2]
    tail = _prompt(5, seed=101)
    second = DrivenRequest("b", base[:2 * B] + tail, NUM_NEW, greedy(NUM_NEW),
                           num_computed=2 * B, block_ids=list(shared))
    sched.run([second])
    _check_prefix(second.output, _hf_greedy(hf, second.prompt, NUM_NEW), f"{name} prefix hit")
