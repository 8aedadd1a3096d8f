"""Tokenizer loading for the engine front end, offline.

Sources, in order: ``config.tokenizer`` when given, else the model itself (the built-in
``smollm2-135m-instruct`` name, a Hugging Face directory, or a ``.gguf`` file, whose embedded
vocabulary ``transformers`` reads). A ``--load-format dummy`` model whose directory has only a
``config.json`` gets a byte-level tokenizer (256 byte tokens plus ``<s>``/``</s>``), enough to
run speed benchmarks on token ids; its ids above 257 decode to nothing.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

from pdserve.types.engine_config import EngineConfig
from pdserve.model_files.builtin_models import resolve_model_path

logger = logging.getLogger("pdserve.model")

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """True when ``directory`` holds a Hugging Face tokenizer."""
    d = Path(directory)
    return d.is_dir() and any((d / f).is_file() for f in _TOKENIZER_FILES)


def load_tokenizer(config: EngineConfig):
    """Load the tokenizer for ``config`` without network access.

    Returns:
        a ``transformers.PreTrainedTokenizerBase``.

    Raises:
        ValueError: the path does not exist or holds no tokenizer (and the model is not a
            dummy-weight model).
    """
    source = config.tokenizer or config.model
    path = resolve_model_path(source)
    kwargs = {"trust_remote_code": config.trust_remote_code}
    if os.path.isfile(path) and path.endswith(".gguf"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                             gguf_file=os.path.basename(path), **kwargs)
    if has_tokenizer_files(path):
        return tokenizer_from_dir(path, **kwargs)
    if not os.path.exists(path):
        raise ValueError(f"tokenizer path {source!r} not found")
    if (config.load_format or "").lower() == "dummy" and not config.tokenizer:
        logger.warning("%s has no tokenizer files; using a byte-level tokenizer for the dummy "
                       "model (token ids above 257 decode to empty text)", path)
        return byte_level_tokenizer()
    raise ValueError(f"{path} has no tokenizer files (tokenizer.json, tokenizer.model, ...); "
                     "pass --tokenizer DIR")


#: ``tokenizer_class`` values for which ``AutoTokenizer`` instantiates transformers' generic
#: fast tokenizer (``TokenizersBackend``; ``PreTrainedTokenizerFast`` is its other name).
_GENERIC_FAST_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def tokenizer_from_dir(directory: str | os.PathLike, **kwargs: Any) -> Any:
    """``AutoTokenizer.from_pretrained(directory, **kwargs)``, with the same result but about
    3 s less start-up CPU where the directory asks for the generic fast tokenizer.

    A directory with ``tokenizer.json`` whose ``tokenizer_config.json`` names
    ``TokenizersBackend`` / ``PreTrainedTokenizerFast`` (the built-in SmolLM2, and every tiny
    test model) is loaded with that class directly: the class ``AutoTokenizer`` would pick,
    without the model-config and ``torch`` imports that ``AutoTokenizer`` makes on the way. Any
    other directory goes through ``AutoTokenizer``.

    Raises:
        OSError / ValueError: as ``from_pretrained`` does for a directory it cannot load.
    """
    d = Path(directory)
    if (d / "tokenizer.json").is_file():
        try:
            tokenizer_class = json.loads((d / "tokenizer_config.json").read_text()).get(
                "tokenizer_class")
        except (OSError, ValueError, AttributeError):
            tokenizer_class = None
        if tokenizer_class in _GENERIC_FAST_CLASSES:
            from transformers.tokenization_utils_tokenizers import TokenizersBackend

            return TokenizersBackend.from_pretrained(str(d), **kwargs)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(d), **kwargs)


def byte_level_tokenizer():
    """A tokenizer with one token per byte (ids 0..255) plus ``<s>`` (256) and ``</s>`` (257),
    built with the ``tokenizers`` library; for dummy-weight models without tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = TokenizersBackend(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    return fast


def _byte_of(ch: str) -> int:
    """The byte that GPT-2's byte-level alphabet maps to the printable character ``ch``."""
    code = ord(ch)
    if 33 <= code <= 126 or 161 <= code <= 172 or 174 <= code <= 255:
        return code
    # the remaining bytes are mapped, in order, to code points 256, 257, ...
    others = [b for b in range(256)
              if not (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255)]
    return others[code - 256]


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """The longest text (characters) whose tokens could fit in ``max_model_len``: the longest
    vocabulary entry's length times ``max_model_len``.

    A token's string in the vocabulary is at least as long as the text it stands for (byte-level
    BPE spells each byte as one character, SentencePiece pieces spell their text, byte-fallback
    pieces like ``<0x41>`` are longer), so a text longer than this has more than
    ``max_model_len`` tokens. (A normaliser that deletes characters would break that; the
    tokenizers served here have none.) Falls back to 64 characters per token when the
    tokenizer has no ``get_vocab``.
    """
    try:
        longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        longest = 0
    return max(1, max_model_len) * (longest or 64)
