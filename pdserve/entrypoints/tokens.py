"""Text of single tokens, for logprobs."""

from __future__ import annotations

from functools import lru_cache
from typing import Any


class TokenText:
    """Decodes one token id at a time (as the OpenAI API shows tokens in ``logprobs``).

    A token that is part of a multi-byte UTF-8 character decodes to U+FFFD on its own; that is
    what the client sees, and ``bytes`` in chat logprobs carry the same UTF-8 of that text.
    """

    def __init__(self, tokenizer: Any, cache_size: int = 65536):
        self._tokenizer = tokenizer
        self.text = lru_cache(maxsize=cache_size)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id], skip_special_tokens=False)
