"""Fixtures of the engine tests: ``scheduling_mode`` runs a test with synchronous steps and
with overlapped scheduling (``EngineConfig.async_scheduling``), through the engines that
:func:`engine_fakes.make_core` and ``test_llm_engine_real.make_engine`` build."""

from __future__ import annotations

import pytest

from tests.support import engine_fakes
@pytest.fixture(params=[False, True], ids=["sync", "async"])
def scheduling_mode(request, monkeypatch) -> bool:
    """``async_scheduling`` of the engines the test builds (default of their helpers)."""
    monkeypatch.setattr(engine_fakes, "ASYNC_SCHEDULING", request.param)
    return request.param
