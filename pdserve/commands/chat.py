"""``pdserve chat``: a small interactive terminal chat against any OpenAI-compatible endpoint.

It keeps the conversation history and one ``conversation_id`` (sent in the request body, which the
multi-turn proxy uses to reuse the previous turn's KV cache), streams tokens as they arrive, and
after every answer prints the time to first token (TTFT) and how many prompt tokens were served
from already-computed KV (``usage.prompt_tokens_details.cached_tokens`` of the final streamed
chunk, requested with ``stream_options.include_usage``).

A model without a chat template (a base model such as ``gemma3-270m``) cannot answer
``/v1/chat/completions``; the session then continues the text through ``/v1/completions``
instead (:class:`ChatMode`), the prompt being the conversation so far, and says so once.
``--completions`` starts in that mode.

Commands: ``/reset`` starts a new conversation, ``/exit`` (or Ctrl-D) quits.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterator, Sequence, TextIO

import httpx
from pdserve.commands.parser import Parser

DEFAULT_URL = "http://127.0.0.1:8000"
HELP_TEXT = "commands: /reset = new conversation, /exit or Ctrl-D = quit, /help = this text"


class ChatError(Exception):
    """The endpoint answered with an error (HTTP status or an error event in the stream).

    Attributes:
        no_chat_template: the server refused a chat request because its model has no chat
            template (a 400 naming it).
    """

    def __init__(self, message: str, no_chat_template: bool = False):
        super().__init__(message)
        self.no_chat_template = no_chat_template


class ChatMode(Enum):
    """Which endpoint a session's turns go to."""

    CHAT = "chat"  # /v1/chat/completions, the history as messages
    COMPLETION = "completion"  # /v1/completions, the history as one text the model continues


#: Parts of the 400 message of a server whose model has no chat template: pdserve's ("This model
#: has no chat template; use /v1/completions.") and vLLM's ("... you must provide a chat template
#: if the tokenizer does not define one."). A template that refuses a conversation is not one.
NO_CHAT_TEMPLATE = ("no chat template", "must provide a chat template")
COMPLETION_NOTE = ("(this model has no chat template: pdserve chat now sends /v1/completions, "
                   "and the model continues the conversation's text)")


@dataclass
class TurnStats:
    """Measurements of one answered turn.

    Attributes:
        ttft_s: seconds from sending the request to the first streamed content token (None when
            the answer had no content).
        total_s: seconds from sending to the end of the stream.
        prompt_tokens, completion_tokens: from the final usage chunk (None if not reported).
        cached_tokens: prompt tokens whose KV was reused (prefix cache or transferred), from
            ``usage.prompt_tokens_details.cached_tokens`` (None if not reported).
        finish_reason: the choice's finish reason.
    """

    ttft_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None


def new_conversation_id() -> str:
    """A fresh random conversation id (``chat-`` + 16 hex digits)."""
    return f"chat-{uuid.uuid4().hex[:16]}"


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
        error = body.get("error", body)
        if isinstance(error, dict):
            return str(error.get("message") or error)
        return str(error)
    except (ValueError, AttributeError):
        return response.text.strip() or response.reason_phrase


def _sse_events(lines: Iterator[str]) -> Iterator[dict]:
    """Parses Server-Sent Events ``data:`` lines into JSON objects, stopping at ``[DONE]``."""
    for line in lines:
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        if data:
            try:
                yield json.loads(data)
            except json.JSONDecodeError:
                raise ChatError(f"malformed stream event: {data[:200]}") from None


class ChatSession:
    """Conversation state against one endpoint.

    Args:
        client: an ``httpx.Client`` whose ``base_url`` is the endpoint (``http://host:port``).
        model: the model name to send.
        system: optional system prompt, kept across ``reset``.
        max_tokens, temperature: sampling options sent with every turn (None: server default).
        mode: the endpoint of the turns; a chat session whose server has no chat template
            switches to :attr:`ChatMode.COMPLETION` at its first turn (:meth:`send`).
    """

    def __init__(self, client: httpx.Client, model: str, system: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None,
                 mode: ChatMode = ChatMode.CHAT):
        self.client = client
        self.model = model
        self.system = system
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.mode = mode
        self.messages: list[dict] = []
        self.conversation_id = ""
        self.reset()

    def reset(self) -> None:
        """Forgets the history (keeps the system prompt) and takes a new conversation id."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.conversation_id = new_conversation_id()

    def prompt_text(self) -> str:
        """The conversation as one text (completion mode): the messages' contents, one per
        line, ending with a line break after the last user text."""
        return "".join(m["content"] + "\n" for m in self.messages)

    def request_body(self) -> dict:
        body: dict = {"model": self.model, "stream": True,
                      "stream_options": {"include_usage": True},
                      "conversation_id": self.conversation_id}
        if self.mode is ChatMode.CHAT:
            body["messages"] = self.messages
        else:
            body["prompt"] = self.prompt_text()
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        if self.temperature is not None:
            body["temperature"] = self.temperature
        return body

    def send(self, text: str, on_token: Callable[[str], None],
             on_note: Callable[[str], None] = lambda note: None) -> TurnStats:
        """Sends one user turn and streams the answer to ``on_token``.

        The user message and the answer are added to the history only when the turn completes;
        on an error or Ctrl-C the history is unchanged. A chat turn refused because the model
        has no chat template is sent again in completion mode, which the session keeps
        (``on_note`` is told once, with :data:`COMPLETION_NOTE`).

        Raises:
            ChatError: HTTP error status or an error event in the stream.
            httpx.HTTPError: connection problems.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            try:
                stats, answer = self._stream(on_token)
            except ChatError as exc:
                if self.mode is not ChatMode.CHAT or not exc.no_chat_template:
                    raise
                self.mode = ChatMode.COMPLETION
                on_note(COMPLETION_NOTE)
                stats, answer = self._stream(on_token)
        except BaseException:
            self.messages.pop()
            raise
        self.messages.append({"role": "assistant", "content": answer})
        return stats

    def _stream(self, on_token: Callable[[str], None]) -> tuple[TurnStats, str]:
        stats = TurnStats()
        parts: list[str] = []
        start = time.perf_counter()
        path = "/v1/chat/completions" if self.mode is ChatMode.CHAT else "/v1/completions"
        with self.client.stream("POST", path, json=self.request_body()) as resp:
            if resp.status_code != 200:
                resp.read()
                message = _error_message(resp)
                raise ChatError(f"HTTP {resp.status_code}: {message}",
                                no_chat_template=resp.status_code == 400
                                and any(m in message for m in NO_CHAT_TEMPLATE))
            for event in _sse_events(resp.iter_lines()):
                if "error" in event:
                    error = event["error"]
                    raise ChatError(error.get("message", str(error)) if isinstance(error, dict)
                                    else str(error))
                for choice in event.get("choices") or []:
                    delta = (choice.get("text") if self.mode is ChatMode.COMPLETION
                             else (choice.get("delta") or {}).get("content"))
                    if delta:
                        if stats.ttft_s is None:
                            stats.ttft_s = time.perf_counter() - start
                        parts.append(delta)
                        on_token(delta)
                    if choice.get("finish_reason"):
                        stats.finish_reason = choice["finish_reason"]
                usage = event.get("usage")
                if usage:
                    stats.prompt_tokens = usage.get("prompt_tokens")
                    stats.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    stats.cached_tokens = details.get("cached_tokens")
        stats.total_s = time.perf_counter() - start
        return stats, "".join(parts)


def format_stats(stats: TurnStats) -> str:
    """One line: TTFT in ms, tokens and decode speed, and whether KV was reused."""
    items = []
    items.append(f"TTFT {stats.ttft_s * 1000:.0f} ms" if stats.ttft_s is not None else "TTFT n/a")
    if stats.completion_tokens is not None:
        items.append(f"{stats.completion_tokens} tokens in {stats.total_s:.2f} s")
        if stats.ttft_s is not None and stats.completion_tokens > 1 and stats.total_s > stats.ttft_s:
            rate = (stats.completion_tokens - 1) / (stats.total_s - stats.ttft_s)
            items.append(f"{rate:.1f} tok/s")
    if stats.cached_tokens is None:
        items.append("KV reuse: not reported")
    elif stats.cached_tokens > 0:
        of = f" of {stats.prompt_tokens}" if stats.prompt_tokens is not None else ""
        items.append(f"KV reused: {stats.cached_tokens}{of} prompt tokens")
    else:
        of = f" (0 of {stats.prompt_tokens} prompt tokens)" if stats.prompt_tokens else ""
        items.append(f"KV reused: no{of}")
    if stats.finish_reason == "length":
        items.append("cut at max_tokens")
    return "[" + " | ".join(items) + "]"


def discover_model(client: httpx.Client) -> str:
    """The first model id listed by ``GET /v1/models``.

    Raises:
        ChatError: error status or an empty list.
        httpx.HTTPError: connection problems.
    """
    resp = client.get("/v1/models")
    if resp.status_code != 200:
        raise ChatError(f"GET /v1/models: HTTP {resp.status_code}: {_error_message(resp)}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise ChatError("GET /v1/models listed no model; pass --model") from None


def build_parser() -> argparse.ArgumentParser:
    """The ``pdserve chat`` argument parser."""
    p = Parser(
        prog="pdserve chat", epilog=HELP_TEXT,
        description="Interactive chat against an OpenAI-compatible endpoint: streams the answer, "
                    "keeps a conversation_id, and shows each turn's TTFT and KV reuse.")
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"endpoint base URL, with or without /v1 (default {DEFAULT_URL})")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' (default $OPENAI_API_KEY)")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=256, help="answer length limit (default 256)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the server's)")
    p.add_argument("--completions", action="store_true",
                   help="send /v1/completions (the model continues the conversation's text), "
                        "for a model without a chat template; chosen by itself when the server "
                        "says so")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the server (connect, and between tokens)")
    return p


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def run(args: argparse.Namespace, stdin: TextIO, out: TextIO) -> int:
    """The read-eval-print loop; returns the exit code."""
    interactive = stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def read_line(prompt: str) -> str:
        if interactive:
            return input(prompt)
        out.write(prompt)
        out.flush()
        line = stdin.readline()
        if not line:
            raise EOFError
        out.write(line if line.endswith("\n") else line + "\n")
        return line.rstrip("\n")

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    timeout = httpx.Timeout(args.timeout, connect=min(args.timeout, 10.0))
    with httpx.Client(base_url=_base_url(args.url), headers=headers, timeout=timeout) as client:
        try:
            model = args.model or discover_model(client)
        except (ChatError, httpx.HTTPError) as exc:
            print(f"pdserve chat: cannot reach {args.url}: {exc}", file=sys.stderr)
            return 1
        session = ChatSession(client, model, system=args.system, max_tokens=args.max_tokens,
                              temperature=args.temperature,
                              mode=ChatMode.COMPLETION if args.completions else ChatMode.CHAT)
        print(f"pdserve chat: {_base_url(args.url)}, model {model}, conversation "
              f"{session.conversation_id}\n{HELP_TEXT}", file=out, flush=True)
        while True:
            try:
                line = read_line("you> ")
            except (EOFError, KeyboardInterrupt):
                print(file=out)
                return 0
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                session.reset()
                print(f"(new conversation {session.conversation_id})", file=out, flush=True)
                continue
            if text == "/help":
                print(HELP_TEXT, file=out, flush=True)
                continue
            if text.startswith("/"):
                print(f"unknown command {text.split()[0]}; {HELP_TEXT}", file=out, flush=True)
                continue
            out.write("assistant> ")
            out.flush()

            def emit(token: str) -> None:
                out.write(token)
                out.flush()

            def note(text: str) -> None:
                out.write(f"{text}\nassistant> ")
                out.flush()

            try:
                stats = session.send(line, emit, note)
            except KeyboardInterrupt:
                print("\n(interrupted; this turn is not kept)", file=out, flush=True)
                continue
            except (ChatError, httpx.HTTPError) as exc:
                print(f"\nerror: {exc}", file=out, flush=True)
                continue
            print(f"\n{format_stats(stats)}", file=out, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``pdserve chat``; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    return run(args, sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
