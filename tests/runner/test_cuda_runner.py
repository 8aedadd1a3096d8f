"""The model runner on CUDA (skipped without a GPU): greedy tokens equal transformers' on the
same device in float32 with both attention backends, bf16 backends agree, and KV cache sizing
by GPU memory utilisation."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

B = 16
NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def _mixed_batch(runner: ModelRunner, n_new: int = 6, sched: MiniScheduler | None = None
                 ) -> list[DrivenRequest]:
    reqs = []
    for i, length in enumerate([1, B - 1, B, B + 1, 2 * B + 1]):
        chunks = [B + 1, length - B - 1] if length == 2 * B + 1 else None
        reqs.append(DrivenRequest(f"r{i}", _prompt(length, i), n_new, greedy(n_new),
                                  chunks=chunks, start_step=i))
    (sched or MiniScheduler(runner, NUM_BLOCKS)).run(reqs)
    return reqs


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3", "tiny_gemma3"])
def test_cuda_float32_greedy_matches_transformers(arch, backend, request, monkeypatch):
    from transformers import AutoModelForCausalLM

    if backend == "triton":
        pytest.importorskip("triton")
    monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
    path = request.getfixturevalue(f"{arch}_path")
    runner = ModelRunner(EngineConfig(model=path, device="cuda", dtype="float32",
                                      max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(NUM_BLOCKS)
    assert runner.kv_cache.is_cuda
    assert type(runner.model.attn_backend).__name__.lower().startswith(backend)
    reqs = _mixed_batch(runner)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for r in reqs:
        ids = torch.tensor([r.prompt], device="cuda")
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                          do_sample=False, pad_token_id=2)[0, len(r.prompt):].tolist()
        assert r.output[:len(ref)] == ref, f"{arch}/{backend} len {len(r.prompt)}"


def test_cuda_bf16_backends_agree(tiny_qwen3_path, monkeypatch):
    """Triton decode and SDPA decode give (nearly) the same bf16 logits."""
    logits = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("PDSERVE_ATTENTION_BACKEND", backend)
        runner = ModelRunner(EngineConfig(model=tiny_qwen3_path, device="cuda",
                                          max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS))
        runner.allocate_kv_cache(NUM_BLOCKS)
        assert runner.model_info.dtype == "bfloat16"
        sched = MiniScheduler(runner, NUM_BLOCKS)
        reqs = _mixed_batch(runner, n_new=2, sched=sched)
        # logits of one more decode step for every request, through the model directly
        from pdserve.attention import build_attention_metadata

        for r in reqs:
            sched.ensure_blocks(r, r.num_computed + 1)
        meta = build_attention_metadata([], [(r.block_ids, r.num_computed) for r in reqs],
                                        B, runner.device)
        ids = torch.tensor([r.output[-1] for r in reqs], device="cuda")
        pos = torch.tensor([r.num_computed for r in reqs], device="cuda")
        idx = torch.arange(len(reqs), device="cuda")
        logits[backend] = runner.model(ids, pos, runner.kv_cache, meta, idx)
    torch.testing.assert_close(logits["triton"], logits["torch"], atol=2e-2, rtol=2e-2)


def test_cuda_sizing_by_memory_utilisation(tiny_llama_path):
    cfg = EngineConfig(model=tiny_llama_path, device="cuda", max_model_len=256,
                       max_num_batched_tokens=512, gpu_memory_utilization=0.05)
    runner = ModelRunner(cfg)
    n = runner.determine_num_blocks()
    total = torch.cuda.get_device_properties(0).total_memory
    assert 0 < n * runner.block_bytes <= 0.05 * total
    cfg.gpu_memory_utilization = 0.10
    assert runner.determine_num_blocks() > n


def test_cuda_graph_decode_matches_eager_bf16(tiny_qwen3_path):
    """bf16 greedy tokens with decode steps replayed from CUDA graphs equal the eager ones
    (batch sizes that are capture sizes: the same kernels on the same shapes; prefills eager,
    as their padded piecewise graphs would run other GEMM shapes: tests/runner/
    test_cuda_piecewise.py)."""
    outputs = {}
    for eager in (True, False):
        runner = ModelRunner(EngineConfig(model=tiny_qwen3_path, device="cuda", max_model_len=256,
                                          max_num_seqs=8, num_gpu_blocks_override=NUM_BLOCKS,
                                          enforce_eager=eager, piecewise_cuda_graph_max_tokens=0))
        runner.allocate_kv_cache(NUM_BLOCKS)
        assert (runner.decode_graphs is None) == eager
        if not eager:
            assert runner.decode_graphs.capture_sizes == [1, 2, 4, 8]
        reqs = [DrivenRequest(f"r{i}", _prompt(n, 10 + i), 12, greedy(12))
                for i, n in enumerate([3, B, B + 5, 2 * B + 3])]
        MiniScheduler(runner, NUM_BLOCKS).run(reqs)
        one = [DrivenRequest("solo", _prompt(B - 1, 20), 12, greedy(12))]
        MiniScheduler(runner, NUM_BLOCKS).run(one)
        outputs[eager] = [r.output for r in reqs + one]
        runner.shutdown()
    assert outputs[False] == outputs[True]


def test_cuda_graph_multi_step_rounds_match_single_steps(tiny_qwen3_path):
    """Multi-step rounds (token fed back on the GPU, slots and context lengths advanced in the
    graph's static inputs) and overlapped single steps (the previous step's token fed on the
    GPU) give the same greedy and seeded-sampled tokens as synchronous graph decode steps; a
    request stopping inside a round keeps only its tokens up to the stop."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.types.sampling_params import SamplingParams

    prompts = [_prompt(n, 30 + i) for i, n in enumerate([3, B, B + 5, 2 * B + 3])]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=24, ignore_eos=True)]
    results = {}
    for steps, overlap in ((1, False), (1, True), (8, False)):
        engine = LLMEngine(EngineConfig(model=tiny_qwen3_path, device="cuda", dtype="float32",
                                        max_model_len=256, max_num_seqs=8,
                                        num_gpu_blocks_override=NUM_BLOCKS,
                                        num_scheduler_steps=steps, async_scheduling=overlap))
        try:
            assert engine.core.runner.decode_graphs is not None
            rounds, launched = [], []
            runner = engine.core.runner
            inner, inner_async = runner.execute, runner.execute_async
            runner.execute = lambda s: (rounds.append(s.num_steps), inner(s))[1]
            runner.execute_async = lambda s: (launched.append(s.num_steps), inner_async(s))[1]
            results[steps, overlap] = [o.token_ids for o in engine.generate(prompts, params)]
            assert (max(rounds, default=1) == 8) == (steps == 8)
            assert bool(launched) == overlap
            kvm = engine.kv_cache_manager
            assert kvm.num_free_blocks == kvm.num_blocks
        finally:
            engine.shutdown()
    assert results[8, False] == results[1, False] == results[1, True]
    assert all(len(t) == 24 for t in results[8, False])
