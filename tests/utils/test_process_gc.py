"""freeze_start_up_objects: what it freezes, and when the caller may unfreeze at shutdown."""

from __future__ import annotations

import gc
import weakref

import pytest

from pdserve.utils.process_gc import freeze_start_up_objects


@pytest.fixture
def nothing_frozen():
    """No object frozen before the test (earlier tests may have left some: they go back to the
    oldest generation, which changes no result), none after it."""
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Node:
    pass


def test_frees_garbage_freezes_survivors_and_lets_a_first_freezer_unfreeze(nothing_frozen):
    garbage, kept = _Node(), _Node()
    garbage.self = garbage  # a cycle only a collection frees
    gone = weakref.ref(garbage)
    del garbage
    assert gone() is not None
    assert freeze_start_up_objects() is True
    assert gone() is None  # freed, not frozen
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # survivors sit out the passes


def test_an_earlier_freeze_stays_the_callers(nothing_frozen):
    gc.freeze()
    assert freeze_start_up_objects() is False
    assert gc.get_freeze_count() > 0


def test_nothing_is_done_while_the_collector_is_off(nothing_frozen):
    gc.disable()
    try:
        assert freeze_start_up_objects() is False
        assert gc.get_freeze_count() == 0
    finally:
        gc.enable()
