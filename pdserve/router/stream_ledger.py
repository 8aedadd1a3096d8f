"""What the client of a stream has received (:class:`StreamLedger`), read from the decode legs'
Server-Sent Events (:class:`SSEEvents`) as the proxy relays them: the opening chunks before D's
first token (:mod:`pdserve.router.client_stream`), then, in :mod:`pdserve.router.migration`, the
token ids, the response id, the finish, usage and ``[DONE]``; and the writing of one event
(:func:`sse_event`: the proxy's in-band errors).

A decoder sends an SSE comment (``: keep-alive``) when a stream has had nothing to send for a
while (:data:`pdserve.entrypoints.job_runner.KEEPALIVE_INTERVAL_S`): it is no event (no payload
here, never a first token), only bytes that show the decoder alive.
"""

from __future__ import annotations

import json
from typing import Any

#: Body field of a resumed request (the engine's ``ResumeFields``).
RESUME_FIELD = "pdserve_resume"
#: The end of an SSE stream.
SSE_DONE = b"data: [DONE]\n\n"
#: A keep-alive: an SSE comment, which clients ignore.
SSE_KEEPALIVE = b": keep-alive\n\n"

_encode = json.JSONEncoder(separators=(",", ":")).encode


class SSEEvents:
    """Splits a byte stream of Server-Sent Events into the ``data`` payloads of whole events.

    Attributes:
        comments: how many of the blocks completed by the last :meth:`feed` were only comments
            (lines starting with ``:``: keep-alives), which give no payload.
    """

    __slots__ = ("_buf", "comments")

    def __init__(self) -> None:
        self._buf = b""
        self.comments = 0

    def feed(self, chunk: bytes) -> list[bytes]:
        """The payloads (``data:`` lines joined) of the events completed by ``chunk``; a block
        without ``data:`` lines (a comment) is none."""
        # the buffer again too: a CRLF may be split between two chunks
        self._buf = (self._buf + chunk).replace(b"\r\n", b"\n")
        *events, self._buf = self._buf.split(b"\n\n")
        out = []
        self.comments = 0
        for event in events:
            lines = event.split(b"\n")
            data = [line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:")]
            if data:
                out.append(b"\n".join(data))
            elif any(line.startswith(b":") for line in lines):
                self.comments += 1
        return out

    @property
    def pending(self) -> bytes:
        """The start of an event not complete yet (line ends as LF)."""
        return self._buf


class StreamLedger:
    """What the client of one stream has received: the prompt's and the output's token ids,
    the response id, the choices whose opening chunk went out, whether the choice finished,
    whether usage and ``[DONE]`` were sent.

    Every chunk after the first one forwarded gets that chunk's ``id`` and ``created`` (they
    are per engine request: a chunk of a later decode leg of the turn, a retry before D's first
    token or a migration, continues the first leg's response). ``model`` is the instances'
    served name, the same on each.

    Args:
        client_wants_ids: the client sent ``return_token_ids: true`` (else those fields are
            stripped).
        include_usage: the client asked for the final usage chunk.
    """

    def __init__(self, client_wants_ids: bool, include_usage: bool):
        self.client_wants_ids = client_wants_ids
        self.include_usage = include_usage
        self.prompt_token_ids: list[int] | None = None
        self.output_token_ids: list[int] = []
        self.response_id: Any = None
        self.created: Any = None
        self.object_name: Any = None
        self.model: Any = None
        self.opened: set[Any] = set()  # the choices (index) whose opening chunk went out
        self.finished = False  # the choice's finish_reason was forwarded
        self.usage_sent = False
        self.done = False  # [DONE] was forwarded

    @classmethod
    def for_request(cls, body: dict[str, Any]) -> StreamLedger:
        """The ledger of a stream asked for with the (checked) client ``body``."""
        usage = body.get("stream_options")
        return cls(body.get("return_token_ids") is True,
                   isinstance(usage, dict) and usage.get("include_usage") is True)

    def forward(self, event: dict[str, Any], raw: bytes | None = None) -> bytes | None:
        """The bytes to send the client for one chunk of a decode leg (None: nothing), after
        noting its token ids and usage. ``raw``: the event's payload as D sent it, sent as it
        is when nothing in the event changes (no re-encoding)."""
        if self.response_id is None:
            self.response_id, self.created = event.get("id"), event.get("created")
            self.object_name, self.model = event.get("object"), event.get("model")
        else:  # a later leg's chunks continue the first leg's response
            if "id" in event and event["id"] != self.response_id:
                event["id"], raw = self.response_id, None
            if "created" in event and event["created"] != self.created:
                event["created"], raw = self.created, None
        stripped = self._take_prompt_ids(event)
        choices = event.get("choices")
        only_tokens = bool(choices)
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            stripped = self._take_prompt_ids(choice) or stripped
            if self.client_wants_ids:
                ids = choice.get("token_ids")
            else:  # the token id fields are stripped
                stripped = stripped or "token_ids" in choice
                ids = choice.pop("token_ids", None)
            if isinstance(ids, list):
                self.output_token_ids.extend(ids)
            if choice.get("finish_reason") is not None:
                self.finished = True
            only_tokens = only_tokens and _carries_nothing(choice)
        if event.get("usage") is not None:
            self.usage_sent = True
        if only_tokens and not self.client_wants_ids:
            return None  # a chunk the client would not have got without return_token_ids
        if stripped:
            raw = None
        return b"data: " + (raw if raw is not None else _encode(event).encode()) + b"\n\n"

    def opening(self, event: dict[str, Any], raw: bytes | None = None) -> bytes | None:
        """The bytes to send the client for a decode leg's opening chunk (a chat stream's
        role-only event before D's first token:
        :attr:`pdserve.router.first_token.FirstTokenWatch.openings`): the event through
        :meth:`forward`, with only the choices whose opening the client has not had; None when
        it had each (the opening of a leg retried before D's first token).

        Raises:
            ValueError: the event's ``prompt_token_ids`` differ from those of the stream's first
                opening chunk (this leg's instance tokenized the prompt otherwise).
        """
        ids = event.get("prompt_token_ids")
        if isinstance(ids, list) and self.prompt_token_ids is not None \
                and ids != self.prompt_token_ids:
            raise ValueError(f"its prompt_token_ids ({len(ids)}) are not those of the opening "
                             f"chunk the client has ({len(self.prompt_token_ids)})")
        choices = event.get("choices")
        new = [c for c in choices if c.get("index") not in self.opened]
        if not new:
            return None
        if len(new) < len(choices):
            event["choices"], raw = new, None
        self.opened.update(c.get("index") for c in new)
        return self.forward(event, raw)

    def _take_prompt_ids(self, obj: dict[str, Any]) -> bool:
        """Note ``obj``'s ``prompt_token_ids`` (stripped unless the client wants them); True
        when they were stripped."""
        stripped = not self.client_wants_ids and "prompt_token_ids" in obj
        ids = obj.pop("prompt_token_ids") if stripped else obj.get("prompt_token_ids")
        if isinstance(ids, list) and self.prompt_token_ids is None:
            self.prompt_token_ids = ids
        return stripped

    def resumable(self) -> bool:
        """Whether the decode leg said which prompt ids it computed (needed to resume)."""
        return self.prompt_token_ids is not None

    def resumed_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """The client's body continued after the output so far (``pdserve_resume``)."""
        out = dict(body)
        out["return_token_ids"] = True
        out[RESUME_FIELD] = {"prompt_token_ids": self.prompt_token_ids,
                             "output_token_ids": list(self.output_token_ids)}
        return out

    def tail(self) -> bytes:
        """The end of a stream whose choice finished but whose decoder failed before the end:
        the usage chunk when asked for and not yet sent, then ``[DONE]``."""
        out = b""
        if self.include_usage and not self.usage_sent and self.prompt_token_ids is not None:
            prompt, completion = len(self.prompt_token_ids), len(self.output_token_ids)
            out = b"data: " + _encode({
                "id": self.response_id, "object": self.object_name, "created": self.created,
                "model": self.model, "choices": [],
                "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                          "total_tokens": prompt + completion}}).encode() + b"\n\n"
        return out + (b"" if self.done else SSE_DONE)


def _carries_nothing(choice: dict[str, Any]) -> bool:
    """True for a chunk's choice with no text, role, logprobs or finish (only token ids)."""
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return not any(v for k, v in delta.items() if k != "content") and not delta.get("content")
    return not choice.get("text")


def sse_event(payload: bytes) -> bytes:
    """``payload`` as one SSE event (``data: ...`` and the blank line that ends it).

    A payload on several lines (an upstream that indents its JSON) becomes one line of compact
    JSON (an event's ``data`` ends at its line's end; clients that read an event per line
    would see ``{``), or one ``data:`` line per line when it is no JSON."""
    if b"\n" in payload or b"\r" in payload:
        try:
            payload = _encode(json.loads(payload)).encode()
        except ValueError:
            lines = payload.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
            return b"".join(b"data: " + line + b"\n" for line in lines) + b"\n"
    return b"data: " + payload + b"\n\n"
