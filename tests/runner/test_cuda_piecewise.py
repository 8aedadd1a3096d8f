"""Piecewise CUDA graphs of steps with prefills (pdserve/runner/piecewise_graphs.py) on CUDA
(skipped without a GPU): float32 greedy tokens of mixed batches equal the eager runner's for the
Llama, Qwen3, Gemma 3 and Qwen3-MoE stages on the Triton path, the replay is used for steps up to
the largest size only, and a bf16 step's logits match the eager forward pass on the same cache."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner

from tests.support.families import make_family_model
from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def _requests() -> list[DrivenRequest]:
    # steps of 5..150 tokens: prefills alone and with decodes, a chunk over cached context, and
    # one step (the 120-token prompt with the others) above the largest size, 112
    return [DrivenRequest("a", _prompt(5, 1), 6, greedy(6)),
            DrivenRequest("b", _prompt(70, 2), 6, greedy(6), chunks=[33, 37], start_step=1),
            DrivenRequest("c", _prompt(12, 3), 5, greedy(5), start_step=2),
            DrivenRequest("d", _prompt(120, 4), 3, greedy(3), start_step=4)]


def _runner(path: str, dtype: str, eager: bool) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, device="cuda", dtype=dtype, max_model_len=256,
                                      max_num_seqs=8, max_num_batched_tokens=100,
                                      num_gpu_blocks_override=NUM_BLOCKS, enforce_eager=eager))
    runner.allocate_kv_cache(NUM_BLOCKS)
    return runner


@pytest.fixture(params=["llama", "qwen3", "gemma3", "qwen3-moe"])
def model_path(request, tmp_path_factory):
    if request.param == "qwen3-moe":
        return make_family_model("qwen3-moe", tmp_path_factory.mktemp("moe"))
    return request.getfixturevalue(f"tiny_{request.param}_path")


def test_piecewise_graphs_give_the_eager_tokens_float32(model_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    outputs = {}
    for eager in (True, False):
        runner = _runner(model_path, "float32", eager)
        replayed: list[int] = []
        if eager:
            assert runner.piecewise_graphs is None
        else:
            pieces = runner.piecewise_graphs
            assert pieces.captured and pieces.sizes == [16, 32, 64, 112]
            real_run = pieces.run

            def counting_run(*args, _run=real_run):
                replayed.append(args[0].shape[0])
                return _run(*args)

            pieces.run = counting_run
        reqs = _requests()
        MiniScheduler(runner, NUM_BLOCKS).run(reqs)
        outputs[eager] = [r.output for r in reqs]
        if not eager:
            assert replayed and max(replayed) <= 112 and any(n > 16 for n in replayed)
        runner.shutdown()
    assert outputs[False] == outputs[True]


def test_piecewise_step_logits_bf16(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path, "bfloat16", False)
    pieces = runner.piecewise_graphs
    blocks = list(range(8))
    prompt = _prompt(90, 7)
    model, cache = runner.model, runner.kv_cache
    # 60 tokens cached, then a 30-token chunk and a decode over the same blocks' first tokens
    meta0 = model.attn_backend.build_metadata([(0, blocks, 60)], [], runner.device)
    model(torch.tensor(prompt[:60], device="cuda"), torch.arange(60, device="cuda"), cache, meta0,
          torch.tensor([59], device="cuda"))
    meta = model.attn_backend.build_metadata([(60, blocks, 30)], [(blocks, 20)], runner.device)
    ids = torch.tensor(prompt[60:90] + [prompt[20]], device="cuda")
    pos = torch.tensor(list(range(60, 90)) + [20], device="cuda")
    idx = torch.tensor([29, 30, 3], device="cuda")
    want = model(ids, pos, cache.clone(), meta, idx)
    got = pieces.run(ids, pos, cache.clone(), meta, idx)
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=0.03)
    runner.shutdown()
