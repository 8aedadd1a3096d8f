"""Fixtures for server tests with the in-process fake engine."""

from __future__ import annotations

from typing import AsyncIterator

import httpx
import pytest
from tests.support.fake_engine_for_server import FakeEngine

from pdserve.entrypoints.server import build_app


@pytest.fixture
def fake_engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
async def client(fake_engine: FakeEngine) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(fake_engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        yield c
