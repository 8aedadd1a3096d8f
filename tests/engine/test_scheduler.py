"""Scheduler + EngineCore over a fake runner that reads its KV back through the block table: any
scheduling or block-table mistake changes the tokens (see engine_fakes)."""

from __future__ import annotations

import random

import pytest

from tests.support.engine_fakes import (
    EOS,
    add,
    assert_all_free,
    collect,
    make_core,
    reference_generate,
    run_until_done,
)
from pdserve.types.engine_config import EvictionPolicy
from pdserve.types.request import RequestStatus


pytestmark = pytest.mark.usefixtures("scheduling_mode")


def prompts(n: int, seed: int = 0, lo: int = 1, hi: int = 30) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 900) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def test_single_request_matches_reference():
    core, _ = make_core()
    p = [5, 6, 7, 8, 9]
    add(core, "a", p, max_tokens=7)
    res = run_until_done(core)
    assert res["a"].tokens == reference_generate(p, 7)
    assert res["a"].finish_reason == "length"
    assert_all_free(core)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_requests_match_reference_and_step_limits_hold(prefix_caching):
    core, runner = make_core(max_num_batched_tokens=16, max_num_seqs=3, enable_prefix_caching=prefix_caching)
    ps = prompts(8, seed=1)
    for i, p in enumerate(ps):
        add(core, f"r{i}", p, max_tokens=6)
    res = run_until_done(core)
    for i, p in enumerate(ps):
        assert res[f"r{i}"].tokens == reference_generate(p, 6), i
    for step in runner.steps:
        assert step.total_num_scheduled_tokens == sum(len(s.token_ids) for s in step.scheduled) <= 16
        assert len(step.scheduled) <= 3
    s = core.stats()
    assert s["prompt_tokens_total"] == sum(map(len, ps))
    assert s["generation_tokens_total"] == 6 * len(ps)
    assert_all_free(core)


def test_chunked_prefill_splits_a_long_prompt():
    core, runner = make_core(max_num_batched_tokens=8)
    p = list(range(100, 130))
    add(core, "long", p, max_tokens=3)
    res = run_until_done(core)
    assert res["long"].tokens == reference_generate(p, 3)
    chunks = [s.scheduled[0] for s in runner.steps]
    assert [len(c.token_ids) for c in chunks[:4]] == [8, 8, 8, 6]
    assert [c.sample for c in chunks[:4]] == [False, False, False, True]
    assert core.stats()["prompt_tokens_computed_total"] == 30
    assert_all_free(core)


def test_decodes_are_scheduled_before_a_long_prefill():
    core, runner = make_core(max_num_batched_tokens=8)
    add(core, "short", [1, 2, 3], max_tokens=10)
    core.step()  # short prefilled, now decoding
    add(core, "long", list(range(200, 240)), max_tokens=2)
    for _ in range(4):
        core.step()
        last = runner.steps[-1]
        assert last.scheduled[0].request_id == "short" and len(last.scheduled[0].token_ids) == 1
        assert last.total_num_scheduled_tokens == 8  # long prefill fills the rest of the budget
    res = run_until_done(core)
    assert_all_free(core)
    assert res["long"].tokens == reference_generate(list(range(200, 240)), 2)


def test_max_num_seqs_limits_running_requests():
    core, runner = make_core(max_num_seqs=2)
    for i, p in enumerate(prompts(5, seed=2)):
        add(core, f"r{i}", p, max_tokens=4)
    seen_running = []
    run_until_done(core, on_step=lambda _: seen_running.append(len(core.scheduler.queues.running)))
    assert max(seen_running) == 2
    assert all(len(s.scheduled) <= 2 for s in runner.steps)
    assert_all_free(core)


def test_preemption_under_a_tiny_block_budget_keeps_tokens_identical():
    # 10 blocks of 4 tokens; 4 requests that each end at 8..20 tokens must take turns.
    core, _ = make_core(num_blocks=10, max_num_seqs=8)
    ps = prompts(4, seed=3, lo=4, hi=8)
    for i, p in enumerate(ps):
        add(core, f"r{i}", p, max_tokens=12)
    res = run_until_done(core)
    for i, p in enumerate(ps):
        assert res[f"r{i}"].tokens == reference_generate(p, 12), i
    assert core.stats()["num_preemptions_total"] > 0
    assert_all_free(core)


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preempted_requests_recompute_including_output(prefix_caching):
    core, runner = make_core(num_blocks=6, enable_prefix_caching=prefix_caching)
    a, b = [1] * 6, [2] * 6
    add(core, "a", a, max_tokens=10)
    add(core, "b", b, max_tokens=10)
    res = run_until_done(core)
    assert res["a"].tokens == reference_generate(a, 10)
    assert res["b"].tokens == reference_generate(b, 10)
    assert core.stats()["num_preemptions_total"] >= 1
    # A resumed request recomputes generated tokens in one chunk (beyond what the prefix cache
    # still holds).
    assert any(
        len(s.token_ids) > 1 and s.num_computed_tokens + len(s.token_ids) > 7
        for st in runner.steps for s in st.scheduled
    )
    assert_all_free(core)


def test_prefix_cache_hits_are_reused_and_counted():
    core, runner = make_core()
    shared = list(range(300, 313))  # 13 tokens: 3 full blocks
    add(core, "a", shared + [1, 2], max_tokens=3)
    res = run_until_done(core)
    add(core, "b", shared + [7], max_tokens=3)
    res = run_until_done(core, res)
    assert res["b"].tokens == reference_generate(shared + [7], 3)
    assert res["b"].num_cached_tokens == 12
    assert runner.steps[-3].scheduled[0].num_computed_tokens == 12
    s = core.stats()
    assert s["prompt_tokens_cached_total"] == 12
    assert s["prompt_tokens_computed_total"] == 15 + 2
    assert_all_free(core)


def _chats_in_turn(eviction: EvictionPolicy) -> int:
    """Six conversations of four turns revisited in turn through a cache of 28 blocks of 4
    tokens, which holds about half of their histories (20 tokens, then 4 more a turn); every
    answer is checked against the reference. Returns the prompt tokens found in the prefix
    cache."""
    core, _ = make_core(num_blocks=28, prefix_cache_eviction=eviction)
    histories = [[c * 100 + i for i in range(20)] for c in range(6)]
    res: dict = {}
    for turn in range(4):
        for c, history in enumerate(histories):
            prompt = history + [c * 100 + 50 + turn]
            add(core, f"{c}-{turn}", prompt, max_tokens=3)
            res = run_until_done(core, res)
            answer = res[f"{c}-{turn}"].tokens
            assert answer == reference_generate(prompt, 3), (c, turn)
            histories[c] = prompt + answer
    assert_all_free(core)
    assert core.scheduler.kv_cache_manager.eviction is eviction
    return core.stats()["prompt_tokens_cached_total"]


def test_chats_revisited_in_turn_match_the_reference_under_both_eviction_orders():
    lru = _chats_in_turn(EvictionPolicy.LRU)
    depth_first = _chats_in_turn(EvictionPolicy.DEPTH_FIRST)
    # LRU loses each history just before its turn; depth first keeps their leading blocks
    assert depth_first > 10 * lru


def test_identical_prompt_recomputes_at_least_the_last_token():
    core, runner = make_core()
    p = list(range(8))  # block aligned
    add(core, "a", p, max_tokens=2)
    res = run_until_done(core)
    add(core, "b", p, max_tokens=2)
    res = run_until_done(core, res)
    assert res["b"].tokens == res["a"].tokens == reference_generate(p, 2)
    assert res["b"].num_cached_tokens == 4
    assert_all_free(core)


def test_stop_on_eos_min_tokens_and_ignore_eos():
    core, _ = make_core(force=lambda rid, i: EOS if i >= 1 else None)
    p = [3, 4, 5]
    add(core, "eos", p, max_tokens=10)
    add(core, "min", p, max_tokens=10, min_tokens=3)
    add(core, "ign", p, max_tokens=5, ignore_eos=True)
    res = run_until_done(core)
    assert res["eos"].tokens == reference_generate(p, 1) + [EOS]
    assert res["eos"].finish_reason == "stop" and res["eos"].stop_reason is None
    assert len(res["min"].tokens) == 3 and res["min"].finish_reason == "stop"
    assert len(res["ign"].tokens) == 5 and res["ign"].finish_reason == "length"
    assert_all_free(core)


def test_stop_token_ids_and_max_model_len():
    p = [10, 11, 12]
    expected = reference_generate(p, 8)
    core, _ = make_core(max_model_len=7)
    add(core, "stoptok", p, max_tokens=8, stop_token_ids=[expected[2]])
    add(core, "mml", p, max_tokens=8)
    res = run_until_done(core)
    assert res["stoptok"].tokens == expected[:3]
    assert res["stoptok"].finish_reason == "stop" and res["stoptok"].stop_reason == expected[2]
    assert res["mml"].tokens == expected[:4] and res["mml"].finish_reason == "length"
    assert_all_free(core)


def test_invalid_requests_are_rejected_with_a_reason():
    core, _ = make_core(num_blocks=8, max_model_len=20)
    assert "at least one token" in add(core, "empty", []).error
    assert "max_model_len" in add(core, "long", list(range(21))).error
    assert "out of range" in add(core, "vocab", [1, 5000]).error
    assert "temperature" in add(core, "temp", [1], temperature=-1).error
    add(core, "ok", [1, 2])
    assert "already in use" in add(core, "ok", [1]).error
    assert core.stats()["num_waiting"] == 1
    core.abort_requests(["ok"])
    assert_all_free(core)


def test_default_max_model_len_is_capped_by_the_kv_cache():
    core, _ = make_core(num_blocks=5, max_position_embeddings=4096)
    assert core.max_model_len == 20
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        make_core(num_blocks=5, max_model_len=64)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_core(max_model_len=64, max_position_embeddings=32)


def test_long_request_alone_in_a_tiny_cache_finishes_by_length():
    core, _ = make_core(num_blocks=3)
    p = [1, 2, 3, 4, 5]
    add(core, "a", p, max_tokens=100)
    res = run_until_done(core)
    assert res["a"].finish_reason == "length" and len(p) + len(res["a"].tokens) == 12
    assert res["a"].tokens == reference_generate(p, 7)
    assert_all_free(core)


def step_until(core, cond, results=None, max_steps=200):
    results = {} if results is None else results
    for _ in range(max_steps):
        if cond():
            return results
        collect(results, core.step()[0])
    raise AssertionError("condition not reached")


def test_abort_while_waiting_prefilling_and_decoding():
    core, _ = make_core(num_blocks=12, max_num_batched_tokens=8, max_num_seqs=2)
    add(core, "decoding", [1, 2, 3], max_tokens=50)
    add(core, "prefilling", list(range(40, 60)), max_tokens=50)
    add(core, "waiting", [9, 9], max_tokens=5)
    core.step()
    core.step()
    reqs = core.scheduler.requests
    assert reqs["decoding"].num_output_tokens >= 1
    assert 0 < reqs["prefilling"].num_computed_tokens < 20
    assert reqs["waiting"].status == RequestStatus.WAITING
    core.abort_requests(["prefilling", "waiting", "decoding", "unknown-id"])
    assert not core.scheduler.has_unfinished_requests()
    out, _ = core.step()  # reports the finished ids to the runner; aborts produce no output
    assert out == []
    assert_all_free(core)


def test_abort_while_preempted():
    core, _ = make_core(num_blocks=6, max_num_seqs=4)
    add(core, "old", [1] * 6, max_tokens=16)
    add(core, "young", [2] * 6, max_tokens=16)
    reqs = core.scheduler.requests
    res = step_until(core, lambda: reqs["young"].status == RequestStatus.PREEMPTED)
    assert reqs["young"].block_ids == []
    core.abort_requests(["young"])
    res = run_until_done(core, res)
    assert res["old"].tokens == reference_generate([1] * 6, 16)
    assert "young" not in res or res["young"].finish_reason is None
    assert_all_free(core)


def test_step_reports_finished_ids_to_the_runner():
    core, runner = make_core()
    add(core, "a", [1, 2, 3], max_tokens=1)
    core.step()
    sched_out = core.scheduler.schedule()
    assert sched_out.finished_request_ids == {"a"}
