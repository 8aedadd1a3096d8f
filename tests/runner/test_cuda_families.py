"""The families of issue 17 on CUDA (skipped without a GPU): float32 greedy tokens on the Triton
path (fused MoE, rotary tables with rope scaling) equal transformers' on the same device, and
Qwen3-MoE decode steps replayed from CUDA graphs equal eager ones in bf16."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner

from tests.support.families import ORIGINAL_CTX, make_family_model
from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

B = 16
NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


@pytest.mark.parametrize("name", ["qwen2", "qwen2-yarn", "llama3-rope", "qwen3-moe"])
def test_cuda_triton_float32_greedy_matches_transformers(name, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    pytest.importorskip("triton")
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", "triton")
    path = make_family_model(name, tmp_path / name)
    runner = ModelRunner(EngineConfig(model=path, device="cuda", dtype="float32",
                                      max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(NUM_BLOCKS)
    reqs = [DrivenRequest(f"r{i}", _prompt(n, i), 6, greedy(6), start_step=i,
                          chunks=[n // 2, n - n // 2] if n > ORIGINAL_CTX else None)
            for i, n in enumerate([1, B + 1, 3 * ORIGINAL_CTX + 5])]
    MiniScheduler(runner, NUM_BLOCKS).run(reqs)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for r in reqs:
        ids = torch.tensor([r.prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False, pad_token_id=2)[0, len(r.prompt):].tolist()
        assert r.output[:len(ref)] == ref, f"{name} len {len(r.prompt)}"
    runner.shutdown()


def test_cuda_graph_decode_of_qwen3_moe_matches_eager_bf16(tmp_path):
    """The fused MoE path (device-side sorting, grouped GEMM) is captured in the decode graphs
    and replays the eager step's tokens."""
    path = make_family_model("qwen3-moe", tmp_path / "moe")
    outputs = {}
    for eager in (True, False):
        runner = ModelRunner(EngineConfig(model=path, device="cuda", max_model_len=256,
                                          max_num_seqs=8, num_gpu_blocks_override=NUM_BLOCKS,
                                          enforce_eager=eager))
        runner.allocate_kv_cache(NUM_BLOCKS)
        assert (runner.decode_graphs is None) == eager
        reqs = [DrivenRequest(f"r{i}", _prompt(n, 10 + i), 12, greedy(12))
                for i, n in enumerate([3, B, B + 5, 2 * B + 3])]
        MiniScheduler(runner, NUM_BLOCKS).run(reqs)
        outputs[eager] = [r.output for r in reqs]
        runner.shutdown()
    assert outputs[False] == outputs[True]
