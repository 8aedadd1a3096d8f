"""``pdserve serve`` as a real process on the tiny random Llama, driven by the official ``openai``
client. Greedy output must equal the engine's own offline output (``AsyncEngine`` in-process,
same configuration), and after every test all KV blocks are free again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Iterator

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import EngineServer

from pdserve.types.engine_config import EngineConfig
from pdserve.types.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

SERVED_NAME = "tiny-llama"
ENGINE_ARGS = {"dtype": "float32", "device": "cpu", "max_model_len": 256,
               "kv_cache_memory": 8 * 2**20, "block_size": 16}
# Completion prompts as token ids: lengths around the block size (1, B-1, B, B+1, 2B+1).
PROMPT_LENGTHS = [1, 15, 16, 17, 33]
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"}]
MAX_TOKENS = 12


def _prompt_ids(length: int) -> list[int]:
    return [(7 * i + 3) % 1000 + 10 for i in range(length)]


def _chat_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def offline(tiny_llama_path: str) -> dict:
    """Greedy text of the engine itself (no HTTP) for every prompt the tests send."""
    from pdserve.engine.async_engine import AsyncEngine

    async def run() -> dict:
        engine = await AsyncEngine.start(EngineConfig(model=tiny_llama_path, **ENGINE_ARGS))
        try:
            prompts = {n: _prompt_ids(n) for n in PROMPT_LENGTHS}
            prompts["chat"] = _chat_ids(engine.tokenizer)
            result = {}
            for key, ids in prompts.items():
                params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
                text, tokens = "", []
                async for out in engine.generate(f"offline-{key}", ids, params):
                    text += out.new_text
                    tokens += out.new_token_ids
                result[key] = (text, tokens)
            return result
        finally:
            await engine.shutdown()

    return asyncio.run(run())


SERVE_ARGS = ["--served-model-name", SERVED_NAME, "--dtype", "float32", "--device", "cpu",
              "--max-model-len", "256", "--kv-cache-memory", "8MiB", "--block-size", "16"]


def _start_server(model: str, log_path) -> EngineServer:
    """Starts ``pdserve serve`` on a free port and waits for ``/health`` to answer 200."""
    server = EngineServer(model, log_path, None, SERVE_ARGS)
    try:
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def server(tiny_llama_path: str, tmp_path_factory, request) -> Iterator[str]:
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    srv = EngineServer(tiny_llama_path, log, None, SERVE_ARGS)
    try:
        # the offline outputs (an in-process engine) are computed while the server starts
        request.getfixturevalue("offline")
        srv.wait_ready()
        yield srv.url
    finally:
        srv.stop()
    assert srv.proc.returncode == 0, f"unclean shutdown ({srv.proc.returncode}):\n{log.read_text()}"


def _metrics(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=5).text
    return {s.name: s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if not s.labels}


def _wait_all_blocks_free(base: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(base)
        if (m["pdserve:kv_cache_free_blocks"] == m["pdserve:kv_cache_total_blocks"]
                and m["pdserve:num_requests_running"] == 0
                and m["pdserve:num_requests_waiting"] == 0):
            return m
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks not all free: {m}")
        time.sleep(0.05)


@pytest.fixture
def client(server: str) -> Iterator[openai.OpenAI]:
    c = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()
    _wait_all_blocks_free(server)


GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}


@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_completion_greedy_matches_offline(client: openai.OpenAI, offline: dict,
                                           length: int) -> None:
    text, tokens = offline[length]
    r = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(length), **GREEDY)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (length, len(tokens))
    stream = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(length),
                                       stream=True, stream_options={"include_usage": True},
                                       **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_chat_greedy_matches_offline(client: openai.OpenAI, offline: dict) -> None:
    text, _ = offline["chat"]
    r = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, **GREEDY)
    assert r.choices[0].message.content == text
    assert r.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, stream=True,
                                            **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == text


def test_stop_strings_wait_for_min_tokens(client: openai.OpenAI, offline: dict,
                                          tiny_llama_path: str) -> None:
    """A stop string that the first token's text matches is ignored while fewer than
    ``min_tokens`` tokens exist (as in vLLM); a later one stops the request. Plain and
    streamed alike."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    _, tokens = offline[17]
    first, seventh = (tokenizer.decode(tokens[i : i + 1], skip_special_tokens=True) for i in (0, 6))
    assert first.strip() and seventh.strip(), "pick tokens with text"
    full = tokenizer.decode(tokens, skip_special_tokens=True)
    head = tokenizer.decode(tokens[:5], skip_special_tokens=True)
    assert full.find(seventh, len(head) - len(seventh) + 1) == len(
        tokenizer.decode(tokens[:6], skip_special_tokens=True)), "pick a later stop string"
    expected = full[: full.find(seventh, len(head) - len(seventh) + 1)]
    kw = dict(GREEDY, stop=[first, seventh], extra_body={"ignore_eos": True, "min_tokens": 5})
    r = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(17), **kw)
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 7
    stream = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(17), stream=True,
                                       stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == 7


def test_stop_token_text_is_left_out(client: openai.OpenAI, offline: dict,
                                     tiny_llama_path: str) -> None:
    """A ``stop_token_ids`` token ends the request with ``stop``: it is counted in the usage,
    its text is not in the answer (as in vLLM). Both endpoints, plain and streamed alike."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_path)
    for key in (17, "chat"):
        _, tokens = offline[key]
        # the first token (after the second) not seen before: the request stops there
        k = next((i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i]), None)
        assert k is not None, f"no fresh token in {tokens}"
        expected = tokenizer.decode(tokens[:k], skip_special_tokens=True)
        kw = dict(GREEDY, extra_body={"ignore_eos": True, "stop_token_ids": [tokens[k]]})
        if key == "chat":
            r = client.chat.completions.create(model=SERVED_NAME, messages=CHAT, **kw)
            text = r.choices[0].message.content
            chunks = list(client.chat.completions.create(
                model=SERVED_NAME, messages=CHAT, stream=True,
                stream_options={"include_usage": True}, **kw))
            streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            r = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(key), **kw)
            text = r.choices[0].text
            chunks = list(client.completions.create(
                model=SERVED_NAME, prompt=_prompt_ids(key), stream=True,
                stream_options={"include_usage": True}, **kw))
            streamed = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == streamed == expected, key
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == k + 1
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
        assert chunks[-1].usage.completion_tokens == k + 1


def test_repeated_prompt_hits_prefix_cache(client: openai.OpenAI, offline: dict) -> None:
    ids = _prompt_ids(33)
    client.completions.create(model=SERVED_NAME, prompt=ids, **GREEDY)
    r = client.completions.create(model=SERVED_NAME, prompt=ids, **GREEDY)
    assert r.choices[0].text == offline[33][0]
    assert r.usage.prompt_tokens_details.cached_tokens == 32  # two full blocks of 16


def test_n_and_concurrent_requests(client: openai.OpenAI, offline: dict) -> None:
    r = client.completions.create(model=SERVED_NAME, prompt=_prompt_ids(17), n=3, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert all(c.text == offline[17][0] for c in r.choices)
    assert r.usage.completion_tokens == 3 * MAX_TOKENS and r.usage.prompt_tokens == 17
    r = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", n=2, seed=11,
                                  temperature=1.0, max_tokens=8)
    assert len(r.choices) == 2
    again = client.completions.create(model=SERVED_NAME, prompt="Once upon a time", n=2,
                                      seed=11, temperature=1.0, max_tokens=8)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_bad_requests_through_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=SERVED_NAME, prompt=[5] * 300, max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=SERVED_NAME, prompt=[5] * 200, max_tokens=100)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=SERVED_NAME, messages=[], max_tokens=1)
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]


def test_disconnect_mid_stream_frees_blocks(server: str, client: openai.OpenAI) -> None:
    with httpx.Client(base_url=server, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json={
                "prompt": _prompt_ids(40), "max_tokens": 200, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
    m = _wait_all_blocks_free(server)
    assert m["pdserve:generation_tokens_total"] > 0
    text = httpx.get(server + "/metrics").text
    aborted = [s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "pdserve:request_success_total"
               and s.labels == {"finish_reason": "abort"}]
    assert aborted and aborted[0] >= 1


def test_engine_death_stops_the_server(tiny_llama_path: str, tmp_path) -> None:
    log = tmp_path / "serve.log"
    srv = _start_server(tiny_llama_path, log)
    proc = srv.proc
    try:
        children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        cores = [int(c) for c in children
                 if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
        assert len(cores) == 1, children
        os.kill(cores[0], signal.SIGKILL)
        proc.wait(timeout=60)
        assert proc.returncode == 1
        assert "engine died" in log.read_text()
    finally:
        srv.stop()
