"""Keep-alive comments of streamed responses (``JobRunner.stream``): sent while a request has had
nothing to send for the keep-alive interval (queued, or between two tokens), followed by the
normal chunks; a stream that waits still aborts its engine request when its reader goes away,
and a non-streamed answer has none."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from pdserve.entrypoints import job_runner
from pdserve.entrypoints.job_runner import EngineJob, JobRunner
from pdserve.entrypoints.metrics import ServerMetrics
from pdserve.entrypoints.server import build_app
from pdserve.entrypoints.sse import DONE, KEEPALIVE
from pdserve.types.sampling_params import SamplingParams
from tests.support.fake_engine_for_server import FakeEngine
from tests.support.live_server import live_server, wait_until

INTERVAL_S = 0.05  # the patched keep-alive interval (s)
PROMPT = [5, 6, 7]


@pytest.fixture(autouse=True)
def short_interval(monkeypatch):
    monkeypatch.setattr(job_runner, "KEEPALIVE_INTERVAL_S", INTERVAL_S)


def stream_of(engine: FakeEngine, max_tokens: int = 3):
    """A completions stream of one job (``req-0``) through ``JobRunner.stream``."""
    runner = JobRunner(engine, ServerMetrics(engine), "m")
    job = EngineJob(0, "req-0", list(PROMPT), SamplingParams(max_tokens=max_tokens))
    return runner.stream(
        [job], time.monotonic(), response_id="cmpl-0", object_name="text_completion",
        prompt_indices=[0], include_usage=False,
        choice_of=lambda i, out, reason: {"index": i, "text": out.new_text,
                                          "finish_reason": reason})


def texts(events: list[str]) -> str:
    return "".join(json.loads(e[6:])["choices"][0]["text"] for e in events
                   if e not in (KEEPALIVE, DONE))


def start_reading(stream) -> tuple[list[str], asyncio.Task]:
    """A task reading ``stream`` (:func:`stream_of`) into the returned list as events come."""
    events: list[str] = []

    async def read():
        async for event in stream:
            events.append(event)

    return events, asyncio.create_task(read())


async def test_queued_request_gets_keepalives_then_its_chunks():
    engine = FakeEngine()
    engine.gate = asyncio.Event()  # the request waits "in the queue"
    events, reader = start_reading(stream_of(engine))
    await asyncio.sleep(INTERVAL_S * 5)
    assert events and set(events) == {KEEPALIVE}  # not a token yet, only comments
    assert len(events) >= 3
    engine.gate.set()
    await asyncio.wait_for(reader, 5)
    assert events[-1] == DONE
    data = [e for e in events if e != KEEPALIVE]
    assert len(data) == 4 and all(e.startswith("data: {") for e in data[:-1])
    assert texts(events) == engine.expected_text(PROMPT, None, 3)
    assert json.loads(data[-2][6:])["choices"][0]["finish_reason"] == "length"
    assert not engine.aborted


async def test_a_silent_engine_core_gets_no_keepalives():
    """A core stuck in a step (its process alive, no message for an interval) leaves the stream
    silent, so that a reader's idle timeout (the proxy's stall timeout) still sees it."""
    engine = FakeEngine()
    engine.gate = asyncio.Event()
    engine.core_silence = INTERVAL_S * 2
    events, reader = start_reading(stream_of(engine))
    await asyncio.sleep(INTERVAL_S * 5)
    assert events == []
    engine.core_silence = 0.0  # heard from again
    await asyncio.sleep(INTERVAL_S * 3)
    assert events and set(events) == {KEEPALIVE}
    engine.gate.set()
    await asyncio.wait_for(reader, 5)
    assert events[-1] == DONE


async def test_keepalives_between_slow_tokens():
    engine = FakeEngine()
    engine.token_delay_s = INTERVAL_S * 3  # a preempted request's next token comes late
    events = [e async for e in stream_of(engine, max_tokens=3)]
    assert events[-1] == DONE and texts(events) == engine.expected_text(PROMPT, None, 3)
    data_at = [i for i, e in enumerate(events) if e.startswith("data: {")]
    assert len(data_at) == 3
    for before, at in zip([-1] + data_at, data_at):  # a comment before every token
        assert KEEPALIVE in events[before + 1:at], events


async def test_fast_tokens_get_no_keepalive(monkeypatch):
    monkeypatch.setattr(job_runner, "KEEPALIVE_INTERVAL_S", 10.0)
    engine = FakeEngine()
    events = [e async for e in stream_of(engine, max_tokens=5)]
    assert KEEPALIVE not in events and len(events) == 6


async def test_closing_a_waiting_stream_aborts_its_request():
    engine = FakeEngine()
    engine.gate = asyncio.Event()
    stream = stream_of(engine)
    for _ in range(2):
        assert await asyncio.wait_for(anext(stream), 5) == KEEPALIVE
    assert engine.active == {"req-0"}
    await stream.aclose()
    assert engine.aborted == ["req-0"] and not engine.active


async def test_cancelled_reader_aborts_its_request():
    """As the server's response does on a disconnect: the task reading the stream is
    cancelled while it waits for the next output, then the stream is closed."""
    engine = FakeEngine()
    engine.gate = asyncio.Event()
    stream = stream_of(engine)
    seen, reader = start_reading(stream)
    await wait_until(lambda: len(seen) >= 2)
    reader.cancel()
    await asyncio.gather(reader, return_exceptions=True)
    await stream.aclose()
    assert engine.aborted == ["req-0"] and not engine.active


async def test_http_stream_sends_comments_and_disconnect_aborts():
    engine = FakeEngine()
    engine.gate = asyncio.Event()
    async with live_server(build_app(engine)) as base:
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            async with asyncio.timeout(5), c.stream(
                    "POST", "/v1/completions",
                    json={"prompt": "hi", "max_tokens": 4, "stream": True}) as r:
                async for line in r.aiter_lines():
                    if line == ": keep-alive":
                        break  # the server is waiting; leave
        await wait_until(lambda: not engine.active)
        (rid,) = engine.calls
        assert engine.aborted == [rid]
        async with httpx.AsyncClient(base_url=base, timeout=10) as c:
            engine.gate.clear()
            asyncio.get_running_loop().call_later(INTERVAL_S * 4, engine.gate.set)
            r = await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                "stream": True})
            lines = [line for line in r.text.split("\n") if line]
            assert lines[0].startswith("data: {")  # the chat opening chunk comes first
            assert ": keep-alive" in lines and lines[-1] == "data: [DONE]"
            # a non-streamed answer waits without comments
            engine.gate.clear()
            asyncio.get_running_loop().call_later(INTERVAL_S * 4, engine.gate.set)
            r = await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["choices"][0]["text"]
