"""LLMEngine keeps the objects that exist at its construction out of the garbage collector's
passes until shutdown (as the engine-core process does), also when a caller froze objects before
(then nothing is unfrozen at shutdown)."""

from __future__ import annotations

import gc

import pytest

from tests.support import engine_fakes
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("scheduling_mode")


def _engine_seeing_freeze_counts() -> tuple[LLMEngine, list[int]]:
    runner = engine_fakes.FakeModelRunner(64, 4)
    counts: list[int] = []
    for name in ("execute", "execute_async"):
        inner = getattr(runner, name)

        def seen(sched, inner=inner):
            counts.append(gc.get_freeze_count())
            return inner(sched)

        setattr(runner, name, seen)
    return LLMEngine(engine_fakes.make_config(), runner=runner), counts


def test_objects_are_frozen_from_construction_to_shutdown():
    gc.unfreeze()  # what earlier tests' engines froze (results do not depend on it)
    engine, counts = _engine_seeing_freeze_counts()
    # (frozen objects still die by reference counting: the count may only shrink)
    assert gc.get_freeze_count() > 0  # the model, caches and modules sit out the passes
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 6
    assert counts and all(c > 0 for c in counts), counts  # while it steps
    assert gc.get_freeze_count() > 0  # still frozen between calls
    engine.shutdown()
    assert gc.get_freeze_count() == 0  # all handed back
    engine.shutdown()  # a second shutdown unfreezes nothing more
    assert gc.get_freeze_count() == 0


def test_a_callers_small_freeze_does_not_stop_the_engines():
    """Some objects frozen before (375 on the H200 machine): the engine still freezes what
    exists at its construction, and leaves everything frozen at shutdown."""
    gc.collect()
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        engine, counts = _engine_seeing_freeze_counts()
        assert gc.get_freeze_count() > before  # the engine's own objects too
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
        assert counts and all(c > before for c in counts)
        engine.shutdown()
        assert gc.get_freeze_count() > 0  # not unfrozen by the engine
    finally:
        gc.unfreeze()


def test_nothing_is_frozen_with_the_collector_off():
    gc.unfreeze()  # what earlier tests' engines froze (results do not depend on it)
    gc.disable()
    try:
        engine, _ = _engine_seeing_freeze_counts()
        assert gc.get_freeze_count() == 0
        engine.shutdown()
    finally:
        gc.enable()
