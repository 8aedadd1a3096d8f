"""Watching a Server-Sent-Events stream for ``kv_transfer_params`` while it passes through.

The proxy feeds each chunk of D's stream here just before forwarding it (the engine puts the
params on the final chunk), so that it records them before the client can see the end of the
turn. Scanning a chunk that lacks the text ``kv_transfer_params`` is one substring search; only
``data:`` lines that contain it are JSON-decoded, and the last non-null value wins.

With ``strip`` (the multi-turn proxy, which keeps D's params itself) the watcher also returns
what to forward: complete lines, an event's non-null ``kv_transfer_params`` replaced by
``null`` (what a client of a vLLM deployment sees from a decoder), an incomplete last line held
back until its end arrives (:meth:`KVParamsWatcher.flush` at the end of the stream).
"""

from __future__ import annotations

import json
from typing import Any

_NEEDLE = b'"kv_transfer_params"'


class KVParamsWatcher:
    """Incremental SSE line scanner that keeps the last ``kv_transfer_params`` object seen.

    Chunks may split lines (and events) anywhere; an incomplete trailing line is kept until its
    end arrives.
    """

    __slots__ = ("_partial", "_strip", "kv_transfer_params")

    def __init__(self, strip: bool = False) -> None:
        self._partial = b""
        self._strip = strip
        self.kv_transfer_params: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> bytes:
        """Scan the complete lines of ``chunk`` (bytes as received from D).

        Returns:
            What to forward now: ``chunk`` itself without ``strip``; with it, the complete lines
            received so far (params replaced by null), the incomplete last line held back.
        """
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._partial = data
            return chunk if not self._strip else b""
        self._partial = data[cut + 1:]
        complete = data[:cut + 1]
        if _NEEDLE not in complete:
            return chunk if not self._strip else complete
        lines = complete.split(b"\n")
        for i, line in enumerate(lines):
            if _NEEDLE in line:
                lines[i] = self._parse_line(line)
        return chunk if not self._strip else b"\n".join(lines)

    def flush(self) -> bytes:
        """The held-back incomplete last line (with ``strip``; empty otherwise), at the end of
        the stream."""
        rest, self._partial = (self._partial if self._strip else b""), b""
        return rest

    def _parse_line(self, line: bytes) -> bytes:
        """Record the params of one ``data:`` line; returns the line to forward (the params
        replaced by null with ``strip``)."""
        text = line.strip()
        if not text.startswith(b"data:"):
            return line
        try:
            event = json.loads(text[5:])
        except ValueError:
            return line
        if isinstance(event, dict):
            params = event.get("kv_transfer_params")
            if isinstance(params, dict):
                self.kv_transfer_params = params
                if self._strip:
                    event["kv_transfer_params"] = None
                    tail = b"\r" if line.endswith(b"\r") else b""
                    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + tail
        return line
