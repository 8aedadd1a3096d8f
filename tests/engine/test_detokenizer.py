"""Incremental detokenisation (multi-byte characters split over tokens) and stop strings."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Hello world, this is a test.",
    "Ünïcödé — naïve café, 東京タワー and emoji 🎉🚀👍🏽 mixed in.",
    "  leading spaces\nnew lines\n\n\ttabs",
    "数学: ∑ᵢ xᵢ² ≥ 0; “quotes” and ‘single’ ones…",
]


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from pdserve.model_files.builtin_models import ensure_converted

    return AutoTokenizer.from_pretrained(str(ensure_converted()))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_streamed_text_equals_full_decode(tokenizer, text, chunk):
    prompt = tokenizer.encode("The answer:")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add_tokens(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert detok.text == "".join(deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits the emoji over tokens
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add_tokens([t]) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add_tokens(ids[-1:]) == "🎉"


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("Hi there") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
    assert text == "Hi there"


def test_random_token_streams_match_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(20):
        ids = [rng.randrange(0, tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        detok = IncrementalDetokenizer(tokenizer)
        text = "".join(detok.add_tokens([t]) for t in ids) + detok.flush()
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> tuple[str, str | None]:
    out = ""
    for p in pieces:
        emit, stop = matcher.feed(p)
        out += emit
        if stop is not None:
            return out, stop
    return out + matcher.flush(), None


@pytest.mark.parametrize("split", [1, 2, 5])
def test_stop_string_is_cut_and_never_streamed(split):
    text = "The answer is 42.\nUser: next question"
    pieces = [text[i : i + split] for i in range(0, len(text), split)]
    m = StopStringMatcher(["\nUser:", "never"])
    streamed = []
    for p in pieces:
        emit, stop = m.feed(p)
        streamed.append(emit)
        if stop:
            break
    assert "".join(streamed) == "The answer is 42."
    assert stop == "\nUser:"


def test_earliest_stop_string_wins_and_partial_prefix_is_released():
    m = StopStringMatcher(["abc", "bcd"])
    assert m.feed("xab") == ("x", None)  # "ab" may start "abc"
    assert m.feed("cd") == ("", "abc")
    m = StopStringMatcher(["STOP"])
    assert feed_all(m, ["ST", "OR", "Y"]) == ("STORY", None)


def test_no_stop_strings_passes_text_through():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", None)
    assert m.flush() == ""


def test_no_stop_string_ends_in_text_that_is_not_searched():
    """The text of the first ``min_tokens`` tokens (``search=False``) never ends a stop string,
    but one may begin there and end in later text (vLLM's rule)."""
    m = StopStringMatcher(["ab", "xyz"])
    assert m.feed("ab", search=False) == ("ab", None)  # a whole stop string, not searched
    assert m.feed("c") == ("c", None)  # ... and not found later either
    assert m.feed("xy", search=False) == ("", None)  # a possible start of "xyz" is held back
    assert m.feed("z!") == ("", "xyz")  # begins in unsearched text, ends in searched text
    m = StopStringMatcher(["ab"])
    assert m.feed("ab", search=False) == ("ab", None)
    assert m.feed("", search=True) == ("", None)
    assert feed_all(m, ["a", "b"]) == ("", "ab")
