"""ModelRunner contract: KV cache sizing and layout, connector calls, sampling state, errors."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.types.outputs import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams
from pdserve.kv_transfer.base import KVConnectorWorkerSide
from pdserve.runner.model_runner import ModelRunner

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy


@pytest.fixture(scope="module")
def runner(tiny_llama_path):
    r = ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=128,
                                 num_gpu_blocks_override=32))
    r.allocate_kv_cache(r.determine_num_blocks())
    return r


def test_model_info_and_kv_cache_layout(runner):
    info = runner.model_info
    assert (info.architecture, info.num_layers, info.num_kv_heads, info.head_dim) == (
        "LlamaForCausalLM", 2, 2, 16)
    assert info.vocab_size == 49152 and info.eos_token_ids == [2]
    assert info.dtype == "float32" and info.device == "cpu"
    assert runner.kv_cache.shape == (32, 2, 2, 2, 16, 16)
    spec = runner.kv_cache_spec
    assert (spec.num_blocks, spec.block_size, spec.num_layers, spec.num_kv_heads,
            spec.head_dim, spec.dtype, spec.element_size) == (32, 16, 2, 2, 16, "float32", 4)
    # one block is one contiguous region of block_bytes (docs/architecture.md, "KV cache layout")
    assert runner.kv_cache[1].data_ptr() - runner.kv_cache[0].data_ptr() == spec.block_bytes
    assert spec.block_bytes == runner.block_bytes


def test_kv_written_to_the_right_slots(tiny_llama_path):
    r = ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=128,
                                 num_gpu_blocks_override=8))
    r.allocate_kv_cache(8)
    blocks = [5, 2]  # 20 tokens: block 5 full, 4 tokens of block 2
    req = DrivenRequest("a", list(range(10, 30)), 1, greedy(1), block_ids=list(blocks))
    MiniScheduler(r, 8).run([req])
    touched = r.kv_cache.flatten(1).abs().sum(1) > 0
    assert touched.nonzero().flatten().tolist() == [2, 5]
    per_pos = r.kv_cache[2].abs().sum(dim=(0, 1, 2, 4))  # [block_size]
    assert (per_pos[:4] > 0).all() and (per_pos[4:] == 0).all()


def test_cpu_sizing(tiny_llama_path):
    cfg = EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=128, max_num_seqs=4)
    r = ModelRunner(cfg)
    bb = r.block_bytes
    assert bb == 2 * 2 * 2 * 16 * 16 * 4
    # default: 1 GiB capped by max_num_seqs * max_model_len tokens
    assert r.determine_num_blocks() == 4 * 128 // 16
    cfg.kv_cache_memory = 100 * bb + 5
    assert r.determine_num_blocks() == 100
    cfg.num_gpu_blocks_override = 7
    assert r.determine_num_blocks() == 7
    cfg.num_gpu_blocks_override = None
    cfg.kv_cache_memory = 3 * bb - 1  # whole blocks only; fitting max_model_len is the core's check
    assert r.determine_num_blocks() == 2


def test_allocation_logs_blocks_and_tokens(tiny_llama_path, caplog):
    r = ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=64))
    with caplog.at_level(logging.INFO, logger="pdserve.model"):
        r.allocate_kv_cache(12)
    msg = " ".join(rec.getMessage() for rec in caplog.records if rec.name == "pdserve.model")
    assert "12 blocks" in msg and "192 tokens" in msg


class RecordingWorker(KVConnectorWorkerSide):
    """A connector worker that records the calls the runner makes."""

    def __init__(self):
        self.calls = []

    def register_kv_cache(self, kv_cache, spec):
        self.calls.append(("register",))

    def bind_connector_metadata(self, metadata):
        self.calls.append(("bind", metadata))

    def start_load_kv(self):
        self.calls.append(("start",))

    def get_finished(self, finished_request_ids):
        self.calls.append(("finished", set(finished_request_ids)))
        return KVConnectorOutput(finished_recving={"x"})


def test_connector_called_around_forward_even_when_empty(runner):
    worker = RecordingWorker()
    runner.set_kv_connector_worker(worker)
    try:
        out = runner.execute(SchedulerOutput(kv_connector_metadata="meta0",
                                             finished_request_ids={"gone"}))
        assert out.sampled_token_ids == {}
        assert out.kv_connector_output.finished_recving == {"x"}
        assert worker.calls == [("bind", "meta0"), ("start",), ("finished", {"gone"})]
        worker.calls.clear()
        req = ScheduledRequest("q", [5, 6, 7], 0, [0], True, SamplingParams(temperature=0),
                               [5, 6, 7], [])
        out = runner.execute(SchedulerOutput(scheduled=[req], kv_connector_metadata="meta1"))
        assert [c[0] for c in worker.calls] == ["bind", "start", "finished"]
        assert set(out.sampled_token_ids) == {"q"}
    finally:
        runner.set_kv_connector_worker(None)
    assert runner.execute(SchedulerOutput()).kv_connector_output is None


def test_non_final_chunk_samples_nothing(runner):
    p = SamplingParams(temperature=0)
    prompt = list(range(100, 140))
    out = runner.execute(SchedulerOutput(scheduled=[
        ScheduledRequest("c", prompt[:20], 0, [0, 1, 2], False, p, prompt, [])]))
    assert out.sampled_token_ids == {}
    out = runner.execute(SchedulerOutput(scheduled=[
        ScheduledRequest("c", prompt[20:], 20, [0, 1, 2], True, p, prompt, [])]))
    assert set(out.sampled_token_ids) == {"c"}


def test_seeded_sampling_independent_of_batch_and_dropped(runner):
    seeded = SamplingParams(temperature=1.0, seed=42, max_tokens=8)

    def run(with_others: bool):
        reqs = [DrivenRequest("s", list(range(200, 220)), 8, seeded)]
        if with_others:
            reqs += [DrivenRequest(f"o{i}", list(range(300 + i, 317 + i)), 8,
                                   SamplingParams(temperature=1.0, max_tokens=8), start_step=i)
                     for i in range(3)]
        MiniScheduler(runner, 32).run(reqs)
        held = runner.sampler.num_generators
        runner.execute(SchedulerOutput(finished_request_ids={r.request_id for r in reqs}))
        assert runner.sampler.num_generators == 0
        return reqs[0].output, held

    alone, held = run(False)
    # seeded draws are keyed by (seed, output position): the sampler keeps nothing for them
    assert held == 0
    assert run(True)[0] == alone


def test_logprobs_through_runner(runner):
    req = DrivenRequest("l", list(range(50, 60)), 3, greedy(3, logprobs=5))
    MiniScheduler(runner, 32).run([req])
    assert [lp.token_id for lp in req.logprobs] == req.output
    for lp in req.logprobs:
        assert len(lp.top) == 5 and lp.top[0][0] == lp.token_id
        assert math.isclose(lp.top[0][1], lp.logprob, rel_tol=1e-6) and lp.logprob <= 0


def test_execute_async_feeds_the_previous_steps_token_on_the_device(runner):
    """A placeholder decode (``input_from_previous_step``) reads the token the previous
    ``execute_async`` step sampled: the same tokens as ``execute`` with the token known, for a
    greedy and a seeded request; a placeholder with no previous sample is an error."""
    prompt = list(range(400, 413))
    greedy_p, seeded_p = SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=5)

    def prefill(rid, params, blocks):
        return ScheduledRequest(rid, prompt, 0, blocks, True, params, prompt, [])

    def decode(rid, params, blocks, token, fed):
        return ScheduledRequest(rid, [-1 if fed else token], len(prompt), blocks, True, params,
                                prompt, [] if fed else [token], input_from_previous_step=fed,
                                num_output_tokens=1 if fed else -1)

    reqs = [("g", greedy_p, [0]), ("s", seeded_p, [1])]
    first = runner.execute(SchedulerOutput(scheduled=[prefill(*r) for r in reqs]))
    second = runner.execute(SchedulerOutput(scheduled=[
        decode(*r, first.sampled_token_ids[r[0]], False) for r in reqs]))
    runner.execute(SchedulerOutput(finished_request_ids={"g", "s"}))

    step1 = runner.execute_async(SchedulerOutput(scheduled=[prefill(*r) for r in reqs]))
    step2 = runner.execute_async(SchedulerOutput(scheduled=[decode(*r, 0, True) for r in reqs]))
    assert step1.result().sampled_token_ids == first.sampled_token_ids
    assert step2.result().sampled_token_ids == second.sampled_token_ids
    with pytest.raises(ValueError, match="previous step"):
        runner.execute_async(SchedulerOutput(scheduled=[decode("x", greedy_p, [2], 0, True)]))
    runner.execute(SchedulerOutput(finished_request_ids={"g", "s"}))


def test_malformed_requests_raise(runner):
    p = SamplingParams(temperature=0)
    with pytest.raises(ValueError, match="no tokens"):
        runner.execute(SchedulerOutput(scheduled=[ScheduledRequest("e", [], 0, [0], True, p,
                                                                   [1], [])]))
    with pytest.raises(ValueError, match="block table"):
        runner.execute(SchedulerOutput(scheduled=[ScheduledRequest("e", list(range(20)), 0,
                                                                   [0], True, p, [1], [])]))
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute(SchedulerOutput(scheduled=[ScheduledRequest("e", [1], 128, [0] * 9,
                                                                   True, p, [1], [])]))


def test_execute_before_allocation_fails(tiny_llama_path):
    r = ModelRunner(EngineConfig(model=tiny_llama_path, device="cpu", max_model_len=64))
    req = ScheduledRequest("a", [1, 2], 0, [0], True, SamplingParams(), [1, 2], [])
    with pytest.raises(RuntimeError, match="allocate_kv_cache"):
        r.execute(SchedulerOutput(scheduled=[req]))


def test_bfloat16_on_cpu(tiny_qwen3_path):
    r = ModelRunner(EngineConfig(model=tiny_qwen3_path, device="cpu", dtype="bfloat16",
                                 max_model_len=64, num_gpu_blocks_override=8))
    r.allocate_kv_cache(8)
    assert r.model_info.dtype == "bfloat16" and r.kv_cache.dtype == torch.bfloat16
    assert r.kv_cache_spec.element_size == 2
    req = DrivenRequest("b", list(range(1000, 1020)), 4, greedy(4, logprobs=1))
    MiniScheduler(r, 8).run([req])
    assert len(req.output) == 4 and all(math.isfinite(lp.logprob) for lp in req.logprobs)
