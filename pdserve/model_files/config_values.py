"""A model's configuration values read without loading it (torch-free): the language model's
part of its ``config.json``, or a ``.gguf`` file's metadata under the same Hugging Face names.

Used before any engine starts: the TP split check (:mod:`pdserve.model_files.tp_precheck`) and
the proxy's prompt-size bound (:func:`pdserve.model_files.client_tokenizer.model_context_length`).
A built-in model is read from its converted ``config.json`` once converted, else (SmolLM2 only)
from its packaged GGUF, so nothing is converted here. GGUF metadata is read with
``gguf.GGUFReader`` (numpy only).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from pdserve.model_files import builtin_models

#: Hugging Face config name -> GGUF metadata key under ``<general.architecture>.`` (llama.cpp's
#: GGUF naming, as :mod:`pdserve.model_files.builtin_gemma3` maps them too).
GGUF_KEYS = {
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "vocab_size": "vocab_size",
    "intermediate_size": "feed_forward_length",
    "max_position_embeddings": "context_length",
}


def language_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a Hugging Face config: ``text_config`` when there is one
    (multimodal configs keep the language model's apart), else the config itself."""
    return hf.get("text_config") or hf


def _from_gguf(path: Path) -> dict[str, Any] | None:
    from gguf import GGUFReader  # numpy only

    try:
        fields = GGUFReader(str(path)).fields
        arch = fields["general.architecture"].contents()
        values = {name: fields[f"{arch}.{key}"].contents() for name, key in GGUF_KEYS.items()
                  if f"{arch}.{key}" in fields}
        if "vocab_size" not in values and "tokenizer.ggml.tokens" in fields:
            values["vocab_size"] = len(fields["tokenizer.ggml.tokens"].contents())
        return values
    except (KeyError, TypeError, ValueError, OSError):
        return None


def _from_json(path: Path) -> dict[str, Any] | None:
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return language_config(hf) if isinstance(hf, dict) else None


def model_config_values(model: str) -> dict[str, Any] | None:
    """The language model's configuration of ``model`` (a built-in name, a Hugging Face
    directory or a ``.gguf`` file) under Hugging Face names; from a GGUF file only the names
    of :data:`GGUF_KEYS` (those present). None when nothing can be read without loading or
    converting the model (a tokenizer-only directory, a built-in model other than SmolLM2
    before its conversion, a missing package, an unreadable file)."""
    if builtin_models.is_builtin(model):
        name = model.strip().lower()
        config = builtin_models.converted_dir(name) / "config.json"
        if builtin_models.is_converted(name) and config.is_file():
            return _from_json(config)
        if name != builtin_models.BUILTIN_NAME:
            return None  # assembled from its package at conversion
        try:
            return _from_gguf(builtin_models.builtin_gguf_path())
        except FileNotFoundError:
            return None
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        return _from_json(path / "config.json")
    if path.is_file() and path.suffix == ".gguf":
        return _from_gguf(path)
    return None
