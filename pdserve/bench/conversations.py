"""Benchmark input: conversations read from JSON or generated from a spec.

Two input forms are accepted (``-i/--input-file``):

* a JSON list of conversations, ``[{"id": str, "messages": [{"role", "content"}, ...]}, ...]``:
  optional leading ``system`` messages, then ``user`` / ``assistant`` alternating, starting with
  ``user``. The benchmark sends the user messages; the length in tokens of each recorded
  ``assistant`` message becomes the requested answer length of that turn (the answer text itself
  is replaced by what the server says).
* a generator spec ``{"filetype": "generate_conversations", ...}`` (see :func:`generate_conversations`).

Generation is deterministic: the same spec, tokenizer and seed give the same conversations.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.distributions import Distribution, SpecError, parse_distribution

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
DEFAULT_TEXT_FILE = DATA_DIR / "public_domain_prose.txt"
EXAMPLE_SPEC_FILE = DATA_DIR / "multi_turn_example.json"

GENERATE_FILETYPE = "generate_conversations"


@dataclass
class Turn:
    """One user turn of a conversation.

    Attributes:
        user: the user message text sent in this turn.
        output_tokens: requested answer length in tokens, or None when the input does not say.
    """

    user: str
    output_tokens: int | None


@dataclass
class Conversation:
    """A conversation to replay: leading system messages and the user turns, in order."""

    id: str
    turns: list[Turn]
    system: list[dict[str, str]] = field(default_factory=list)


def load_conversations(path: str | Path, tokenizer: Any, seed: int) -> list[Conversation]:
    """Read ``path`` and return the conversations it lists or specifies.

    Args:
        path: JSON file, either a conversation list or a ``generate_conversations`` spec.
        tokenizer: a ``transformers`` tokenizer; counts tokens of recorded answers and samples
            synthetic text in token units.
        seed: seed of the ``numpy.random.Generator`` used for generation.

    Raises:
        SpecError: unreadable file or malformed content (the message says what and where).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SpecError(f"cannot read input file {path}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise SpecError(f"input file {path} is not valid JSON: {exc}") from exc
    if isinstance(data, dict):
        if data.get("filetype") != GENERATE_FILETYPE:
            raise SpecError(
                f"input file {path}: a JSON object must have \"filetype\": \"{GENERATE_FILETYPE}\" "
                f"(got {data.get('filetype')!r}); otherwise give a JSON list of conversations"
            )
        return generate_conversations(data, tokenizer, seed, base_dir=path.parent)
    if isinstance(data, list):
        return parse_conversation_list(data, tokenizer)
    raise SpecError(f"input file {path}: expected a JSON list of conversations or a generator spec")


def parse_conversation_list(data: list[Any], tokenizer: Any) -> list[Conversation]:
    """Turn a decoded JSON conversation list into :class:`Conversation` objects.

    Raises:
        SpecError: missing fields, bad roles or role order, duplicate ids.
    """
    conversations: list[Conversation] = []
    seen: set[str] = set()
    for index, item in enumerate(data):
        where = f"conversation #{index}"
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list):
            raise SpecError(f'{where}: expected an object with a "messages" list')
        conv_id = str(item.get("id", index))
        where = f"conversation {conv_id!r}"
        if conv_id in seen:
            raise SpecError(f"{where}: duplicate id")
        seen.add(conv_id)
        system: list[dict[str, str]] = []
        turns: list[Turn] = []
        expect = "user"
        for m_index, message in enumerate(item["messages"]):
            if not isinstance(message, dict) or not isinstance(message.get("content"), str):
                raise SpecError(f'{where}, message {m_index}: expected {{"role", "content": str}}')
            role = message.get("role")
            if role == "system" and not turns:
                system.append({"role": "system", "content": message["content"]})
                continue
            if role != expect:
                raise SpecError(
                    f"{where}, message {m_index}: expected role {expect!r}, got {role!r} "
                    "(system messages first, then user and assistant alternating)"
                )
            if role == "user":
                turns.append(Turn(user=message["content"], output_tokens=None))
                expect = "assistant"
            else:
                n = len(tokenizer.encode(message["content"], add_special_tokens=False))
                turns[-1].output_tokens = n if n > 0 else None
                expect = "user"
        if not turns:
            raise SpecError(f"{where}: has no user message")
        conversations.append(Conversation(id=conv_id, turns=turns, system=system))
    if not conversations:
        raise SpecError("the input lists no conversations")
    return conversations


_SPEC_KEYS = {"filetype", "num_conversations", "text_files", "prompt_input", "prompt_output"}
_INPUT_KEYS = {"num_turns", "common_prefix_num_tokens", "prefix_num_tokens", "num_tokens"}
_OUTPUT_KEYS = {"num_tokens"}


def _check_keys(obj: Any, allowed: set[str], required: set[str], where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise SpecError(f"{where} must be a JSON object")
    unknown = set(obj) - allowed
    if unknown:
        raise SpecError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    missing = required - set(obj)
    if missing:
        raise SpecError(f"{where}: missing key(s) {sorted(missing)}")
    return obj


class _TextSampler:
    """Cuts pieces of a given length in tokens out of a token corpus (wrapping at its end)."""

    def __init__(self, tokenizer: Any, text: str):
        self._tokenizer = tokenizer
        self._ids = np.asarray(tokenizer.encode(text, add_special_tokens=False), dtype=np.int64)
        if self._ids.size == 0:
            raise SpecError("the text files hold no tokens")

    def sample(self, rng: np.random.Generator, num_tokens: int) -> str:
        if num_tokens <= 0:
            return ""
        start = int(rng.integers(0, self._ids.size))
        piece = np.take(self._ids, np.arange(start, start + num_tokens), mode="wrap")
        return self._tokenizer.decode(piece.tolist(), skip_special_tokens=True).strip()


def _read_text_files(names: Any, base_dir: Path) -> str:
    if names is None:
        names = []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise SpecError("text_files must be a list of file names")
    if not names:
        return DEFAULT_TEXT_FILE.read_text(encoding="utf-8")
    texts = []
    for name in names:
        candidates = [Path(name)] if Path(name).is_absolute() else [base_dir / name, Path(name)]
        for candidate in candidates:
            if candidate.is_file():
                texts.append(candidate.read_text(encoding="utf-8"))
                break
        else:
            tried = ", ".join(str(c) for c in candidates)
            raise SpecError(f"text_files: cannot find {name!r} (tried {tried})")
    return "\n\n".join(texts)


def generate_conversations(
    spec: dict[str, Any], tokenizer: Any, seed: int, base_dir: Path | None = None
) -> list[Conversation]:
    """Generate synthetic conversations from a ``generate_conversations`` spec.

    Spec keys: ``num_conversations`` (int), ``text_files`` (list of paths, relative to the spec
    file or the working directory; default: the public-domain text shipped in ``pdserve/data``),
    ``prompt_input``: ``num_turns`` (messages per conversation, user and assistant together, rounded
    up to an even number as in vLLM's spec format), ``common_prefix_num_tokens`` (one prefix shared
    by every conversation, optional), ``prefix_num_tokens`` (a prefix unique to each conversation,
    optional), ``num_tokens`` (tokens of each user message); ``prompt_output``: ``num_tokens``
    (answer length of each turn). Each count is a distribution (:mod:`pdserve.bench.distributions`).

    The common prefix and the conversation's own prefix are put in front of its first user message.
    Text pieces are cut at random token offsets from the text files, so each message has about the
    requested number of tokens (decoding and re-encoding can move a boundary token).

    Raises:
        SpecError: malformed spec or missing text file.
    """
    _check_keys(spec, _SPEC_KEYS, {"filetype", "num_conversations", "prompt_input", "prompt_output"}, "spec")
    num_conv = spec["num_conversations"]
    if isinstance(num_conv, bool) or not isinstance(num_conv, int) or num_conv <= 0:
        raise SpecError(f"num_conversations must be a positive integer, got {num_conv!r}")
    p_in = _check_keys(spec["prompt_input"], _INPUT_KEYS, {"num_turns", "num_tokens"}, "prompt_input")
    p_out = _check_keys(spec["prompt_output"], _OUTPUT_KEYS, {"num_tokens"}, "prompt_output")

    num_turns = parse_distribution(p_in["num_turns"], "prompt_input.num_turns")
    common_len = _optional(p_in, "common_prefix_num_tokens")
    prefix_len = _optional(p_in, "prefix_num_tokens")
    user_len = parse_distribution(p_in["num_tokens"], "prompt_input.num_tokens")
    answer_len = parse_distribution(p_out["num_tokens"], "prompt_output.num_tokens")

    text = _read_text_files(spec.get("text_files"), base_dir or Path.cwd())
    sampler = _TextSampler(tokenizer, text)
    rng = np.random.default_rng(seed)

    common_prefix = sampler.sample(rng, common_len.sample(rng)) if common_len else ""
    conversations = []
    width = max(4, len(str(num_conv - 1)))
    for index in range(num_conv):
        num_messages = max(2, num_turns.sample(rng))
        num_user_turns = math.ceil(num_messages / 2)
        own_prefix = sampler.sample(rng, prefix_len.sample(rng)) if prefix_len else ""
        turns = []
        for t in range(num_user_turns):
            user_text = sampler.sample(rng, user_len.sample(rng))
            if t == 0:
                user_text = "\n\n".join(p for p in (common_prefix, own_prefix, user_text) if p)
            turns.append(Turn(user=user_text, output_tokens=max(1, answer_len.sample(rng))))
        conversations.append(Conversation(id=f"conv-{index:0{width}d}", turns=turns))
    return conversations


def _optional(section: dict[str, Any], key: str) -> Distribution | None:
    if key not in section:
        return None
    return parse_distribution(section[key], f"prompt_input.{key}")
