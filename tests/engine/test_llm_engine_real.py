"""The real engine (ModelRunner on the tiny random Llama, CPU, float32) in-process: batching,
chunked prefill, prefix caching and preemption must not change greedy tokens."""

from __future__ import annotations

import pytest

from tests.support import engine_fakes
from pdserve.types.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.sampling_params import SamplingParams

BS = 4
# Around the block size (1, B-1, B, B+1, 2B+1) plus longer ones.
LENGTHS = [1, BS - 1, BS, BS + 1, 2 * BS + 1, 23, 40]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(31 * i + 17 * salt + 5) % 4000 + 100 for i in range(length)]


PROMPTS = [prompt(n, salt=i) for i, n in enumerate(LENGTHS)]

pytestmark = pytest.mark.usefixtures("scheduling_mode")


def make_engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, dtype="float32", device="cpu", block_size=BS, max_model_len=128,
                num_gpu_blocks_override=256, async_scheduling=engine_fakes.ASYNC_SCHEDULING)
    args.update(kw)
    return LLMEngine(EngineConfig(**args))


def assert_all_free(engine: LLMEngine) -> None:
    kvm = engine.kv_cache_manager
    kvm.check_consistency()
    assert kvm.num_free_blocks == kvm.num_blocks


@pytest.fixture(scope="module")
def one_at_a_time(tiny_llama_path) -> list[list[int]]:
    """Greedy tokens of each prompt run alone, without prefix caching."""
    engine = make_engine(tiny_llama_path, enable_prefix_caching=False, async_scheduling=False)
    try:
        outs = [engine.generate([p], GREEDY)[0] for p in PROMPTS]
        assert all(o.finish_reason == "length" and len(o.token_ids) == 10 for o in outs)
        assert_all_free(engine)
        return [o.token_ids for o in outs]
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "kw",
    [
        {},  # everything in one batch
        {"max_num_batched_tokens": 16},  # chunked prefill, prefill and decode mixed
        {"max_num_seqs": 3},  # continuous batching: requests join as others finish
    ],
    ids=["one-batch", "chunked", "max-seqs-3"],
)
def test_batched_requests_equal_one_at_a_time(tiny_llama_path, one_at_a_time, kw):
    engine = make_engine(tiny_llama_path, **kw)
    try:
        # staggered lengths so requests finish at different steps
        params = [SamplingParams(temperature=0.0, max_tokens=10 - i % 3, ignore_eos=True)
                  for i in range(len(PROMPTS))]
        outs = engine.generate(PROMPTS, params)
        for i, o in enumerate(outs):
            assert o.token_ids == one_at_a_time[i][: 10 - i % 3], f"prompt length {LENGTHS[i]}"
        assert_all_free(engine)
    finally:
        engine.shutdown()


def test_prefix_caching_on_and_off_give_the_same_tokens(tiny_llama_path, one_at_a_time):
    engine = make_engine(tiny_llama_path, enable_prefix_caching=True)
    try:
        first = engine.generate(PROMPTS, GREEDY)
        again = engine.generate(PROMPTS, GREEDY)  # now served from the prefix cache
        for i in range(len(PROMPTS)):
            assert first[i].token_ids == again[i].token_ids == one_at_a_time[i]
            full_blocks_before_last = (LENGTHS[i] - 1) // BS
            assert again[i].num_cached_tokens == full_blocks_before_last * BS
        stats = engine.stats()
        assert stats["prompt_tokens_cached_total"] == sum((n - 1) // BS * BS for n in LENGTHS)
        # A prompt extending a cached one (its prompt + its output) also matches.
        ext = PROMPTS[-1] + one_at_a_time[-1] + prompt(5, salt=9)
        cached = engine.generate([ext], GREEDY)[0]
        assert cached.num_cached_tokens >= len(PROMPTS[-1]) // BS * BS
        assert_all_free(engine)
    finally:
        engine.shutdown()
    cold = make_engine(tiny_llama_path, enable_prefix_caching=False)
    try:
        assert cold.generate([ext], GREEDY)[0].token_ids == cached.token_ids
    finally:
        cold.shutdown()


def test_preemption_keeps_tokens_identical(tiny_llama_path, one_at_a_time):
    # 20 blocks x 4 = 80 tokens of KV for prompts of 23 and 40 tokens plus 10 outputs each.
    engine = make_engine(tiny_llama_path, num_gpu_blocks_override=20, max_model_len=80)
    try:
        idx = [4, 5, 6, 3]
        outs = engine.generate([PROMPTS[i] for i in idx], GREEDY)
        for i, o in zip(idx, outs):
            assert o.token_ids == one_at_a_time[i], f"prompt length {LENGTHS[i]}"
        assert engine.stats()["num_preemptions_total"] > 0
        assert_all_free(engine)
    finally:
        engine.shutdown()


def _count_rounds(engine: LLMEngine) -> list[int]:
    """Wraps the runner so the test sees each step's ``num_steps``."""
    steps: list[int] = []
    runner = engine.core.runner
    inner = runner.execute

    def execute(sched):
        steps.append(sched.num_steps)
        return inner(sched)

    runner.execute = execute
    return steps


def test_multi_step_rounds_give_the_same_tokens(tiny_llama_path, one_at_a_time):
    """Rounds of 4 decode steps: same greedy tokens, requests that stop inside a round (by
    length or a stop token) keep only the tokens up to the stop, and all blocks come back."""
    stop_tok = one_at_a_time[-1][5]
    params = [SamplingParams(temperature=0.0, max_tokens=10 - i % 3, ignore_eos=True)
              for i in range(len(PROMPTS) - 1)]
    params.append(SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop_tok]))
    engine = make_engine(tiny_llama_path, num_scheduler_steps=4)
    try:
        rounds = _count_rounds(engine)
        outs = engine.generate(PROMPTS, params)
        assert 4 in rounds, f"no multi-step round was scheduled: {rounds}"
        for i, o in enumerate(outs[:-1]):
            assert o.token_ids == one_at_a_time[i][: 10 - i % 3], f"prompt length {LENGTHS[i]}"
            assert o.finish_reason == "length"
        last = outs[-1]
        cut = one_at_a_time[-1].index(stop_tok) + 1
        assert last.token_ids == one_at_a_time[-1][:cut]
        assert (last.finish_reason, last.stop_reason) == ("stop", stop_tok)
        assert engine.stats()["generation_tokens_total"] == sum(len(o.token_ids) for o in outs)
        assert_all_free(engine)
    finally:
        engine.shutdown()


def test_multi_step_rounds_stop_at_max_model_len_and_keep_seeded_sampling(tiny_llama_path):
    """A round is cut short at ``max_model_len``; seeded sampling draws the same tokens with
    and without rounds (each request's generator advances once per step either way)."""
    long_prompt = prompt(60, salt=3)
    sampled = [SamplingParams(temperature=1.0, seed=s, max_tokens=12, ignore_eos=True) for s in (1, 2)]
    results = []
    for steps in (1, 8):
        engine = make_engine(tiny_llama_path, max_model_len=70, num_scheduler_steps=steps)
        try:
            rounds = _count_rounds(engine)
            greedy_long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
            out = engine.generate([long_prompt, PROMPTS[2], PROMPTS[5]], [greedy_long] + sampled)
            results.append(([o.token_ids for o in out], [o.finish_reason for o in out]))
            if steps > 1:
                assert max(rounds) > 1
            assert_all_free(engine)
        finally:
            engine.shutdown()
    (single, single_reasons), (multi, multi_reasons) = results
    assert len(single[0]) == 70 - 60 and single_reasons[0] == "length"
    assert multi == single and multi_reasons == single_reasons


def _overlapped_steps(engine: LLMEngine) -> list[int]:
    """Wraps the runner's ``execute_async`` so the test sees how many decodes of each
    launched step took the previous step's token on the device."""
    fed: list[int] = []
    runner = engine.core.runner
    inner = runner.execute_async

    def execute_async(sched):
        fed.append(sum(sr.input_from_previous_step for sr in sched.scheduled))
        return inner(sched)

    runner.execute_async = execute_async
    return fed


def test_sampling_options_give_the_synchronous_tokens(tiny_llama_path, scheduling_mode):
    """Seeded sampling (with top-k / top-p / min-p, and twice the same seed, as ``n > 1``
    children), penalties, logprobs, ``min_tokens`` and stop tokens in one batch: the tokens,
    finish reasons and logprobs of the engine equal those of synchronous steps."""
    ref_engine = make_engine(tiny_llama_path, async_scheduling=False)
    try:
        ref_tokens = ref_engine.generate([PROMPTS[5]], GREEDY)[0].token_ids
    finally:
        ref_engine.shutdown()
    params = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, top_k=20, top_p=0.9, min_p=0.05, max_tokens=12,
                       ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[ref_tokens[3]]),
        SamplingParams(temperature=0.0, max_tokens=10, min_tokens=6, stop_token_ids=[ref_tokens[1]]),
        SamplingParams(temperature=0.0, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=11, max_tokens=8, repetition_penalty=1.3,
                       frequency_penalty=0.5, presence_penalty=0.2, ignore_eos=True),
    ]
    prompts = [PROMPTS[2], PROMPTS[2], PROMPTS[6], PROMPTS[5], PROMPTS[5], PROMPTS[3], PROMPTS[4]]
    results = []
    for async_scheduling in (False, scheduling_mode):
        engine = make_engine(tiny_llama_path, async_scheduling=async_scheduling)
        try:
            fed = _overlapped_steps(engine) if async_scheduling else []
            outs = engine.generate(prompts, params)
            results.append(outs)
            if async_scheduling:
                assert sum(fed) > 0, "no step was overlapped"
            assert_all_free(engine)
        finally:
            engine.shutdown()
    sync, tested = results
    for s, t in zip(sync, tested):
        assert (t.token_ids, t.finish_reason, t.stop_reason) == (s.token_ids, s.finish_reason,
                                                                 s.stop_reason)
        assert [(lp.token_id, [i for i, _ in lp.top]) for lp in t.logprobs] == \
            [(lp.token_id, [i for i, _ in lp.top]) for lp in s.logprobs]
        assert [lp.logprob for lp in t.logprobs] == pytest.approx([lp.logprob for lp in s.logprobs])
    assert tested[0].token_ids == tested[1].token_ids
    assert tested[3].finish_reason == "stop" and tested[3].token_ids == ref_tokens[:4]
    assert len(tested[4].token_ids) >= 6 and len(tested[5].logprobs) == 6
