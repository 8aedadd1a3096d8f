"""The tokenizer a client of the server loads (the benchmark's ``-m/--model``, the proxy's
``--tokenizer`` for kv-aware routing and local prefill), from local files only; nothing is
downloaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


class TokenizerLoadError(RuntimeError):
    """The tokenizer source is not usable; the message says why."""


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

    from pdserve.model_files.builtin_models import BUILTIN_NAMES, is_builtin, resolve_model_path

    path_str = source
    if is_builtin(source):
        try:
            path_str = resolve_model_path(source)
        except (OSError, ValueError, ImportError) as exc:
            raise TokenizerLoadError(f"cannot prepare the built-in model {source!r}: {exc}") from exc
    path = Path(path_str).expanduser()
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
    """The model's context length in tokens: ``max_position_embeddings`` of the language
    model's config (``text_config`` of a multimodal one), or a ``.gguf`` file's
    ``<arch>.context_length`` (:func:`~pdserve.model_files.config_values.model_config_values`).
    None when ``source`` has no readable config (a tokenizer-only directory, a built-in model
    not yet converted other than SmolLM2) or names none."""
    from pdserve.model_files.config_values import model_config_values

    value = (model_config_values(source) or {}).get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None
