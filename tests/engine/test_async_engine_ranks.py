"""``AsyncEngine.generate(..., data_parallel_rank=r)``: a request pinned to a rank goes to that
rank's core (the concurrent hand-off names the rank's side channel before the prefill); without
one the least-loaded rank serves it. Fake cores, no process."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from tests.support.fake_engine_for_server import make_char_tokenizer

from pdserve.engine.async_engine import AsyncEngine
from pdserve.types.core_messages import AbortRequests, AddRequest
from pdserve.types.sampling_params import SamplingParams


class FakeCore:
    """Stands in for one rank's ``CoreClient``: records what the front end sends."""

    def __init__(self, rank: int):
        self.rank = rank
        self.outstanding = 0
        self.sent: list = []

    def check_alive(self) -> None:
        return None

    def send(self, msg, block: bool = True) -> None:
        self.sent.append(msg)


def engine_with(ranks: int) -> AsyncEngine:
    eng = AsyncEngine()
    eng._cores = [FakeCore(r) for r in range(ranks)]
    eng.tokenizer = make_char_tokenizer()
    eng.model_info = SimpleNamespace(vocab_size=len(eng.tokenizer))
    eng.max_model_len = 64
    return eng


async def _add(eng: AsyncEngine, request_id: str, rank: int | None) -> asyncio.Task:
    gen = eng.generate(request_id, [5, 6, 7], SamplingParams(max_tokens=2), data_parallel_rank=rank)
    task = asyncio.ensure_future(gen.__anext__())
    await asyncio.sleep(0)
    return task


def added(core: FakeCore) -> list[str]:
    return [m.request_id for m in core.sent if isinstance(m, AddRequest)]


async def test_a_pinned_request_goes_to_its_rank_others_to_the_least_loaded():
    eng = engine_with(3)
    tasks = [await _add(eng, "pinned-a", 2), await _add(eng, "pinned-b", 2),
             await _add(eng, "free-1", None), await _add(eng, "free-2", None)]
    assert [added(c) for c in eng._cores] == [["free-1"], ["free-2"], ["pinned-a", "pinned-b"]]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.sleep(0)
    aborted = [m.request_ids for m in eng._cores[2].sent if isinstance(m, AbortRequests)]
    assert sorted(sum(aborted, [])) == ["pinned-a", "pinned-b"]  # aborted on their own rank
    assert [c.outstanding for c in eng._cores] == [0, 0, 0]


async def test_a_rank_that_does_not_exist_is_a_value_error():
    eng = engine_with(2)
    for rank in (2, -1):
        with pytest.raises(ValueError, match="data-parallel rank"):
            await eng.generate("r", [5], SamplingParams(max_tokens=1),
                               data_parallel_rank=rank).__anext__()
    assert [c.sent for c in eng._cores] == [[], []]
