"""Merging the TP ranks' KV connector outputs (the rules of pdserve/executor/kv_merge.py)."""

from __future__ import annotations

import pytest

from pdserve.types.outputs import KVConnectorOutput
from pdserve.executor.kv_merge import KVOutputMerger, merge_stats
from pdserve.types.outputs import KVLoadError, KVLoadFailure


def test_a_request_is_done_once_every_rank_reported_it():
    m = KVOutputMerger(3)
    out = m.merge([KVConnectorOutput(finished_recving={"a"}, first_tokens={"a": 5}),
                   KVConnectorOutput(finished_recving={"a"}, first_tokens={"a": 6}), None])
    # the first token is known from the lease claim: rank 0's goes out in the step it came
    assert out.finished_recving == set() and out.first_tokens == {"a": 5} and m.num_pending == 1
    out = m.merge([None, None, KVConnectorOutput(finished_recving={"a"},
                                                 finished_sending={"s"})])
    assert out.finished_recving == {"a"} and out.first_tokens == {}
    assert out.finished_sending == set() and m.num_pending == 1
    with pytest.raises(ValueError):
        m.merge([None, None])


def test_a_failure_on_any_rank_fails_the_load():
    m = KVOutputMerger(2)
    err = KVLoadError(KVLoadFailure.TIMEOUT, "rank 1 timed out")
    out = m.merge([KVConnectorOutput(),
                   KVConnectorOutput(invalid_block_ids={4, 5}, finished_recving={"b"},
                                     load_errors={"b": err})])
    assert out.invalid_block_ids == {4, 5} and out.load_errors == {}
    out = m.merge([KVConnectorOutput(finished_recving={"b"}, invalid_block_ids={6}),
                   KVConnectorOutput()])
    assert out.finished_recving == {"b"} and out.load_errors == {"b": err}
    assert out.invalid_block_ids == {6}


def test_a_partial_load_counts_the_fewest_blocks_any_rank_loaded():
    m = KVOutputMerger(3)
    out = m.merge([KVConnectorOutput(finished_recving={"p"}, partial_loads={"p": 3}),
                   KVConnectorOutput(finished_recving={"p"}, partial_loads={"p": 2}),
                   KVConnectorOutput()])
    assert out.finished_recving == set() and out.partial_loads == {}  # not every rank yet
    out = m.merge([None, None, KVConnectorOutput(finished_recving={"p", "q"})])
    assert out.finished_recving == {"p"} and out.partial_loads == {"p": 2}
    assert not out.invalid_block_ids and m.num_pending == 1
    # a rank that loaded all its blocks says nothing: the others' count stands
    out = m.merge([KVConnectorOutput(finished_recving={"q"}, partial_loads={"q": 1}),
                   KVConnectorOutput(finished_recving={"q"}), None])
    assert out.finished_recving == {"q"} and out.partial_loads == {"q": 1}


def test_clock_offsets_from_rank0_and_stats_summed():
    m = KVOutputMerger(2)
    out = m.merge([KVConnectorOutput(remote_clock_offsets={("e", "h", 1): 0.5},
                                     stats={"reads": 2, "bytes": 10, "path": "nixl",
                                            "by_peer": {"x": 1}, "lat": [1.0]}),
                   KVConnectorOutput(remote_clock_offsets={("e", "h", 1): 9.0},
                                     stats={"reads": 3, "bytes": 5, "path": "ipc",
                                            "by_peer": {"x": 2, "y": 1}, "lat": [2.0]})])
    assert out.remote_clock_offsets == {("e", "h", 1): 0.5}
    assert out.stats == {"reads": 5, "bytes": 15, "path": "nixl", "by_peer": {"x": 3, "y": 1},
                         "lat": [1.0, 2.0]}
    assert m.merge([KVConnectorOutput(), KVConnectorOutput()]).stats is None
    assert merge_stats([{"ok": True}, {"ok": False}]) == {"ok": True}


def test_a_turn_is_demoted_once_every_rank_gave_up_its_blocks_and_kept_if_one_refused():
    m = KVOutputMerger(2)
    out = m.merge([KVConnectorOutput(demoted_turns={"t", "u"}), KVConnectorOutput()])
    assert out.demoted_turns == set() and out.kept_turns == set() and m.num_pending == 2
    out = m.merge([KVConnectorOutput(), KVConnectorOutput(demoted_turns={"t"},
                                                          kept_turns={"u"})])
    assert out.demoted_turns == {"t"} and out.kept_turns == {"u"} and m.num_pending == 0
    # refusals on every rank: kept; answers of one step suffice
    out = m.merge([KVConnectorOutput(kept_turns={"v"}), KVConnectorOutput(kept_turns={"v"})])
    assert out.kept_turns == {"v"} and out.demoted_turns == set()


def test_a_restore_is_taken_once_every_rank_took_it_and_fails_when_one_rank_fails():
    m = KVOutputMerger(3)
    out = m.merge([KVConnectorOutput(restored_turns={"t", "u"}, turns_to_restore={"w"}),
                   KVConnectorOutput(restored_turns={"t"}), None])
    assert out.restored_turns == set() and out.turns_to_restore == {"w"}  # claims: rank 0's
    out = m.merge([None, KVConnectorOutput(failed_turns={"u"}),
                   KVConnectorOutput(restored_turns={"t", "u"})])
    assert out.restored_turns == {"t"} and out.failed_turns == {"u"}  # at once
    assert m.num_pending == 0  # the failed turn's partial answers are forgotten


def test_a_turns_pending_answers_are_forgotten_when_its_lease_ended_on_every_rank():
    m = KVOutputMerger(2)
    m.merge([KVConnectorOutput(demoted_turns={"t"}, finished_sending={"t"}),
             KVConnectorOutput(finished_sending={"t"})])
    assert m.num_pending == 0
