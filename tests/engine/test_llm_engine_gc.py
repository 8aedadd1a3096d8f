"""LLMEngine.generate leaves the objects older than the call out of the garbage collector's
passes while it steps, and hands them back when it returns."""

from __future__ import annotations

import gc

import pytest

import engine_fakes
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams

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


def test_older_objects_are_frozen_during_generate_only():
    if gc.get_freeze_count():
        pytest.skip("objects are frozen already in this process")
    engine, counts = _engine_seeing_freeze_counts()
    out = engine.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6))
    assert out[0].finish_reason == "length" and len(out[0].token_ids) == 6
    assert counts and all(c > 0 for c in counts), counts  # the model and caches sat out
    assert gc.get_freeze_count() == 0  # all handed back
    engine.shutdown()


def test_a_callers_freeze_is_left_alone():
    engine, counts = _engine_seeing_freeze_counts()
    gc.collect()
    gc.freeze()
    try:
        engine.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3))
        assert counts and all(c > 0 for c in counts)
        assert gc.get_freeze_count() > 0  # not unfrozen by generate
    finally:
        gc.unfreeze()
        engine.shutdown()
