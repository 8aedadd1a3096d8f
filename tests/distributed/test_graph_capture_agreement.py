"""CUDA-graph capture at TP > 1 (the agreement of decode_graphs.capture_with_collectives, run on
two gloo ranks with a stand-in for the graph runner): the ranks stop together at the first
batch size any of them failed to capture, and all then decode eagerly; when every size
captured, all keep their graphs."""

from __future__ import annotations

import pytest

SIZES = [8, 4, 2, 1]


class _Graphs:
    """The capture protocol of CUDAGraphRunner.capture(agree), without CUDA: ``fail`` is the
    batch size this rank fails to capture (None: none)."""

    def __init__(self, fail: int | None):
        self.fail, self.tried = fail, []

    def capture(self, agree) -> bool:
        for bs in SIZES:
            self.tried.append(bs)
            if not agree("boom" if bs == self.fail else None):
                return False
        return True


def _rank(rank: int, failing_rank: int | None) -> None:
    """On one of the package's two TP ranks (``tp2`` fixture)."""
    from pdserve.runner.decode_graphs import capture_with_collectives

    graphs = _Graphs(2 if rank == failing_rank else None)
    captured = capture_with_collectives(graphs, "decode steps")
    if failing_rank is None:
        assert captured and graphs.tried == SIZES
    else:  # both ranks stop after size 2, the one rank 1 failed
        assert not captured and graphs.tried == [8, 4, 2], graphs.tried


@pytest.mark.slow
def test_all_ranks_fall_back_when_one_fails(tp2):
    tp2.run(_rank, 1)


@pytest.mark.slow
def test_all_ranks_keep_graphs_when_all_captured(tp2):
    tp2.run(_rank, None)


def test_capture_agreed_reports_a_failed_size_or_raises_alone():
    """``cuda_graphs.capture_agreed`` (one size of either graph runner): its error goes to
    ``agree`` with tensor parallelism, the answer decides, and alone the error raises."""
    from pdserve.runner.cuda_graphs import capture_agreed

    def boom():
        raise RuntimeError("no capture")

    seen = []
    assert capture_agreed(lambda: "graph", lambda e: seen.append(e) or True) == (True, "graph")
    assert capture_agreed(boom, lambda e: seen.append(e) or False) == (False, None)
    assert capture_agreed(lambda: "graph", lambda e: seen.append(e) or False) == (False, None)
    assert seen == [None, "RuntimeError: no capture", None]
    assert capture_agreed(lambda: "graph", None) == (True, "graph")
    with pytest.raises(RuntimeError, match="no capture"):
        capture_agreed(boom, None)
