"""Fixtures of the distributed tests: ``tp2``, one pair of gloo TP ranks for the whole package
(tests/support/tp_ranks.py): spawning two processes that import torch and join a process
group costs seconds on a small machine, so the tests send their rank functions to the same two
ranks instead of spawning their own."""

from __future__ import annotations

import pytest
from tests.support.tp_ranks import TP2Ranks


@pytest.fixture(scope="package")
def _tp2_pool(tmp_path_factory):
    holder = []
    yield holder, tmp_path_factory
    for ranks in holder:
        ranks.stop()


@pytest.fixture
def tp2(_tp2_pool) -> TP2Ranks:
    """Two gloo ranks (TP 2 on CPU) shared by the package's tests; started again after a test
    whose job failed."""
    holder, factory = _tp2_pool
    if not holder or holder[-1].broken:
        holder.append(TP2Ranks(f"file://{factory.mktemp('tp2')}/init"))
    return holder[-1]
