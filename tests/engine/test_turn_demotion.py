"""A decoder's held turn blocks under GPU pressure (pdserve/engine/turn_demotion.py): demoted to
the host tier, restored for the next turn's reader, never served with foreign KV, never leaked.

The engine runs over the tiered fake runner (its KV is ``(position, token)`` pairs, copied to and
from the fake host pool exactly as the tier jobs say); the connector holds every finished
request's blocks under a turn lease in the real lease table (tests/support/turn_fakes.py). The
oracle: what the reader reads from the blocks a granted claim names equals the turn's own
``(position, token)`` pairs, and every answer equals :func:`reference_generate`.
"""

from __future__ import annotations

import time

import pytest

from pdserve.engine.turn_demotion import TurnState
from pdserve.kv_transfer.nixl.leases import ClaimStatus
from pdserve.types.remote_ref import token_digest
from tests.support.engine_fakes import add, assert_all_free, drain, reference_generate, run_until_done
from tests.support.turn_fakes import finish_turns, make_turn_core, turn_prompt as prompt

pytestmark = pytest.mark.usefixtures("scheduling_mode")

BS = 4




def test_held_turns_are_demoted_under_pressure_and_read_back_from_the_host_tier():
    core, runner, reader = make_turn_core(num_blocks=20)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})  # 7 blocks held each
    assert sched.kv_cache_manager.num_free_blocks == 20 - 14
    # a request that needs 12 blocks: only the oldest turn's demotion makes room
    big = prompt(3, 40)
    add(core, "c", big, max_tokens=4)
    assert run_until_done(core)["c"].tokens == reference_generate(big, 4)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    assert sched.demoter.state("b") is None  # one demotion was enough
    assert sched.stats()["kv_turns"]["turns_demoted"] == 1
    # "c" evicted some of a's cached blocks into the host tier: the claim waits while they
    # come back, then names the blocks that hold them now
    status, blocks = reader.claim("a")
    assert status is ClaimStatus.OK
    held_tokens = len(reader.sched.advertised["a"][1])
    full = held_tokens // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    turns = sched.stats()["kv_turns"]
    assert turns["turns_restored"] == 1 and turns["turn_blocks_from_tiers"] > 0
    reader.notify("a", "done", blocks)
    reader.abort_all()
    drain(core)
    assert len(reader.worker.leases) == 0
    assert sched.demoter.state("a") is None
    assert_all_free(core)
    sched.tiers.check_consistency()


def _demote_a_by_a_small_request(core) -> None:
    """Finish turns "a" and "b" (7 blocks held each of 20), then run "c", a 7-block request with
    6 blocks free: "a", the oldest turn, is demoted; its partial block (uncached, reused first)
    is all "c" takes of it, so its full blocks stay cached on the GPU."""
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    small = prompt(4, 26)
    add(core, "c", small, max_tokens=2)
    assert run_until_done(core)["c"].tokens == reference_generate(small, 2)
    assert core.scheduler.demoter.state("a") is TurnState.DEMOTED


def test_a_restore_from_the_gpu_prefix_cache_needs_no_copy():
    core, runner, reader = make_turn_core(num_blocks=20)
    sched = core.scheduler
    _demote_a_by_a_small_request(core)
    status, blocks = reader.claim("a")
    assert status is ClaimStatus.OK
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    assert sched.stats()["kv_turns"]["turn_blocks_from_tiers"] == 0
    reader.notify("a", "done", blocks)
    reader.abort_all()
    drain(core)
    assert_all_free(core)


def test_a_claimed_lease_is_not_demoted_and_the_request_waits_for_its_read():
    core, runner, reader = make_turn_core(num_blocks=16)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22)})
    status, blocks = reader.claim("a")  # the reader's READ may be under way
    assert status is ClaimStatus.OK and blocks == reader.sched.advertised["a"][0]
    big = prompt(3, 40)  # 11 blocks: 9 are free
    add(core, "c", big, max_tokens=4)
    for _ in range(10):
        core.step()
    assert sched.demoter.state("a") is TurnState.KEPT  # asked, refused: still held
    assert sched.queues.waiting and sched.queues.waiting[0].request_id == "c"
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    reader.notify("a", "done", blocks)
    assert run_until_done(core)["c"].tokens == reference_generate(big, 4)
    reader.abort_all()
    drain(core)
    assert sched.demoter.state("a") is None and sched.stats()["kv_turns"]["turns_demoted"] == 0
    assert_all_free(core)


def test_blocks_gone_from_every_tier_reject_the_claim():
    core, runner, reader = make_turn_core(num_blocks=20, host_blocks=1)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    big = prompt(3, 76)  # every block: a's and b's cached blocks are all evicted
    add(core, "c", big, max_tokens=2)
    assert run_until_done(core)["c"].tokens == reference_generate(big, 2)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    hashes = sched.kv_cache_manager.block_hashes(reader.sched.advertised["a"][1])
    assert sched.kv_cache_manager.cached_prefix(hashes) == []
    # the one host slot keeps the last evicted block, a's first or not: gone too
    assert sched.tiers.clear()
    status, _ = reader.claim("a")
    assert status is ClaimStatus.REJECT  # the reader recomputes; nothing foreign is served
    assert sched.stats()["kv_turns"]["turns_lost"] == 1
    reader.abort_all()
    drain(core)
    assert len(reader.worker.leases) == 0
    assert_all_free(core)


def test_a_demoted_lease_still_ends_at_its_ttl():
    core, runner, reader = make_turn_core(num_blocks=20, ttl_s=0.3)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    big = prompt(3, 40)
    add(core, "c", big, max_tokens=2)
    run_until_done(core)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    core.step()  # c's lease starts
    time.sleep(0.35)
    drain(core)  # every lease expired, "a" demoted or not
    assert len(reader.worker.leases) == 0 and sched.demoter.state("a") is None
    assert reader.claim("a")[0] is ClaimStatus.REJECT
    assert_all_free(core)


def test_a_lease_aborted_while_its_blocks_load_frees_them_when_the_loads_end():
    core, runner, reader = make_turn_core(num_blocks=20, load_delay_steps=3)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    big = prompt(3, 40)
    add(core, "c", big, max_tokens=4)
    run_until_done(core)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    assert reader.claim("a", max_steps=1)[0] is ClaimStatus.WAIT  # the restore starts, its loads are slow
    for _ in range(20):
        if sched.demoter.state("a") is not TurnState.DEMOTED:
            break
        core.step()
    assert sched.demoter.state("a") is TurnState.RESTORING
    reader.notify("a", "abort", reader.sched.advertised["a"][0])
    core.step()
    assert sched.demoter.state("a") is TurnState.ENDED
    reader.abort_all()
    drain(core)
    for _ in range(5):
        core.step()
    assert sched.demoter.state("a") is None and sched.demoter.num_held_blocks == 0
    assert_all_free(core)


def test_a_claimed_turn_that_never_finds_blocks_is_given_up():
    import pdserve.engine.turn_demotion as td

    core, runner, reader = make_turn_core(num_blocks=20)
    sched = core.scheduler
    now = [0.0]
    sched.demoter._clock = lambda: now[0]
    finish_turns(core, {"a": prompt(1, 22)})
    big = prompt(3, 72)  # "a" is demoted for it, then "c" holds every block while it decodes
    add(core, "c", big, max_tokens=7)
    for _ in range(20):
        core.step()
        if sched.queues.running and sched.queues.running[0].num_output_tokens:
            break
    assert sched.demoter.state("a") is TurnState.DEMOTED
    assert reader.claim("a", max_steps=2)[0] is ClaimStatus.WAIT  # no block to restore into
    now[0] += td.RESTORE_WAIT_S
    assert reader.claim("a", max_steps=2)[0] is ClaimStatus.REJECT
    assert sched.queues.running  # "c" ran all along
    assert sched.stats()["kv_turns"]["turns_lost"] == 1
    run_until_done(core)
    reader.abort_all()
    drain(core)
    assert_all_free(core)


def test_a_preempted_request_at_the_waiting_head_makes_room_by_demotion():
    core, runner, reader = make_turn_core(num_blocks=20)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})  # 14 of 20 blocks held
    # fits the 6 free blocks when admitted, runs out of them while it decodes: preempted, it
    # waits at the head of the queue (PREEMPTED), and only a demotion makes room for it
    small = prompt(5, 20)
    add(core, "c", small, max_tokens=12)
    assert run_until_done(core, max_steps=300)["c"].tokens == reference_generate(small, 12)
    assert sched.stats()["num_preemptions_total"] >= 1
    assert sched.demoter.state("a") is TurnState.DEMOTED
    reader.abort_all()
    drain(core)
    assert_all_free(core)


def test_without_tiers_a_held_turn_under_pressure_is_given_up_to_the_prefix_cache():
    # No KV cache tier: under pressure the decoder still lets go of a held turn (its full
    # blocks stay in the GPU prefix cache, evictable) instead of stalling new requests until
    # the lease's TTL. A claim that finds the blocks still cached is served from them; one
    # whose blocks were evicted is refused (the reader recomputes).
    core, runner, reader = make_turn_core(num_blocks=20, host_blocks=0, ttl_s=600.0)
    sched = core.scheduler
    assert sched.tiers is None and sched.demoter is not None
    _demote_a_by_a_small_request(core)  # without tiers "a" is given up to the prefix cache
    stats = sched.stats()
    assert stats["kv_tiers"] is None and stats["kv_turns"]["turns_demoted"] == 1  # still counted
    status, blocks = reader.claim("a")
    assert status is ClaimStatus.OK
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    reader.notify("a", "done", blocks)
    # "b" is given up for a request that then takes every block: its claim is refused
    big = prompt(5, 70)
    add(core, "d", big, max_tokens=2)
    assert run_until_done(core)["d"].tokens == reference_generate(big, 2)
    assert sched.demoter.state("b") is TurnState.DEMOTED
    status, _ = reader.claim("b")
    assert status is ClaimStatus.REJECT
    assert sched.demoter.num_turns_lost_total == 1
    reader.abort_all()
    drain(core)
    assert len(reader.worker.leases) == 0
    assert_all_free(core)


def test_a_restored_turn_whose_reader_ends_it_before_the_report_counts_as_restored():
    """At TP 1 a restore serves the waiting claim as soon as the launch binds it; the reader may
    end the lease (an abort: it found nothing past its own hit) before the report taken after
    the step's work, which then names the turn as finished and as restored. It is counted
    restored, and its blocks are freed once."""
    core, runner, reader = make_turn_core(num_blocks=20)
    sched = core.scheduler
    _demote_a_by_a_small_request(core)
    worker = reader.worker
    bind = worker.bind_connector_metadata
    answered: list[ClaimStatus] = []

    def bind_then_reader_aborts(metadata):
        bind(metadata)
        if metadata is not None and "a" in metadata.restored:
            blocks, tokens = reader.sched.advertised["a"]
            n = len(tokens) // BS * BS
            answer = worker.leases.claim_answer("a", blocks, n, token_digest(tokens[:n]))
            answered.append(answer.status)
            reader.notify("a", "abort", answer.block_ids)

    worker.bind_connector_metadata = bind_then_reader_aborts
    status, _ = reader.claim("a")  # waits, the engine restores; the lease ends meanwhile
    assert answered == [ClaimStatus.OK]
    for _ in range(5):
        core.step()
    assert sched.demoter.state("a") is None
    assert sched.stats()["kv_turns"]["turns_restored"] == 1
    reader.abort_all()
    drain(core)
    assert_all_free(core)
