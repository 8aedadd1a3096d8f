"""Watching a Server-Sent-Events stream for ``kv_transfer_params`` while it passes through.

The proxy feeds each chunk of D's stream here just before forwarding it, until the params are
found (the engine puts them on the final chunk), so that it records them before the client can
see the end of the turn. Scanning a chunk that lacks the text ``kv_transfer_params`` is one
substring search; only ``data:`` lines that contain it are JSON-decoded, and the last non-null
value wins.
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

    __slots__ = ("_partial", "kv_transfer_params")

    def __init__(self) -> None:
        self._partial = b""
        self.kv_transfer_params: dict[str, Any] | None = None

    def feed(self, chunk: bytes) -> None:
        """Scan the complete lines of ``chunk`` (bytes as received from D)."""
        data = self._partial + chunk if self._partial else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            self._partial = data
            return
        self._partial = data[cut + 1:]
        complete = data[:cut]
        if _NEEDLE not in complete:
            return
        for line in complete.split(b"\n"):
            if _NEEDLE in line:
                self._parse_line(line)

    def _parse_line(self, line: bytes) -> None:
        line = line.strip()
        if not line.startswith(b"data:"):
            return
        try:
            event = json.loads(line[5:])
        except ValueError:
            return
        if isinstance(event, dict):
            params = event.get("kv_transfer_params")
            if isinstance(params, dict):
                self.kv_transfer_params = params
