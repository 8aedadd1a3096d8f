"""One OpenAI chat-completions request, timed: streaming (SSE) or not.

The streaming parser follows the Server-Sent Events format (https://html.spec.whatwg.org/multipage/
server-sent-events.html): an event is one or more ``data:`` lines ended by a blank line; lines
starting with ``:`` are comments (keep-alives). OpenAI-compatible servers send one JSON chunk per
event and finish with ``data: [DONE]``; the last chunk carries ``usage`` when the request asked for
``stream_options.include_usage``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import httpx

# finish_reason values that mean the server gave up on the request rather than answering it.
FAILED_FINISH_REASONS = frozenset({"error", "abort"})


@dataclass
class ChatResponse:
    """What came back for one request.

    Attributes:
        ok: the server answered completely (HTTP 200, no error event, the stream finished).
        error: a one-line description when not ok.
        status: HTTP status code, or None when no response arrived.
        text: the answer (``content`` deltas concatenated; reasoning text is not included).
        reasoning: reasoning text (``reasoning_content`` / ``reasoning`` deltas), if any.
        ttft_s: seconds from sending to the first chunk with text (None when no text arrived, and
            always None without streaming).
        latency_s: seconds from sending to the end of the response (or to the failure).
        num_chunks: number of chunks that carried text (a chunk may hold several tokens).
        usage: the server's ``usage`` object, or None.
        finish_reason: the first choice's finish reason, or None.
    """

    ok: bool
    error: str | None
    status: int | None
    text: str = ""
    reasoning: str = ""
    ttft_s: float | None = None
    latency_s: float = 0.0
    num_chunks: int = 0
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None
    _pieces: list[str] = field(default_factory=list, repr=False)


def error_message(raw: bytes | str, limit: int = 300) -> str:
    """Extract a readable message from an error body (OpenAI ``{"error": {"message"}}`` or text)."""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    try:
        body = json.loads(text)
    except ValueError:
        body = None
    if isinstance(body, dict):
        err = body.get("error", body.get("detail", body.get("message")))
        if isinstance(err, dict):
            err = err.get("message") or json.dumps(err)
        if err is not None:
            text = err if isinstance(err, str) else json.dumps(err)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """Yield the data payload of each SSE event read from ``lines`` (multi-line data joined by ``\\n``)."""
    data: list[str] = []
    async for line in lines:
        line = line.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
        # other fields (event:, id:, retry:) carry nothing an OpenAI client needs
    if data:
        yield "\n".join(data)


async def post_chat_completion(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    timeout_s: float,
) -> ChatResponse:
    """POST ``body`` to ``url`` and time the answer; never raises for server or network failures.

    Args:
        client: shared async HTTP client.
        url: full ``.../v1/chat/completions`` URL.
        body: request body; ``body["stream"]`` selects SSE streaming.
        headers: extra request headers.
        timeout_s: limit for the whole request in seconds (a timeout is a failed request).
    """
    start = time.perf_counter()
    result = ChatResponse(ok=False, error=None, status=None)
    try:
        await asyncio.wait_for(_exchange(client, url, body, headers, start, result), timeout_s)
    except asyncio.TimeoutError:
        result.ok, result.error = False, f"timeout after {timeout_s:g} s"
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        result.ok = False
        result.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    result.latency_s = time.perf_counter() - start
    result.text = "".join(result._pieces)
    return result


async def _exchange(
    client: httpx.AsyncClient,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    start: float,
    result: ChatResponse,
) -> None:
    stream = bool(body.get("stream"))
    async with client.stream("POST", url, json=body, headers=headers) as response:
        result.status = response.status_code
        if response.status_code != 200:
            raw = await response.aread()
            result.error = f"HTTP {response.status_code}: {error_message(raw)}"
            return
        if not stream:
            raw = await response.aread()
            _read_full_body(raw, result)
            return
        done = False
        async for payload in sse_events(response.aiter_lines()):
            if payload.strip() == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(payload)
            except ValueError:
                result.error = f"malformed stream chunk: {payload[:120]!r}"
                return
            if not isinstance(chunk, dict):
                result.error = f"malformed stream chunk: {payload[:120]!r}"
                return
            if chunk.get("error") is not None:
                result.error = f"error in stream: {error_message(json.dumps(chunk))}"
                return
            if chunk.get("usage"):
                result.usage = chunk["usage"]
            choices = chunk.get("choices") or []
            if not choices:
                continue
            choice = choices[0]
            delta = choice.get("delta") or {}
            piece = delta.get("content") or ""
            thought = delta.get("reasoning_content") or delta.get("reasoning") or ""
            if piece or thought:
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - start
                result.num_chunks += 1
                result._pieces.append(piece)
                result.reasoning += thought
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if not done and result.finish_reason is None:
            result.error = "stream ended before [DONE]"
            return
    _check_finish(result)


def _read_full_body(raw: bytes, result: ChatResponse) -> None:
    try:
        data = json.loads(raw)
        choice = data["choices"][0]
        message = choice.get("message") or {}
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        result.error = f"malformed response body: {error_message(raw, 120)}"
        return
    result._pieces.append(message.get("content") or "")
    result.reasoning = message.get("reasoning_content") or message.get("reasoning") or ""
    result.num_chunks = 1 if (result._pieces[0] or result.reasoning) else 0
    result.usage = data.get("usage") or None
    result.finish_reason = choice.get("finish_reason")
    _check_finish(result)


def _check_finish(result: ChatResponse) -> None:
    if result.finish_reason in FAILED_FINISH_REASONS:
        result.error = f"server finished the request with finish_reason={result.finish_reason!r}"
        return
    result.ok = True
