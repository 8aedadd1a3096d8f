"""Overlapped scheduling (``async_scheduling``) over the fake runner, whose "device" work of a
launched step runs only when its result is read (engine_fakes.FakeModelRunner.execute_async):
a request that finishes or is aborted while its next step is in flight emits no extra token and
its blocks are neither reused nor leaked; P/D first tokens behave as in synchronous steps."""

from __future__ import annotations

import pytest

from tests.support.engine_fakes import (
    EOS,
    FakeRemote,
    add,
    assert_all_free,
    collect,
    drain,
    make_core,
    reference_generate,
    run_until_done,
)

REMOTE = {"remote": True}
KEEP = [1, 2, 3]


def steps_with(runner, rid: str) -> list:
    """The launched steps that scheduled ``rid``, in order."""
    return [sr for st in runner.steps for sr in st.scheduled if sr.request_id == rid]


def step_until(core, cond, results, max_steps: int = 100) -> None:
    for _ in range(max_steps):
        if cond():
            return
        collect(results, core.step()[0])
    raise AssertionError("condition not reached")


def test_decodes_take_the_previous_steps_token_and_match_the_reference():
    core, runner = make_core(async_scheduling=True, max_num_batched_tokens=16, max_num_seqs=3)
    prompts = {f"r{i}": [(7 * i + j) % 900 + 1 for j in range(3 + 5 * i)] for i in range(6)}
    for rid, p in prompts.items():
        add(core, rid, p, max_tokens=6, ignore_eos=True)
    res = run_until_done(core)
    for rid, p in prompts.items():
        assert res[rid].tokens == reference_generate(p, 6) and res[rid].finish_reason == "length"
    fed = [sr for st in runner.steps for sr in st.scheduled if sr.input_from_previous_step]
    assert len(fed) >= 4 * len(prompts), "decodes were not overlapped"
    # max_tokens is known ahead: no step computes a token past it
    for rid in prompts:
        assert len(steps_with(runner, rid)) <= 6 + 5  # prefill chunks + 5 decodes
    drain(core)
    assert_all_free(core)


def test_eos_at_step_n_with_step_n_plus_1_in_flight_emits_no_extra_token_and_keeps_blocks():
    """``a`` samples EOS while its next decode is already launched: that step's token is
    dropped, and ``a``'s blocks stay held until the step is done, so the remote load of ``b``,
    admitted right then, cannot land in a block the late step still writes (the fake runs the
    step's KV writes after the load)."""
    pa = [11, 12, 13, 14, 15, 16]
    first = reference_generate(pa, 1)[0]
    remote = FakeRemote(load_delay_steps=2)
    core, runner = make_core(num_blocks=12, remote=remote, async_scheduling=True,
                             enable_prefix_caching=False,
                             force=lambda rid, i: EOS if rid == "a" and i == 1 else None)
    kvm = core.scheduler.kv_cache_manager
    add(core, "a", pa, max_tokens=10)
    add(core, "keep", KEEP, max_tokens=12, ignore_eos=True)  # keeps the pipeline going
    results: dict = {}
    step_until(core, lambda: results.get("a") is not None and results["a"].finish_reason, results)
    assert results["a"].tokens == [first, EOS] and results["a"].finish_reason == "stop"
    extra = steps_with(runner, "a")[-1]
    assert extra.input_from_previous_step and extra.num_computed_tokens == 7  # the dropped step
    assert kvm.num_deferred_blocks == 2  # still held for the launched step
    pb = list(range(200, 214))  # its blocks: a's (freed first), then others
    add(core, "b", pb, kv_transfer_params=REMOTE, max_tokens=4)
    run_until_done(core, results)
    assert results["a"].tokens == [first, EOS]  # nothing after the stop
    assert results["b"].tokens == reference_generate(pb, 4)
    assert results["keep"].tokens == reference_generate(KEEP, 12)
    drain(core)
    assert kvm.num_deferred_blocks == 0
    assert_all_free(core)


def test_abort_with_a_step_in_flight_emits_nothing_more_and_frees_once():
    remote = FakeRemote(load_delay_steps=2)
    core, runner = make_core(num_blocks=24, remote=remote, async_scheduling=True,
                             enable_prefix_caching=False)
    pa = [21, 22, 23, 24, 25, 26]
    add(core, "a", pa, max_tokens=50, ignore_eos=True)
    add(core, "keep", KEEP, max_tokens=12, ignore_eos=True)
    results: dict = {}
    step_until(core, lambda: "a" in results and len(results["a"].tokens) >= 3, results)
    assert core.step_in_flight and steps_with(runner, "a")[-1].input_from_previous_step
    core.abort_requests(["a"])
    kvm = core.scheduler.kv_cache_manager
    assert kvm.num_deferred_blocks > 0  # the launched step may still write them
    emitted = list(results["a"].tokens)
    assert emitted == reference_generate(pa, len(emitted))
    pb = list(range(300, 314))
    add(core, "b", pb, kv_transfer_params=REMOTE, max_tokens=4)
    run_until_done(core, results)
    assert results["a"].tokens == emitted and results["a"].finish_reason is None
    assert results["b"].tokens == reference_generate(pb, 4)
    assert results["keep"].tokens == reference_generate(KEEP, 12)
    drain(core)
    assert_all_free(core)


def test_preemption_drains_the_pipeline_and_keeps_tokens_identical():
    core, runner = make_core(num_blocks=10, max_num_seqs=8, async_scheduling=True)
    prompts = {f"p{i}": [(13 * i + j) % 900 + 1 for j in range(5 + 3 * i)] for i in range(5)}
    for rid, p in prompts.items():
        add(core, rid, p, max_tokens=8, ignore_eos=True)
    res = run_until_done(core)
    assert core.stats()["num_preemptions_total"] > 0
    for rid, p in prompts.items():
        assert res[rid].tokens == reference_generate(p, 8)
    assert any(sr.input_from_previous_step for st in runner.steps for sr in st.scheduled)
    drain(core)
    assert_all_free(core)


def test_prefiller_first_token_finishes_without_a_second_step_and_leases_its_blocks():
    remote = FakeRemote()
    core, runner = make_core(remote=remote, async_scheduling=True, enable_prefix_caching=False)
    p = list(range(40, 50))
    add(core, "p", p, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    add(core, "other", [1, 2, 3], max_tokens=6, ignore_eos=True)
    res = run_until_done(core)
    assert res["p"].tokens == reference_generate(p, 1) and res["p"].finish_reason == "length"
    assert len(steps_with(runner, "p")) == 1  # max_tokens=1 is known: no step past it
    assert res["p"].kv_transfer_params["remote_block_ids"] == remote.finished_calls[0][1]
    assert res["other"].tokens == reference_generate([1, 2, 3], 6)
    kvm = core.scheduler.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_blocks - 3  # held for the decoder
    remote.release.add("p")
    drain(core)
    assert_all_free(core)


def test_decoder_emits_the_prefillers_first_token_then_decodes():
    p = list(range(60, 71))
    expected = reference_generate(p, 5)
    remote = FakeRemote(load_delay_steps=2, first_tokens={"d": expected[0]})
    core, runner = make_core(remote=remote, async_scheduling=True)
    add(core, "local", [5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    res: dict = {}
    collect(res, core.step()[0])
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=5)
    run_until_done(core, res)
    assert res["d"].tokens == expected and res["d"].num_transferred_tokens == len(p)
    first_d = steps_with(runner, "d")[0]
    assert first_d.num_computed_tokens == len(p) and first_d.token_ids == [expected[0]]
    assert res["local"].tokens == reference_generate([5, 6, 7, 8], 12)
    drain(core)
    assert_all_free(core)


@pytest.mark.parametrize("max_tokens", [1, 4])
def test_decoder_emits_the_prefillers_first_token_while_its_kv_still_loads(max_tokens):
    """The first token comes from the lease claim's answer, not from the local KV: it goes out
    in the step that reports it, while the blocks are still read; a token that finishes the
    request waits for the load (a finished request's blocks must have landed before anyone
    may be offered them)."""
    p = list(range(60, 71))
    expected = reference_generate(p, max_tokens)
    remote = FakeRemote(load_delay_steps=3, first_tokens={"d": expected[0]})
    core, runner = make_core(remote=remote)
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=max_tokens)
    res: dict = {}
    loaded_when_first = None
    for _ in range(50):
        collect(res, core.step()[0])
        if loaded_when_first is None and "d" in res and res["d"].tokens:
            loaded_when_first = any("d" in o.finished_recving for o in remote.outputs_seen)
        if "d" in res and res["d"].finish_reason is not None:
            break
    assert res["d"].tokens == expected and res["d"].num_transferred_tokens == len(p)
    assert loaded_when_first is (max_tokens == 1)
    drain(core)
    assert_all_free(core)


def test_a_first_token_reported_at_a_launch_goes_out_before_the_running_step_is_read():
    """The connector's report is taken at a step's launch and does not depend on the step's
    device work: a prefiller's first token it brings is sent through ``core.emit`` in the very
    ``step()`` call that launched the step, before the host waits for the step in flight (not
    a call later, with the launched step's tokens), while a running decode keeps the pipeline
    two deep. The tokens are unchanged."""
    p = list(range(60, 71))
    expected = reference_generate(p, 4)
    remote = FakeRemote(load_delay_steps=3, first_tokens={"d": expected[0]})
    core, runner = make_core(remote=remote, async_scheduling=True)
    res: dict = {}
    order: list[str] = []  # what happened, in order: "emit:<ids>", "read" (a wait for a step)

    def emit(outs):
        order.append("emit:" + ",".join(o.request_id for o in outs))
        collect(res, outs)

    core.emit = emit
    launch = runner.execute_async

    def execute_async(sched):
        pending = launch(sched)
        result = pending.result
        pending.result = lambda: (order.append("read"), result())[1]
        return pending

    runner.execute_async = execute_async
    add(core, "local", [5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    collect(res, core.step()[0])
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=4)
    for _ in range(50):
        seen, order[:] = len(remote.outputs_seen), []
        outputs, _ = core.step()
        collect(res, outputs)
        if any("d" in o.first_tokens for o in remote.outputs_seen[seen:]):
            assert order[:2] == ["emit:d", "read"]  # out before the wait for the running step
            assert all(o.request_id != "d" for o in outputs)  # and only once
            assert res["d"].tokens == expected[:1]
            break
    else:
        raise AssertionError("the first token was never reported")
    assert core.step_in_flight
    run_until_done(core, res)
    assert res["d"].tokens == expected
    assert res["local"].tokens == reference_generate([5, 6, 7, 8], 12)
    drain(core)
    assert_all_free(core)
