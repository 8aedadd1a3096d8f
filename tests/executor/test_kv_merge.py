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
    assert out.finished_recving == set() and out.first_tokens == {} and m.num_pending == 1
    out = m.merge([None, None, KVConnectorOutput(finished_recving={"a"},
                                                 finished_sending={"s"})])
    assert out.finished_recving == {"a"} and out.first_tokens == {"a": 5}  # rank 0's token
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
