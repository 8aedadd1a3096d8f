"""A decoder's first token in its SSE stream: the commit point of the concurrent hand-off and the
end of the decode leg's ``pdserve:proxy_handoff_seconds``.

A pdserve decoder answers a streamed request with its headers at once and, for chat, an opening
chunk per choice (``delta: {"role": "assistant", "content": ""}``) before it has any token (its
KV read from the prefiller may still fail). :class:`FirstTokenWatch` parses the events up to
the first one that is not such an opening chunk (those before it go to the client as they come,
:mod:`pdserve.router.client_stream`); nothing after it is parsed.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from time import perf_counter
from typing import Any, Callable

from pdserve.router.stream_ledger import SSEEvents, sse_event


class FirstEventKind(enum.Enum):
    """What ended a stream's opening."""

    TOKEN = "token"  # an event with output (or anything the watch does not know: committed)
    ERROR = "error"  # an in-band error event before any token


@dataclass(frozen=True)
class FirstEvent:
    """The first event of a stream that is not an opening chunk.

    Attributes:
        kind: token or in-band error.
        code: the error's HTTP status (``error.code``), for an error.
        param: the error's ``param``, for an error.
        payload: the event's ``data`` (an error's OpenAI-shaped body).
    """

    kind: FirstEventKind
    code: int | None = None
    param: str | None = None
    payload: bytes = b""


class FirstTokenWatch:
    """Feeds on a stream's bytes until its first token (or in-band error) event.

    Attributes:
        parsed: ``(payload, value)`` of every event it parsed as JSON, in stream order: a relay
            that parses the same events again takes these instead (the opening chunk carries
            the prompt's token ids).
        openings: ``(payload, value)`` of the opening chunks the last :meth:`feed` completed,
            in stream order (the client gets them as they come:
            :mod:`pdserve.router.client_stream`).
    """

    __slots__ = ("_events", "_rest", "parsed", "openings")

    def __init__(self) -> None:
        self._events = SSEEvents()
        self._rest: list[bytes] = []
        self.parsed: list[tuple[bytes, Any]] = []
        self.openings: list[tuple[bytes, Any]] = []

    def feed(self, chunk: bytes) -> FirstEvent | None:
        """The first event that is not an opening chunk, once ``chunk`` completes it; None
        while only opening chunks (or a partial event) came."""
        self.openings = []
        payloads = self._events.feed(chunk)
        for i, payload in enumerate(payloads):
            event = self._event(payload)
            if event is not None:
                self._rest = payloads[i:]
                return event
        return None

    @property
    def comments(self) -> int:
        """The comment-only blocks (keep-alives) the last :meth:`feed` completed."""
        return self._events.comments

    def rest(self) -> bytes:
        """Once :meth:`feed` returned the first event: the stream read so far from that event
        on (each complete event as one SSE event, then the start of the next one)."""
        return b"".join(sse_event(p) for p in self._rest) + self._events.pending

    def _event(self, payload: bytes) -> FirstEvent | None:
        if payload == b"[DONE]":
            return FirstEvent(FirstEventKind.TOKEN)
        try:
            value = json.loads(payload)
        except ValueError:
            return FirstEvent(FirstEventKind.TOKEN)
        self.parsed.append((payload, value))
        event = _first_event(payload, value)
        if event is None:
            self.openings.append((payload, value))
        return event


class DecodeTimer:
    """Observes the decode leg's hand-off time once, when its first token reaches the proxy.

    Args:
        observe: ``observe(seconds)`` (the ``decode`` child of ``pdserve:proxy_handoff_seconds``).
        t_sent: ``perf_counter()`` when the decode leg was sent.
    """

    __slots__ = ("_observe", "_t_sent", "_watch")

    def __init__(self, observe: Callable[[float], None], t_sent: float):
        self._observe = observe
        self._t_sent = t_sent
        self._watch = FirstTokenWatch()

    def feed(self, chunk: bytes) -> bool:
        """Look at one relayed chunk; True once the time was observed (feed no more)."""
        if self._watch.feed(chunk) is None:
            return False
        self._observe(perf_counter() - self._t_sent)
        return True


def _first_event(payload: bytes, event: Any) -> FirstEvent | None:
    """What one parsed event (``payload`` parsed: ``event``) says about the stream's start."""
    if not isinstance(event, dict):
        return FirstEvent(FirstEventKind.TOKEN)
    error = event.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        param = error.get("param")
        return FirstEvent(FirstEventKind.ERROR,
                          code if isinstance(code, int) and not isinstance(code, bool) else None,
                          param if isinstance(param, str) else None, payload)
    choices = event.get("choices")
    if isinstance(choices, list) and choices and all(_opening(c) for c in choices):
        return None
    return FirstEvent(FirstEventKind.TOKEN)


def _opening(choice: Any) -> bool:
    """A chat stream's opening choice: the assistant role, no content, no tokens, not finished."""
    if not isinstance(choice, dict) or choice.get("finish_reason") is not None:
        return False
    if choice.get("token_ids") or choice.get("logprobs") is not None or choice.get("text"):
        return False
    delta = choice.get("delta")
    return (isinstance(delta, dict) and set(delta) <= {"role", "content"}
            and not delta.get("content"))
