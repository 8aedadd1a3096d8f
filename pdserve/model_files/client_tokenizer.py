"""The tokenizer a client of the server loads (the benchmark's ``-m/--model``, the proxy's
``--tokenizer`` for kv-aware routing and local prefill), from local files only; nothing is
downloaded."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class TokenizerLoadError(RuntimeError):
    """The tokenizer source is not usable; the message says why."""


def _local_path(source: str) -> Path:
    """The local path of ``source`` (a built-in model is resolved, and converted once).

    Raises:
        TokenizerLoadError: the built-in model cannot be prepared.
    """
    from pdserve.model_files.builtin_models import is_builtin, resolve_model_path

    path_str = source
    if is_builtin(source):
        try:
            path_str = resolve_model_path(source)
        except (OSError, ValueError, ImportError) as exc:
            raise TokenizerLoadError(f"cannot prepare the built-in model {source!r}: {exc}") from exc
    return Path(path_str).expanduser()


def load_tokenizer(source: str) -> Any:
    """Return a ``transformers`` tokenizer for ``source``.

    Args:
        source: a built-in model name (``smollm2-135m-instruct``, ``gemma3-270m``; resolved, and
            converted once, by :func:`pdserve.model_files.builtin_models.resolve_model_path`), a
            local Hugging Face model or tokenizer directory, or a local ``.gguf`` file.

    Raises:
        TokenizerLoadError: the path does not exist or holds no loadable tokenizer.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from transformers import AutoTokenizer

    from pdserve.model_files.builtin_models import BUILTIN_NAMES

    path = _local_path(source)
    try:
        if path.is_file() and path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        if path.is_dir():
            from pdserve.model_files.tokenizer import tokenizer_from_dir

            return tokenizer_from_dir(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    raise TokenizerLoadError(
        f"{source!r} is neither a built-in model ({', '.join(BUILTIN_NAMES)}), a local model "
        "directory, nor a .gguf file (tokenizers are never downloaded)"
    )


def model_context_length(source: str) -> int | None:
    """The model's context length in tokens: ``max_position_embeddings`` of its
    ``config.json`` (of its ``text_config`` for a multimodal model), or of a ``.gguf`` file's
    metadata (``<arch>.context_length``). None when ``source`` has no readable config (a
    tokenizer-only directory) or names none.

    Raises:
        TokenizerLoadError: a built-in model cannot be prepared.
    """
    path = _local_path(source)
    if path.is_file() and path.suffix == ".gguf":
        from gguf import GGUFReader  # numpy only

        try:
            fields = GGUFReader(str(path)).fields
            arch = fields["general.architecture"].contents()
            return int(fields[f"{arch}.context_length"].contents())
        except (KeyError, TypeError, ValueError, OSError):
            return None
    try:
        with open(path / "config.json") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    for section in (config, config.get("text_config") or {}):
        value = section.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None
