"""Hand the prefiller's prompt token ids to the decoder, so the decoder does not tokenize the
same chat history again.

In a P/D flow both instances receive the same chat request and both render and tokenize it;
for a history of thousands of tokens the tokenizer's ``encode`` costs milliseconds on the
decoder's critical path. The prefiller adds the ids it computed to the ``kv_transfer_params`` it
returns (the proxy passes them to the decoder unchanged), together with the SHA-256 of the
rendered prompt text they were computed from. The decoder still renders the prompt (the chat
template is cheap; ``encode`` is the expensive part) and uses the ids only when its own text has
the same digest; otherwise it tokenizes as usual. Ids travel as base64 of little-endian uint32
(about 5.3 bytes per token in JSON, decoded without parsing a list).

Wire format: ``kv_transfer_params["prompt_tokens"] = {"text_sha256": hex, "ids": base64}``.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from array import array
from typing import Any

import numpy as np

KEY = "prompt_tokens"


def text_digest(text: str, vocab_size: int | None) -> str:
    """SHA-256 (hex) of a rendered prompt, bound to the tokenizer's vocabulary size."""
    h = hashlib.sha256(f"{vocab_size}\n".encode())
    h.update(text.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def encode(token_ids: list[int], digest: str) -> dict[str, Any]:
    """The ``kv_transfer_params["prompt_tokens"]`` value for a prompt.

    Raises:
        OverflowError: a token id does not fit in uint32.
    """
    arr = array("I", token_ids)
    if arr.itemsize != 4:  # pragma: no cover - every supported platform has 4-byte "I"
        arr = array("L", token_ids)
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return {"text_sha256": digest, "ids": base64.b64encode(arr.tobytes()).decode("ascii")}


def decode(value: Any, digest: str, vocab_size: int | None = None) -> list[int] | None:
    """The token ids carried in ``value`` when they were computed from a text with ``digest``;
    None when ``value`` is absent, malformed, for another text, or holds ids outside
    ``[0, vocab_size)``. The ids are only as trustworthy as the client that relayed them: the
    KV read that follows is checked against the prefiller's own tokens (the lease claim's token
    digest), so forged ids fail that read instead of mixing KV of different tokens."""
    if not isinstance(value, dict) or value.get("text_sha256") != digest:
        return None
    raw = value.get("ids")
    if not isinstance(raw, str):
        return None
    try:
        data = base64.b64decode(raw, validate=True)
    except ValueError:
        return None
    if not data or len(data) % 4:
        return None
    # numpy: the range check of a few thousand ids in C (a Python max() costs ~0.3 ms)
    ids = np.frombuffer(data, dtype="<u4")
    if vocab_size is not None and int(ids.max()) >= vocab_size:
        return None
    return ids.tolist()
