"""Chat prompt tokenization with a piece cache: a conversation's history is tokenized once,
not again on every turn (:class:`SegmentCachedEncoder`, checked against plain ``encode``)."""

from __future__ import annotations

import logging
import threading
from array import array
from collections import OrderedDict
from typing import Any, Sequence

logger = logging.getLogger(__name__)


class SegmentCachedEncoder:
    """Tokenizes rendered chat prompts piece by piece, caching each piece's ids, so that a
    conversation's history is tokenized once instead of again on every turn.

    A fast (Rust) tokenizer cuts its input at added tokens before normalizing or
    pre-tokenizing anything, so for a text cut right before a special added token that does
    not strip whitespace on its left, ``encode(a + b) == encode(a) + encode(b)``. Prompts are
    cut before every such token (in a chat template: every message starts with one) and each
    piece is looked up in an LRU cache by its text. The equivalence is checked against a
    plain ``encode`` on sample texts (:meth:`self_check`), on the first ``verify_first``
    prompts and then every ``verify_every``-th; any difference turns the cache off for good
    (with a warning).

    Args:
        tokenizer: a ``transformers`` tokenizer; a slow one, or one without such special
            tokens, is simply used as is.
        max_tokens: cache bound (tokens over all cached pieces; ids are stored as int32).
        verify_first / verify_every: see above.
    """

    def __init__(self, tokenizer: Any, max_tokens: int = 1 << 22, verify_first: int = 8,
                 verify_every: int = 100):
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.verify_first = verify_first
        self.verify_every = verify_every
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._tokens = 0
        self._count = 0
        self._lock = threading.Lock()
        self.boundaries = self._boundary_tokens(tokenizer)
        self.enabled = bool(self.boundaries)

    @staticmethod
    def _boundary_tokens(tokenizer: Any) -> list[str]:
        if not getattr(tokenizer, "is_fast", False):
            return []
        found = []
        for tok in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
            content = getattr(tok, "content", None)
            if content and getattr(tok, "special", False) and getattr(tok, "lstrip", True) is False:
                found.append(content)
        return found

    def _pieces(self, text: str) -> list[str]:
        cuts = {0, len(text)}
        for b in self.boundaries:
            at = text.find(b, 1)
            while at != -1:
                cuts.add(at)
                at = text.find(b, at + 1)
        points = sorted(cuts)
        return [text[i:j] for i, j in zip(points, points[1:])]

    def _plain(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _agrees(self, text: str, ids: list[int]) -> tuple[bool, list[int]]:
        """``(piece ids == plain ids, plain ids)``; a difference turns the cache off for good."""
        plain = self._plain(text)
        if plain == ids:
            return True, plain
        logger.warning("tokenizing chat prompts piece by piece differs from tokenizing them "
                       "whole for this tokenizer; the piece cache is off")
        self.enabled = False
        with self._lock:
            self._cache.clear()
        return False, plain

    def self_check(self, texts: Sequence[str]) -> bool:
        """Compare the piece-by-piece encoding of ``texts`` with plain ``encode`` (without
        filling the cache); any difference turns the cache off. Returns whether it is on."""
        for text in texts:
            if not self.enabled:
                break
            pieces = self._pieces(text)
            ids = [i for piece in self.tokenizer(pieces, add_special_tokens=False)["input_ids"]
                   for i in piece] if pieces else []
            self._agrees(text, ids)
        return self.enabled

    def encode(self, text: str) -> list[int]:
        """``tokenizer.encode(text, add_special_tokens=False)``, from cached pieces where
        possible."""
        if not self.enabled:
            return self._plain(text)
        pieces = self._pieces(text)
        with self._lock:
            found = [self._cache.get(p) for p in pieces]
            for p, ids in zip(pieces, found):
                if ids is not None:
                    self._cache.move_to_end(p)
        todo = list(dict.fromkeys(p for p, ids in zip(pieces, found) if ids is None))
        if todo:
            encoded = self.tokenizer(todo, add_special_tokens=False)["input_ids"]
            new = {p: array("i", ids) for p, ids in zip(todo, encoded)}
            with self._lock:
                for p, ids in new.items():
                    if p not in self._cache:
                        self._cache[p] = ids
                        self._tokens += len(ids)
                while self._tokens > self.max_tokens and self._cache:
                    self._tokens -= len(self._cache.popitem(last=False)[1])
            found = [ids if ids is not None else new[p] for p, ids in zip(pieces, found)]
        out: list[int] = []
        for ids in found:
            out.extend(ids)
        self._count += 1
        if self._count <= self.verify_first or self._count % self.verify_every == 0:
            return self._agrees(text, out)[1]
        return out


def _sample_chats(tokenizer: Any) -> list[str]:
    """Chats rendered with the tokenizer's template for :meth:`SegmentCachedEncoder.self_check`:
    text next to message boundaries with leading and trailing spaces, newlines, tabs, digits,
    code, accents, CJK and emoji. Empty when there is no chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    contents = [" leading space", "trailing space ", "\n\nnew lines\n", "\tx = [1, 2, 3]\n",
                "12345 67.89", "déjà vu — ünïcödé", "中文字符和日本語", "emoji 🙂🚀 end", "  ", "a"]
    chats = []
    for shift in range(3):
        turns = contents[shift:] + contents[:shift]
        messages = [{"role": "system", "content": "You are a helpful assistant."}]
        messages += [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                     for i, c in enumerate(turns)]
        try:
            chats.append(tokenizer.apply_chat_template(messages, tokenize=False,
                                                       add_generation_prompt=True))
        except Exception:  # a template that refuses these roles: nothing to check against
            return []
    return chats
