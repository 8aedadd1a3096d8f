"""Incremental detokenisation and stop-string handling for streamed output.

Decoding one token at a time is wrong for byte-level BPE and SentencePiece tokenizers: a
multi-byte UTF-8 character can span several tokens (each alone decodes to U+FFFD), and some
tokenizers change a token's text depending on its left neighbour (leading-space handling). The
method here is the one of Hugging Face ``TextStreamer`` / vLLM's ``detokenize_incrementally``:
decode a short window of tokens before the new ones (``prefix``) and the window including the new
ones, and emit the difference, holding the new text back while it ends in U+FFFD (an incomplete
character).
"""

from __future__ import annotations

from typing import Any, Sequence

# Prompt tokens used as left context for the first output tokens (vLLM uses 5 as well).
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt_token_ids: the prompt (its last few tokens give left context).
        skip_special_tokens: drop special tokens (EOS...) from the text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_INITIAL_CONTEXT_TOKENS:])
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the newly completed text (may be empty)."""
        self._tokens.extend(token_ids)
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new, or an incomplete multi-byte character: wait
        if not new_text.startswith(prefix_text):
            # The left context changed its own rendering; emit from the common part on.
            common = 0
            while common < min(len(prefix_text), len(new_text)) and prefix_text[common] == new_text[common]:
                common += 1
            delta = new_text[common:]
        else:
            delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the sequence: emit whatever is still held back (even an incomplete
        character, rendered as U+FFFD, as a full decode would)."""
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset :])
        delta = new_text[len(prefix_text) :] if new_text.startswith(prefix_text) else ""
        self._prefix_offset = self._read_offset = len(self._tokens)
        self.text += delta
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text and holds back text that may be the start of one.

    Text fed with ``search=False`` (the text of a request's first ``min_tokens`` tokens) is kept
    and held back like any other, but no stop string may end in it; one may still begin there
    and end in later text. This is vLLM's rule for ``min_tokens`` with stop strings
    (``vllm/v1/engine/detokenizer.py``: stop strings are checked only once more than
    ``min_tokens`` tokens exist, in the text those later tokens added).

    Args:
        stop: the stop strings (empty strings are ignored).
    """

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self._text = ""  # all text seen
        self._emitted = 0  # characters of _text already returned

    def feed(self, delta: str, search: bool = True) -> tuple[str, str | None]:
        """Add a text delta.

        Args:
            delta: the new text.
            search: False while the text belongs to the first ``min_tokens`` tokens: no stop
                string may end in ``delta``.

        Returns:
            ``(text_to_emit, matched_stop)``: when a stop string ends in ``delta``, the text up
            to (not including) the earliest such stop string and that string; otherwise the
            text that can no longer be part of a stop string, and None.
        """
        if not self.stop:
            return delta, None
        old_len = len(self._text)
        self._text += delta
        best: tuple[int, str] | None = None
        for s in self.stop if search and delta else ():
            # Only matches that end in the new text (earlier text was searched, or not searchable).
            i = self._text.find(s, max(0, old_len - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            out = self._text[self._emitted : best[0]]
            self._emitted = len(self._text)
            return out, best[1]
        hold = 0
        for s in self.stop:  # longest suffix of the text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self._text)), hold, -1):
                if self._text.endswith(s[:k]):
                    hold = k
                    break
        safe = max(self._emitted, len(self._text) - hold)
        out = self._text[self._emitted : safe]
        self._emitted = safe
        return out, None

    def flush(self) -> str:
        """Release the held-back text (the sequence ended without a stop string)."""
        out = self._text[self._emitted :]
        self._emitted = len(self._text)
        return out
