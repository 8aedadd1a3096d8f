"""Fixtures for the benchmark tests: a word-level tokenizer and a recording fake OpenAI server.

The tokenizer maps every word and punctuation run of the shipped public-domain text to one token,
so token counts are exact after decoding and re-encoding, and it loads in milliseconds.

The fake server implements ``GET /v1/models`` and ``POST /v1/chat/completions`` (streaming SSE
with several tokens per chunk, or a plain JSON body), records every request it sees (body,
headers, the answer it gave and the token counts it reported), and can inject HTTP 500 errors and
in-stream error events for chosen request numbers.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.conversations import DEFAULT_TEXT_FILE

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}assistant :{% endif %}"
)


@pytest.fixture(scope="session")
def word_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a word-level tokenizer (with a chat template) built from the shipped text."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    text = DEFAULT_TEXT_FILE.read_text(encoding="utf-8")
    words = sorted(set(re.findall(r"\w+|[^\w\s]+", text)) | {"user", "assistant", "system", ":"})
    vocab = {"[UNK]": 0}
    for word in words:
        vocab.setdefault(word, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = CHAT_TEMPLATE
    path = tmp_path_factory.mktemp("word_tokenizer")
    tokenizer.save_pretrained(str(path))
    return path


@pytest.fixture(scope="session")
def word_tokenizer(word_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(word_tokenizer_dir), local_files_only=True)


@dataclass
class SeenRequest:
    """One request as the fake server saw and answered it."""

    index: int
    body: dict[str, Any]
    headers: dict[str, str]
    status: int = 200
    answer: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_chunks: int = 0


@dataclass
class FakeServerOptions:
    chunk_tokens: int = 3
    send_usage: bool = True
    fail_requests: set[int] = field(default_factory=set)  # answered with HTTP 500
    stream_error_requests: set[int] = field(default_factory=set)  # error event mid-stream
    first_token_delay_s: float = 0.0
    chunk_delay_s: float = 0.0
    default_max_tokens: int = 5
    model_id: str = "fake-model"


class FakeOpenAIServer:
    """An OpenAI-compatible chat server on a free local port, in a background thread."""

    def __init__(self, tokenizer: Any, options: FakeServerOptions):
        self.tokenizer = tokenizer
        self.options = options
        self.requests: list[SeenRequest] = []
        self._lock = threading.Lock()
        self._answer_words = [w for w in tokenizer.get_vocab() if w.isalpha()]
        self._answer_words.sort()
        self._server = None
        self._thread: threading.Thread | None = None
        self.url = ""

    def _answer(self, index: int, num_tokens: int) -> list[str]:
        words = self._answer_words
        return [words[(index * 7 + i) % len(words)] for i in range(num_tokens)]

    def _app(self):
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        opts = self.options

        async def models(_: Request):
            return JSONResponse({"object": "list", "data": [{"id": opts.model_id, "object": "model"}]})

        async def chat(request: Request):
            body = await request.json()
            with self._lock:
                seen = SeenRequest(index=len(self.requests), body=body, headers=dict(request.headers))
                self.requests.append(seen)
            if seen.index in opts.fail_requests:
                seen.status = 500
                return JSONResponse(
                    {"error": {"message": "injected failure", "type": "server_error", "code": 500}},
                    status_code=500,
                )
            n = int(body.get("max_tokens") or opts.default_max_tokens)
            words = self._answer(seen.index, n)
            seen.answer = " ".join(words)
            ids = self.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True
            )
            seen.prompt_tokens = len(ids["input_ids"] if hasattr(ids, "keys") else ids)
            seen.completion_tokens = n
            usage = {"prompt_tokens": seen.prompt_tokens, "completion_tokens": n,
                     "total_tokens": seen.prompt_tokens + n}
            base = {"id": f"chatcmpl-{seen.index}", "object": "chat.completion.chunk",
                    "created": int(time.time()), "model": opts.model_id}
            if not body.get("stream"):
                data = {**base, "object": "chat.completion",
                        "choices": [{"index": 0, "finish_reason": "length",
                                     "message": {"role": "assistant", "content": seen.answer}}]}
                if opts.send_usage:
                    data["usage"] = usage
                return JSONResponse(data)

            async def events():
                def sse(obj: Any) -> str:
                    return f"data: {json.dumps(obj)}\n\n"

                yield sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
                await asyncio.sleep(opts.first_token_delay_s)
                c = opts.chunk_tokens
                for start in range(0, n, c):
                    if start > 0:
                        await asyncio.sleep(opts.chunk_delay_s)
                    if seen.index in opts.stream_error_requests and start > 0:
                        yield sse({"error": {"message": "injected stream error", "code": 500}})
                        return
                    text = " ".join(words[start:start + c])
                    piece = text if start == 0 else " " + text
                    seen.num_chunks += 1
                    yield sse({**base, "choices": [{"index": 0, "delta": {"content": piece}}]})
                yield sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})
                include_usage = (body.get("stream_options") or {}).get("include_usage")
                if opts.send_usage and include_usage:
                    yield sse({**base, "choices": [], "usage": usage})
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[Route("/v1/models", models, methods=["GET"]),
                                 Route("/v1/chat/completions", chat, methods=["POST"])])

    def start(self) -> None:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self._app(), log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake OpenAI server did not start")
            time.sleep(0.01)
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)

    def reset(self) -> None:
        with self._lock:
            self.requests.clear()


@pytest.fixture
def fake_server_factory(word_tokenizer):
    """Call with FakeServerOptions fields as keyword arguments; servers stop at teardown."""
    servers: list[FakeOpenAIServer] = []

    def make(**kwargs: Any) -> FakeOpenAIServer:
        server = FakeOpenAIServer(word_tokenizer, FakeServerOptions(**kwargs))
        servers.append(server)
        server.start()
        return server

    try:
        yield make
    finally:
        for server in servers:
            server.stop()
