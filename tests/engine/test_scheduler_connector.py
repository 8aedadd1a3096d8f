"""Scheduler <-> KV connector hooks with a fake connector whose "remote instance" writes the
right KV (or garbage into poisoned blocks) into the fake runner's cache."""

from __future__ import annotations

import pytest

from tests.support.engine_fakes import (
    FakeRemote,
    add,
    assert_all_free,
    drain,
    make_core,
    reference_generate,
    run_until_done,
)
from pdserve.types.request import RequestStatus
from pdserve.types.outputs import KVLoadError, KVLoadFailure

REMOTE = {"remote": True}


pytestmark = pytest.mark.usefixtures("scheduling_mode")


def test_remote_load_waits_then_computes_only_the_last_token():
    remote = FakeRemote(load_delay_steps=3)
    core, runner = make_core(remote=remote)
    p = list(range(100, 110))
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=5)
    add(core, "local", [1, 2, 3], max_tokens=5)
    core.step()
    sched = core.scheduler
    assert sched.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert len(sched.requests["d"].block_ids) == 3  # blocks for all 10 tokens
    assert runner.steps[0].scheduled[0].request_id == "local"  # others keep running meanwhile
    assert remote.alloc_calls[0][0] == "d" and remote.alloc_calls[0][2] == 10
    assert remote.added == ["d", "local"]
    res = run_until_done(core)
    assert res["d"].tokens == reference_generate(p, 5)
    assert res["d"].num_transferred_tokens == 9
    first_d = next(s for st in runner.steps for s in st.scheduled if s.request_id == "d")
    assert first_d.num_computed_tokens == 9 and first_d.token_ids == [p[-1]]
    st = core.stats()
    assert st["prompt_tokens_transferred_total"] == 9
    assert st["prompt_tokens_computed_total"] == 1 + 3
    assert_all_free(core)


def test_local_prefix_hit_then_remote_rest():
    remote = FakeRemote(load_delay_steps=1)
    core, _ = make_core(remote=remote)
    shared = list(range(50, 58))  # two full blocks
    add(core, "warm", shared + [1, 2], max_tokens=2)
    run_until_done(core)
    p = shared + list(range(60, 67))
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=4)
    res = run_until_done(core)
    assert ("d", 8) in remote.matched_calls  # connector asked after the local hit
    assert res["d"].tokens == reference_generate(p, 4)
    assert res["d"].num_cached_tokens == 8 and res["d"].num_transferred_tokens == 6
    assert_all_free(core)


def test_connector_is_consulted_once_even_when_blocked_or_preempted():
    remote = FakeRemote(load_delay_steps=1)
    core, _ = make_core(remote=remote, num_blocks=6)
    add(core, "a", [1] * 6, max_tokens=12)
    add(core, "b", [2] * 6, max_tokens=12)
    res = run_until_done(core)
    assert core.stats()["num_preemptions_total"] >= 1
    assert sorted(rid for rid, _ in remote.matched_calls) == ["a", "b"]
    assert res["b"].tokens == reference_generate([2] * 6, 12)
    drain(core)
    assert_all_free(core)


@pytest.mark.parametrize("length", [10, 12])
def test_invalid_blocks_fail_policy_finishes_with_error(length):
    remote = FakeRemote(load_delay_steps=2, poison={"d": {1}})
    core, _ = make_core(remote=remote, kv_load_failure_policy="fail")
    p = list(range(200, 200 + length))
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=4)
    add(core, "other", [5, 6, 7], max_tokens=4)
    res = run_until_done(core)
    assert res["d"].finish_reason == "error" and res["d"].tokens == []  # never tokens from bad KV
    assert "kv_load_failure_policy" in res["d"].error
    assert res["other"].tokens == reference_generate([5, 6, 7], 4)
    st = core.stats()
    assert st["num_kv_load_failures_total"] == 1
    assert st["prompt_tokens_computed_total"] == 3
    assert remote.finished_calls[0][0] == "d"
    drain(core)
    assert_all_free(core)


def test_failed_load_error_names_the_reason():
    err = KVLoadError(KVLoadFailure.LEASE_REFUSED, "request 'p1' holds no blocks any more")
    remote = FakeRemote(load_delay_steps=1, poison={"d": {0}}, load_error=err)
    core, _ = make_core(remote=remote, kv_load_failure_policy="fail")
    add(core, "d", list(range(200, 210)), kv_transfer_params=REMOTE, max_tokens=4)
    res = run_until_done(core)
    assert res["d"].finish_reason == "error"
    assert "lease refused: request 'p1' holds no blocks any more" in res["d"].error
    assert "kv_load_failure_policy" in res["d"].error
    drain(core)
    assert_all_free(core)


@pytest.mark.parametrize("reason", [*KVLoadFailure, None],
                         ids=lambda r: r.name.lower() if r else "no_reason")
def test_failed_load_error_names_the_cause_not_a_local_block(reason):
    """The worker's reason is the cause (engine mismatch, refused lease, transport, timeout,
    invalid reference); the message names the request, not D's first invalid block. Only a
    failure without a reason names that block."""
    err = KVLoadError(reason, "the owner said no") if reason else None
    remote = FakeRemote(load_delay_steps=1, poison={"d": {1}}, load_error=err)
    core, _ = make_core(remote=remote, kv_load_failure_policy="fail")
    add(core, "d", list(range(200, 210)), kv_transfer_params=REMOTE, max_tokens=4)
    res = run_until_done(core)
    message = res["d"].error
    assert res["d"].kv_load_failure is reason  # the front end's HTTP status depends on it
    if reason is None:
        assert "(block " in message and " of request d)" in message, message
    else:
        assert f"{reason.value}: the owner said no (request d)" in message, message
        assert "block" not in message, message
    drain(core)
    assert_all_free(core)


@pytest.mark.parametrize("bad_index", [0, 1, 2])
def test_invalid_blocks_recompute_policy_gives_correct_tokens(bad_index):
    remote = FakeRemote(load_delay_steps=1, poison={"d": {bad_index}})
    core, runner = make_core(remote=remote, kv_load_failure_policy="recompute")
    p = list(range(300, 311))  # blocks 0,1 full, block 2 partial
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=5)
    res = run_until_done(core)
    assert res["d"].tokens == reference_generate(p, 5)
    assert res["d"].finish_reason == "length"
    assert res["d"].num_transferred_tokens == 4 * bad_index
    first = next(s for st in runner.steps for s in st.scheduled if s.request_id == "d")
    assert first.num_computed_tokens == 4 * bad_index  # rolled back to the first invalid block
    st = core.stats()
    assert st["prompt_tokens_computed_total"] == 11 - 4 * bad_index
    assert st["prompt_tokens_transferred_total"] == 4 * bad_index
    # A later request must not hit the invalid block through the prefix cache.
    add(core, "again", p, max_tokens=5)
    res = run_until_done(core, res)
    assert res["again"].tokens == reference_generate(p, 5)
    assert_all_free(core)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("held", [1, 2])
def test_a_partial_load_computes_the_rest_and_is_no_failure(policy, held):
    """The owner held only the load's first ``held`` blocks (``partial_loads``; the others got
    garbage): the request computes from the block after them, in the blocks it holds, whatever
    the failure policy; no failure is counted and the loaded blocks enter the prefix cache."""
    remote = FakeRemote(load_delay_steps=1, partial={"d": held})
    core, runner = make_core(remote=remote, kv_load_failure_policy=policy)
    shared = list(range(50, 54))  # one full block of P's own
    add(core, "warm", shared + [1], max_tokens=1)
    run_until_done(core)
    p = shared + list(range(400, 411))  # the load: blocks 1, 2 (full) and 3 (3 tokens)
    add(core, "d", p, kv_transfer_params=REMOTE, max_tokens=5)
    res = run_until_done(core)
    assert res["d"].tokens == reference_generate(p, 5) and res["d"].finish_reason == "length"
    first = next(s for st in runner.steps for s in st.scheduled if s.request_id == "d")
    assert first.num_computed_tokens == 4 * (1 + held)  # P's block and the loaded ones
    allocated = next(blocks for rid, blocks, _ in remote.alloc_calls if rid == "d")
    assert first.block_ids[:len(allocated)] == allocated  # computed in the blocks it holds
    assert res["d"].num_cached_tokens == 4 and res["d"].num_transferred_tokens == 4 * held
    st = core.stats()
    assert st["num_kv_load_failures_total"] == 0 and st["num_kv_partial_loads_total"] == 1
    assert st["prompt_tokens_transferred_total"] == 4 * held
    # the loaded blocks are in the prefix cache, with the right KV
    add(core, "again", p, max_tokens=5)
    res = run_until_done(core, res)
    assert res["again"].tokens == reference_generate(p, 5)
    assert res["again"].num_cached_tokens >= 4 * (1 + held)
    assert_all_free(core)


def test_delay_free_keeps_blocks_until_finished_sending():
    remote = FakeRemote()
    core, _ = make_core(remote=remote, enable_prefix_caching=False)
    p = list(range(20, 30))
    add(core, "p", p, kv_transfer_params={"do_remote_decode": True}, max_tokens=1)
    res = run_until_done(core)
    assert res["p"].tokens == reference_generate(p, 1)
    params = res["p"].kv_transfer_params
    assert params["remote_request_id"] == "p" and len(params["remote_block_ids"]) == 3
    kvm = core.scheduler.kv_cache_manager
    assert kvm.num_free_blocks == kvm.num_blocks - 3
    assert core.scheduler.has_pending_kv_work() and not core.scheduler.has_unfinished_requests()
    for _ in range(3):  # polling alone does not free them
        core.step()
    assert kvm.num_free_blocks == kvm.num_blocks - 3
    assert core.stats()["num_held_for_transfer"] == 1
    remote.release.add("p")
    core.step()
    assert not core.scheduler.has_pending_kv_work()
    assert_all_free(core)


def test_abort_after_the_finish_ends_the_hold_for_the_reader(scheduling_mode):
    """A finished prefill whose blocks are held for a reader is aborted by its front end (the
    client left before it got the params): the connector ends the hold at once and the blocks
    come back; aborting an id that holds nothing does not call it."""
    remote = FakeRemote()
    core, _ = make_core(remote=remote, enable_prefix_caching=False)
    add(core, "p", list(range(20, 30)), kv_transfer_params={"do_remote_decode": True},
        max_tokens=1)
    add(core, "q", list(range(40, 45)), max_tokens=1)
    run_until_done(core)
    assert core.stats()["num_held_for_transfer"] == 1
    core.abort_requests(["q", "unknown"])
    assert remote.released_kept == []
    core.abort_requests(["p"])
    assert remote.released_kept == ["p"]
    core.step()
    assert not core.scheduler.has_pending_kv_work()
    assert_all_free(core)


def test_abort_while_waiting_for_remote_kvs_frees_after_the_load_ends():
    remote = FakeRemote(load_delay_steps=50)
    core, runner = make_core(remote=remote)
    add(core, "d", list(range(40, 50)), kv_transfer_params=REMOTE, max_tokens=3)
    core.step()
    assert core.scheduler.requests["d"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    core.abort_requests(["d"])
    assert remote.finished_calls == [("d", core.scheduler.remote_kv.held["d"].request.block_ids)]
    kvm = core.scheduler.kv_cache_manager
    assert kvm.num_free_blocks < kvm.num_blocks  # the load may still write into them
    assert core.scheduler.has_pending_kv_work()
    core.step()  # the worker sees "d" in finished_request_ids and reports it in finished_recving
    drain(core)
    assert_all_free(core)
    assert core.stats()["num_waiting_for_remote_kvs"] == 0


def test_abort_before_the_remote_load_was_scheduled_tells_the_connector():
    remote = FakeRemote()
    core, _ = make_core(remote=remote, max_num_seqs=1)
    add(core, "busy", [1, 2], max_tokens=20)
    core.step()
    add(core, "d", list(range(40, 50)), kv_transfer_params=REMOTE, max_tokens=3)
    core.abort_requests(["d"])
    assert remote.finished_calls == [("d", [])]
    core.abort_requests(["busy"])
    drain(core)
    assert_all_free(core)


def test_connector_stats_are_collected_per_step():
    remote = FakeRemote(load_delay_steps=1)
    core, _ = make_core(remote=remote)
    add(core, "d", list(range(40, 50)), kv_transfer_params=REMOTE, max_tokens=2)
    run_until_done(core)
    assert core.take_connector_stats() == [{"num_loads_done": 1}]
    assert core.take_connector_stats() == []
    assert remote.outputs_seen  # update_connector_output was called


@pytest.mark.parametrize("policy", ["none", "fail", "recompute"])
def test_synchronous_load_in_the_same_step(policy):
    poison = {} if policy == "none" else {"d": {1}}
    remote = FakeRemote(load_delay_steps=1, poison=poison)
    core, runner = make_core(remote=remote, kv_load_failure_policy="recompute" if policy == "none" else policy)
    p = list(range(400, 410))
    add(core, "d", p, kv_transfer_params={"remote_sync": True}, max_tokens=4)
    res = run_until_done(core)
    first = runner.steps[0].scheduled[0]
    assert first.num_computed_tokens == 9 and first.token_ids == [p[-1]]
    if policy == "fail":
        assert res["d"].finish_reason == "error" and res["d"].tokens == []
    else:
        assert res["d"].tokens == reference_generate(p, 4)
        assert res["d"].num_transferred_tokens == (9 if policy == "none" else 4)
        assert core.stats()["prompt_tokens_computed_total"] == (1 if policy == "none" else 6)
    drain(core)
    assert_all_free(core)
