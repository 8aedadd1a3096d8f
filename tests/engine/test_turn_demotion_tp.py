"""A TP 2 decoder's held turn blocks under GPU pressure (pdserve/engine/turn_demotion.py): every
rank holds its own lease of a turn over the same block ids, and the real merger
(pdserve/executor/kv_merge.py) decides what the scheduler sees: a turn is demoted or restored
only once every rank did it, a claim is answered only once every rank took the restored blocks,
a rank's refusal keeps the blocks on every rank, a rank's failure ends the lease on all.

The engine runs over the tiered fake runner; its connector is the fake decoder connector of
tests/support/turn_fakes.py with one real lease table per rank (``TPTurnConnectorWorker``),
optionally with rank 1's answers reaching the merge steps late.
"""

from __future__ import annotations

import pytest

from pdserve.engine.turn_demotion import TurnState
from pdserve.kv_transfer.nixl.leases import ClaimStatus, LeaseBlocks
from pdserve.kv_transfer.nixl.notifications import Notice
from pdserve.types.remote_ref import token_digest
from tests.support.engine_fakes import (add, assert_all_free, collect, drain, reference_generate,
                                       run_until_done)
from tests.support.turn_fakes import finish_turns, make_turn_core, turn_prompt as prompt

pytestmark = pytest.mark.usefixtures("scheduling_mode")

BS = 4




def demote_a(core) -> None:
    """Two turns hold 14 of 20 blocks; a request of 12 blocks makes the oldest one demoted."""
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    big = prompt(3, 40)
    add(core, "c", big, max_tokens=4)
    assert run_until_done(core)["c"].tokens == reference_generate(big, 4)


def claim_on_rank0(reader, request_id: str, results: dict | None = None,
                   max_steps: int = 50) -> tuple[ClaimStatus, list[int], list]:
    """Claim as rank 0's side channel does, stepping while it waits (outputs into
    ``results``). Returns ``(status, blocks, every rank's (where, blocks) at each WAIT)``; at
    an OK every rank must hold the blocks named."""
    blocks, tokens = reader.sched.advertised[request_id]
    n = len(tokens) // BS * BS
    seen = []
    for _ in range(max_steps):
        answer = reader.worker.leases.claim_answer(request_id, blocks, n,
                                                   token_digest(tokens[:n]))
        status, moved = answer.status, answer.block_ids
        if status is not ClaimStatus.WAIT:
            named = moved if moved is not None else blocks
            if status is ClaimStatus.OK:
                for rank in reader.ranks:
                    assert rank.leases.where(request_id) == (LeaseBlocks.HELD, named)
            return status, named, seen
        seen.append([rank.leases.where(request_id) for rank in reader.ranks])
        collect({} if results is None else results, reader.core.step()[0])
    return ClaimStatus.WAIT, [], seen


def finish_clean(core, reader) -> None:
    """End every lease (the engine steps until every rank's end is merged): no lease is left
    on any rank, no answer half merged, every block free."""
    reader.abort_all()
    drain(core)
    for rank in reader.ranks:
        assert len(rank.leases) == 0
    assert reader.runner.worker.merger.num_pending == 0
    assert_all_free(core)
    core.scheduler.tiers.check_consistency()


@pytest.mark.parametrize("lag", [0, 1], ids=["same-step", "rank1-late"])
def test_a_turn_is_demoted_and_restored_on_every_rank_and_served_once_all_took_it(lag):
    core, runner, reader = make_turn_core(num_blocks=20, tp_size=2, lag_steps=lag)
    sched = core.scheduler
    demote_a(core)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    assert sched.demoter.state("b") is None
    for rank in reader.ranks:
        assert rank.leases.where("a") == (LeaseBlocks.DEMOTED, [])
    assert sched.stats()["kv_turns"]["turns_demoted"] == 1
    status, blocks, seen = claim_on_rank0(reader, "a")
    assert status is ClaimStatus.OK
    # the claim waited while rank 0 had taken the restored blocks but was not told that every
    # rank had: it is never told blocks another rank does not hold yet
    assert any(s[0] is not None and s[0][0] is LeaseBlocks.RESTORED for s in seen), seen
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    turns = sched.stats()["kv_turns"]
    assert turns["turns_restored"] == 1 and turns["turn_blocks_from_tiers"] > 0
    assert turns["turns_lost"] == 0
    reader.notify("a", "done", blocks)
    finish_clean(core, reader)
    assert sched.demoter.state("a") is None and sched.demoter.num_held_blocks == 0


def test_a_demotion_refused_by_one_rank_keeps_the_blocks_on_every_rank():
    core, runner, reader = make_turn_core(num_blocks=16, tp_size=2)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22)})
    advertised = reader.sched.advertised["a"][0]
    status, blocks = reader.claim("a")  # rank 0 granted a claim: the READ may be under way
    assert status is ClaimStatus.OK and blocks == advertised
    big = prompt(3, 40)  # 11 blocks: 9 are free
    add(core, "c", big, max_tokens=4)
    for _ in range(10):
        core.step()
    # rank 1 agreed, rank 0 refused: kept, and rank 1 holds the advertised blocks again
    assert sched.demoter.state("a") is TurnState.KEPT
    for rank in reader.ranks:
        assert rank.leases.where("a") == (LeaseBlocks.HELD, advertised)
    assert sched.queues.waiting and sched.queues.waiting[0].request_id == "c"
    assert sched.stats()["kv_turns"]["turns_demoted"] == 0
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    reader.notify("a", "done", blocks)
    assert run_until_done(core)["c"].tokens == reference_generate(big, 4)
    finish_clean(core, reader)


def test_a_rank_that_cannot_take_the_restored_blocks_ends_the_lease_on_every_rank():
    core, runner, reader = make_turn_core(num_blocks=20, tp_size=2)
    sched = core.scheduler
    demote_a(core)
    assert sched.demoter.state("a") is TurnState.DEMOTED
    # rank 1 alone lost its lease (its "abort" came, rank 0's did not)
    reader.ranks[1].held.apply(Notice("abort", "a", 1, reader.sched.advertised["a"][0]))
    assert reader.ranks[1].leases.where("a") is None
    status, _, _ = claim_on_rank0(reader, "a")
    assert status is ClaimStatus.REJECT  # the reader recomputes; no rank serves half a turn
    assert reader.worker.leases.where("a") is None
    turns = sched.stats()["kv_turns"]
    assert turns["turns_lost"] == 1 and turns["turns_restored"] == 0
    finish_clean(core, reader)
    assert sched.demoter.num_held_blocks == 0


def test_a_claim_before_every_rank_answered_the_demotion_is_restored_after_it():
    core, runner, reader = make_turn_core(num_blocks=20, tp_size=2, lag_steps=2)
    sched = core.scheduler
    finish_turns(core, {"a": prompt(1, 22), "b": prompt(2, 22)})
    big = prompt(3, 40)
    add(core, "c", big, max_tokens=4)
    results: dict = {}
    for _ in range(20):
        collect(results, core.step()[0])
        if reader.worker.leases.where("a")[0] is LeaseBlocks.DEMOTED:
            break
    assert sched.demoter.state("a") is TurnState.DEMOTING  # rank 1's answer is late
    status, blocks, _ = claim_on_rank0(reader, "a", results)
    assert status is ClaimStatus.OK
    full = len(reader.sched.advertised["a"][1]) // BS
    assert reader.read(blocks, full) == reader.expected("a", full)
    assert sched.stats()["kv_turns"]["turns_restored"] == 1
    reader.notify("a", "done", blocks)
    assert run_until_done(core, results)["c"].tokens == reference_generate(big, 4)
    finish_clean(core, reader)
