"""The piecewise stages of steps with prefills (pdserve/runner/piecewise_graphs.py) on the CPU,
run eagerly (``capture=False``) on the same static buffers and padding as the CUDA graphs:
logits and greedy tokens of mixed batches (chunked prefills over cached context, decodes) equal
the model's own forward pass, for the Llama, Qwen3 and Gemma 3 layer stages, a mixture-of-
experts MLP and DeepSeek's (multi-head latent attention, DeepSeek-MoE); sizes and errors."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.piecewise_graphs import PiecewiseGraphs, piecewise_capture_sizes

from tests.support.families import make_family_model
from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

NUM_BLOCKS = 64
SIZES = [16, 32, 64]


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(length)]


def _runner(path: str) -> ModelRunner:
    runner = ModelRunner(EngineConfig(model=path, device="cpu", dtype="float32",
                                      max_model_len=256, num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(NUM_BLOCKS)
    assert runner.piecewise_graphs is None  # built on CUDA only
    return runner


def _requests() -> list[DrivenRequest]:
    # steps of 3..57 tokens: prefills alone, with decodes, and a chunk over cached context
    return [DrivenRequest("a", _prompt(5, 1), 5, greedy(5)),
            DrivenRequest("b", _prompt(40, 2), 5, greedy(5), chunks=[17, 23], start_step=1),
            DrivenRequest("c", _prompt(12, 3), 4, greedy(4), start_step=2)]


def _run(runner: ModelRunner) -> list[list[int]]:
    reqs = _requests()
    MiniScheduler(runner, NUM_BLOCKS).run(reqs)
    return [r.output for r in reqs]


@pytest.fixture(params=["llama", "qwen3", "gemma3", "qwen3-moe", "deepseek_v2_lite",
                        "deepseek_v3"])
def model_path(request, tmp_path_factory):
    if request.param == "qwen3-moe":
        return make_family_model("qwen3-moe", tmp_path_factory.mktemp("moe"))
    if request.param.startswith("deepseek"):  # MLA: stages that project into no buffer
        from pdserve.testing.tiny_models import make_tiny_model

        return str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param,
                                   max_position_embeddings=256))
    return request.getfixturevalue(f"tiny_{request.param}_path")


def test_pieces_give_the_forward_pass_tokens_and_logits(model_path):
    runner = _runner(model_path)
    reference = _run(runner)
    pieces = PiecewiseGraphs(runner.model, SIZES, capture=False)
    assert pieces.capture() and pieces.captured
    runner.piecewise_graphs = pieces
    runs = []
    real_run = pieces.run

    def counting_run(*args):
        runs.append(args[0].shape[0])
        return real_run(*args)

    pieces.run = counting_run
    assert _run(runner) == reference
    assert runs and all(n <= 64 for n in runs) and any(n not in SIZES for n in runs)

    # One mixed step's logits, through the pieces and through the model, on the same cache.
    r = DrivenRequest("d", _prompt(30, 4), 1, greedy(1))
    sched = MiniScheduler(runner, NUM_BLOCKS)
    sched.ensure_blocks(r, 30)
    cache = runner.kv_cache
    ids = torch.tensor(r.prompt[:21])
    pos = torch.arange(21)
    meta = runner.model.attn_backend.build_metadata([(0, r.block_ids, 21)], [], runner.device)
    idx = torch.tensor([20, 7])
    want = runner.model(ids, pos, cache.clone(), meta, idx)
    got = pieces.run(ids, pos, cache.clone(), meta, idx)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    runner.shutdown()


def test_padding_rows_do_not_reach_the_real_rows(tiny_qwen3_path):
    """Stale ids and attention outputs in the padding rows (from a longer step before) leave a
    short step's logits as they are."""
    runner = _runner(tiny_qwen3_path)
    pieces = PiecewiseGraphs(runner.model, [32], capture=False)
    pieces.capture()
    cache = runner.kv_cache
    ids, pos = torch.tensor(_prompt(5, 9)), torch.arange(5)
    meta = runner.model.attn_backend.build_metadata([(0, [0], 5)], [], runner.device)
    idx = torch.tensor([4])
    clean = pieces.run(ids, pos, cache.clone(), meta, idx)
    pieces.input_ids.fill_(999)
    pieces.buffers.out.fill_(1e4)
    torch.testing.assert_close(pieces.run(ids, pos, cache.clone(), meta, idx), clean,
                               rtol=0, atol=0)
    runner.shutdown()


def test_a_step_replays_the_smallest_size_that_holds_it(tiny_qwen3_path):
    runner = _runner(tiny_qwen3_path)
    pieces = PiecewiseGraphs(runner.model, SIZES, capture=False)
    pieces.capture()
    ran: list[int] = []
    for size, functions in pieces._pieces.items():
        first = functions[0]
        functions[0] = lambda first=first, size=size: (ran.append(size), first())[1]
    for n, want in ((5, 16), (16, 16), (17, 32), (33, 64)):
        meta = runner.model.attn_backend.build_metadata([(0, list(range(5)), n)], [],
                                                        runner.device)
        pieces.run(torch.tensor(_prompt(n, n)), torch.arange(n), runner.kv_cache, meta,
                   torch.tensor([n - 1]))
        assert ran[-1] == want, (n, ran)
    runner.shutdown()


def test_capture_sizes_and_errors(tiny_llama_path):
    assert piecewise_capture_sizes(512) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512]
    assert piecewise_capture_sizes(100) == [16, 32, 64, 112]
    assert piecewise_capture_sizes(1) == [16]
    big = piecewise_capture_sizes(8192)
    assert big[:3] == [16, 32, 64] and big[-2:] == [7296, 8192] and len(big) == 37
    assert all(0 < b - a <= max(64, a // 8) for a, b in zip(big[2:], big[3:]))
    with pytest.raises(ValueError):
        piecewise_capture_sizes(0)
    runner = _runner(tiny_llama_path)
    with pytest.raises(ValueError, match="CUDA"):
        PiecewiseGraphs(runner.model, SIZES)  # capture on a CPU model
    with pytest.raises(ValueError, match="positive"):
        PiecewiseGraphs(runner.model, [], capture=False)
    pieces = PiecewiseGraphs(runner.model, SIZES, capture=False)
    meta = runner.model.attn_backend.build_metadata([(0, [0], 2)], [], runner.device)
    args = (torch.tensor([5, 6]), torch.arange(2), runner.kv_cache, meta, torch.tensor([1]))
    with pytest.raises(RuntimeError, match="before capture"):
        pieces.run(*args)
    pieces.capture()
    too_long = torch.zeros(65, dtype=torch.int64)
    with pytest.raises(ValueError, match="outside the captured sizes"):
        pieces.run(too_long, too_long, runner.kv_cache, meta, torch.tensor([1]))
    with pytest.raises(ValueError, match=">= 0"):
        ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu",
                                 piecewise_cuda_graph_max_tokens=-1))
    runner.shutdown()
