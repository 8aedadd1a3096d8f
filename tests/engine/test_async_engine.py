"""AsyncEngine end to end: a real engine-core process on the tiny random Llama, talking ZMQ."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest
import pytest_asyncio

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineStartupError,
    EngineStats,
    RequestOutput,
)
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.sampling_params import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

ARGS = dict(dtype="float32", device="cpu", block_size=4, max_model_len=128, num_gpu_blocks_override=128)


def greedy(max_tokens: int = 12, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def prompt(length: int, salt: int = 0) -> list[int]:
    return [(37 * i + 11 * salt + 3) % 3000 + 200 for i in range(length)]


async def run(engine: AsyncEngine, rid: str, ids: list[int], params: SamplingParams) -> list[RequestOutput]:
    return [o async for o in engine.generate(rid, ids, params)]


async def wait_all_free(engine: AsyncEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.stats()
        if s.num_free_blocks == s.num_blocks and s.num_running == 0 and s.num_waiting == 0:
            return
        assert time.monotonic() < deadline, f"blocks not freed: {s}"
        await asyncio.sleep(0.05)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=[False, True],
                        ids=["sync", "async"])
async def engine(tiny_llama_path, request):
    """The shared engine, with synchronous steps and with overlapped scheduling."""
    eng = await AsyncEngine.start(EngineConfig(model=tiny_llama_path, async_scheduling=request.param,
                                               **ARGS))
    try:
        yield eng
    finally:
        await eng.shutdown()
    assert eng._cores[0].proc.exitcode == 0  # the core stopped on its own, not killed


@pytest.fixture(scope="module")
def offline_tokens(tiny_llama_path) -> dict[int, list[int]]:
    """Greedy tokens of the in-process engine for a few prompts (the reference)."""
    llm = LLMEngine(EngineConfig(model=tiny_llama_path, **ARGS))
    try:
        lengths = [1, 3, 4, 5, 9, 30]
        outs = llm.generate([prompt(n, n) for n in lengths], greedy())
        return {n: o.token_ids for n, o in zip(lengths, outs)}
    finally:
        llm.shutdown()


async def test_generate_streams_deltas_matching_offline_tokens_and_text(engine, offline_tokens):
    assert engine.max_model_len == 128 and engine.num_blocks == 128
    outs = await run(engine, "one", prompt(9, 9), greedy())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == offline_tokens[9]
    assert all(len(o.new_token_ids) == 1 for o in outs)
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    last = outs[-1]
    assert last.finish_reason == "length" and last.num_output_tokens == 12 and last.num_prompt_tokens == 9
    text = "".join(o.new_text for o in outs)
    assert text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    await wait_all_free(engine)


async def test_concurrent_requests_equal_offline(engine, offline_tokens):
    lengths = list(offline_tokens)
    results = await asyncio.gather(*(run(engine, f"c{n}", prompt(n, n), greedy()) for n in lengths))
    for n, outs in zip(lengths, results):
        assert [t for o in outs for t in o.new_token_ids] == offline_tokens[n], n
    s = engine.stats()
    assert s.generation_tokens_total >= 12 * len(lengths)
    await wait_all_free(engine)


async def test_stop_string_is_removed_and_request_stops(engine, offline_tokens):
    tokens = offline_tokens[30]
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    # A stop string that starts in the middle of the text (text from token 4's start on).
    head = engine.tokenizer.decode(tokens[:4], skip_special_tokens=True)
    stop = full[len(head) : len(head) + 3]
    assert stop and full.find(stop) == len(head), "pick a stop string that occurs first there"
    outs = await run(engine, "stop", prompt(30, 30), greedy(stop=[stop]))
    text = "".join(o.new_text for o in outs)
    assert text == full[: len(head)]
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert sum(len(o.new_token_ids) for o in outs) < len(tokens)
    await wait_all_free(engine)


async def test_multi_step_bursts_stop_at_a_stop_string_like_single_steps(engine, tiny_llama_path,
                                                                          offline_tokens):
    """With rounds of 4 decode steps the engine core sends tokens in bursts; the front end
    still matches stop strings token by token, so text, tokens and usage equal single steps."""
    tokens = offline_tokens[30]
    full = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    head = engine.tokenizer.decode(tokens[:6], skip_special_tokens=True)
    stop = full[len(head) : len(head) + 3]
    assert stop and full.find(stop) == len(head)
    single = await run(engine, "single", prompt(30, 30), greedy(stop=[stop]))
    multi_engine = await AsyncEngine.start(EngineConfig(model=tiny_llama_path, num_scheduler_steps=4,
                                                        **ARGS))
    try:
        multi = await run(multi_engine, "multi", prompt(30, 30), greedy(stop=[stop]))
        assert any(len(o.new_token_ids) > 1 for o in multi), "no burst: the test checks nothing"
        await wait_all_free(multi_engine)
    finally:
        await multi_engine.shutdown()
    for outs in (single, multi):
        assert "".join(o.new_text for o in outs) == full[: len(head)]
        assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == stop
    assert [t for o in multi for t in o.new_token_ids] == [t for o in single for t in o.new_token_ids]
    assert multi[-1].num_output_tokens == single[-1].num_output_tokens


def min_tokens_reference(tokenizer, tokens: list[int], stop: list[str], min_tokens: int) -> str:
    """The text vLLM returns: the greedy text cut before the earliest stop string that ends
    after the text of the first ``min_tokens`` tokens."""
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    head = tokenizer.decode(tokens[:min_tokens], skip_special_tokens=True)
    hits = [i for s in stop if (i := full.find(s, max(0, len(head) - len(s) + 1))) >= 0]
    return full[: min(hits)] if hits else full


@pytest.mark.parametrize("steps", [1, 4], ids=["single-step", "multi-step"])
async def test_stop_strings_wait_for_min_tokens(engine, tiny_llama_path, offline_tokens, steps):
    """A stop string that the first token's text matches is ignored while fewer than
    ``min_tokens`` tokens exist; a later one stops the request (with bursts of 4 decode steps
    after ``min_tokens`` too)."""
    tokens = offline_tokens[30]
    first = engine.tokenizer.decode(tokens[:1], skip_special_tokens=True)
    seventh = engine.tokenizer.decode(tokens[6:7], skip_special_tokens=True)
    assert first.strip() and seventh.strip(), "pick tokens with text"
    stop = [first, seventh]
    expected = min_tokens_reference(engine.tokenizer, tokens, stop, 5)
    params = greedy(stop=stop, min_tokens=5)
    if steps == 1:
        outs = await run(engine, "min-stop", prompt(30, 30), params)
    else:
        multi_engine = await AsyncEngine.start(EngineConfig(model=tiny_llama_path,
                                                            num_scheduler_steps=steps, **ARGS))
        try:
            outs = await run(multi_engine, "min-stop-multi", prompt(30, 30), params)
            assert any(len(o.new_token_ids) > 1 for o in outs), "no burst: the test checks nothing"
            await wait_all_free(multi_engine)
        finally:
            await multi_engine.shutdown()
    assert "".join(o.new_text for o in outs) == expected
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == seventh
    assert 5 < outs[-1].num_output_tokens == sum(len(o.new_token_ids) for o in outs) <= 7
    await wait_all_free(engine)


async def test_abort_and_leaving_the_iterator_free_all_blocks(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    agen = engine.generate("leave", prompt(20), params)
    first = await agen.__anext__()
    assert not first.finished
    await agen.aclose()  # client went away

    outs: list[RequestOutput] = []
    async for o in engine.generate("aborted", prompt(20, 1), params):
        outs.append(o)
        if len(outs) == 2:
            await engine.abort("aborted")
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert not any(o.finished for o in outs[:-1])
    assert sum(len(o.new_token_ids) for o in outs) < 100  # outputs already queued may precede it
    await wait_all_free(engine)
    await engine.abort("unknown-id")  # ignored


async def test_end_requests_fails_those_in_flight_and_frees_their_blocks(engine, offline_tokens):
    """What a server shutting down does before its grace period ends: the requests in flight
    end with EngineDeadError (the front end's 503), their blocks are freed, and the engine
    still serves."""
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    await wait_all_free(engine)
    before = engine.stats().generation_tokens_total
    agen = engine.generate("ending", prompt(20), params)
    assert not (await agen.__anext__()).finished
    engine.end_requests("the server is shutting down")
    with pytest.raises(EngineDeadError, match="shutting down"):
        async for _ in agen:
            pass
    await wait_all_free(engine)
    # aborted in its core: far fewer than its 100 tokens were generated
    assert engine.stats().generation_tokens_total - before < 50
    outs = [o async for o in engine.generate("after", prompt(20, 2),
                                             SamplingParams(temperature=0.0, max_tokens=3))]
    assert outs[-1].finished and outs[-1].finish_reason == "length"


async def test_an_early_release_reaches_the_core_which_keeps_serving(engine, offline_tokens):
    """``release_early`` is a message to the core (a no-op there without a KV connector)."""
    assert await engine.release_early(0, "never-held", [1, 2])
    outs = await run(engine, "after-release", prompt(20), greedy())
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    await wait_all_free(engine)


async def test_cancelled_task_aborts_the_request(engine):
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    got_one = asyncio.Event()

    async def consume():
        async for _ in engine.generate("cancelled", prompt(10), params):
            got_one.set()

    task = asyncio.create_task(consume())
    await got_one.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_all_free(engine)


async def test_a_finished_output_the_caller_never_took_is_aborted_in_the_core(engine,
                                                                              monkeypatch):
    """The request finished in the core, but its caller left before taking the finished
    output (the HTTP client went away meanwhile): the front end still sends the abort, so the
    core can end a lease it holds for a remote reader that will never come; a caller that took
    the finished output sends none."""
    sent: list[str] = []
    inner = engine._send_abort
    monkeypatch.setattr(engine, "_send_abort",
                        lambda core, ids: (sent.extend(ids), inner(core, ids))[1])
    agen = engine.generate("left", prompt(12, 3), greedy(max_tokens=3))
    first = await agen.__anext__()
    assert not first.finished
    await wait_all_free(engine)  # finished in the core; its last output waits in the queue
    await agen.aclose()
    assert sent == ["left"]
    await run(engine, "taken", prompt(12, 4), greedy(max_tokens=3))
    assert sent == ["left"]


async def test_invalid_requests_raise_value_error(engine):
    with pytest.raises(ValueError, match="max_model_len"):
        await run(engine, "long", prompt(129), greedy())
    with pytest.raises(ValueError, match="max_tokens"):
        await run(engine, "long2", prompt(100), greedy(max_tokens=29))
    with pytest.raises(ValueError, match="at least one token"):
        await run(engine, "empty", [], greedy())
    with pytest.raises(ValueError, match="token ids"):
        await run(engine, "vocab", [10**7], greedy())
    with pytest.raises(ValueError, match="temperature"):
        await run(engine, "temp", [1], SamplingParams(temperature=-1))
    await engine.check_health()


async def test_startup_failure_is_a_clear_error(tmp_path):
    with pytest.raises(EngineStartupError, match="not found"):
        await AsyncEngine.start(EngineConfig(model=str(tmp_path / "no-such-model"), **ARGS))


async def test_dead_core_fails_in_flight_requests(tiny_llama_path):
    eng = await AsyncEngine.start(EngineConfig(model=tiny_llama_path, **ARGS))
    try:
        params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
        agen = eng.generate("doomed", prompt(10), params)
        await agen.__anext__()
        os.kill(eng._cores[0].proc.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            async for _ in agen:
                pass
        with pytest.raises(EngineDeadError):
            await eng.check_health()
        with pytest.raises(EngineDeadError):
            await run(eng, "after", prompt(3), params)
        with pytest.raises(EngineDeadError):
            await eng.release_early(0, "doomed", [1])
    finally:
        await eng.shutdown()


async def test_connector_stats_reach_listeners_unchanged():
    from pdserve.types.core_messages import StepOutputs

    eng = AsyncEngine()  # no process: exercise the output handling only
    core = SimpleNamespace(rank=0, stats=EngineStats())  # stands in for rank 0's CoreClient
    eng._cores = [core]
    seen: list[dict] = []
    eng.add_stats_listener(seen.append)
    eng._handle_step_outputs(core, StepOutputs(stats={"num_running": 2, "kv_cache_usage": 0.5, "extra": 1},
                                         connector_stats=[{"xfer_time_s": [0.1]}, {"num_failed": 1}]))
    assert seen == [{"xfer_time_s": [0.1]}, {"num_failed": 1}]
    assert eng.stats().num_running == 2 and eng.stats().kv_cache_usage == 0.5


async def test_prefix_cache_hits_are_reported_per_request(engine, offline_tokens):
    ids = prompt(30, 30)
    outs = await run(engine, "cached-1", ids, greedy())
    again = await run(engine, "cached-2", ids, greedy())
    assert [t for o in again for t in o.new_token_ids] == offline_tokens[30]
    assert again[-1].num_cached_tokens == (30 - 1) // 4 * 4
    assert outs[-1].num_cached_tokens <= again[-1].num_cached_tokens
    await wait_all_free(engine)
    s = engine.stats()
    assert s.prompt_tokens_cached_total >= 28
    assert s.prompt_tokens_computed_total + s.prompt_tokens_cached_total <= s.prompt_tokens_total


async def test_logprobs_are_passed_through(engine):
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=2)
    outs = await run(engine, "lp", prompt(5), params)
    lps = [lp for o in outs for lp in o.new_logprobs]
    assert [lp.token_id for lp in lps] == [t for o in outs for t in o.new_token_ids]
    assert all(len(lp.top) == 2 and lp.top[0][0] == lp.token_id for lp in lps)  # greedy = top-1


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def test_idle_core_does_not_spin(engine):
    await wait_all_free(engine)
    before = _cpu_seconds(engine._cores[0].proc.pid)
    await asyncio.sleep(2.0)
    used = _cpu_seconds(engine._cores[0].proc.pid) - before
    assert used < 0.3, f"idle engine core used {used:.2f} s of CPU in 2 s"
