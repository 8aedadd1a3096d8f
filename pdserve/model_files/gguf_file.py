"""One parse of a GGUF file for the built-in models' one-time conversion: its metadata and its
tensor table, each tensor's data a numpy view of the file's memory map, dequantized with the
``gguf`` package's numpy routines (docs/architecture.md, "Built-in model").

The header is read with the fast reader of ``transformers`` 5
(``transformers/integrations/gguf/reader.py``; about a second for a 262k-token vocabulary),
where ``gguf.GGUFReader`` builds a numpy field for every element of every metadata array (tens
of seconds for the same file). That reader offers the metadata alone through a public function
(``read_gguf_metadata``) but not the tensor table, so :func:`read_gguf` uses two of its private
helpers and falls back to ``gguf.GGUFReader`` when they are missing, changed or fail.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from gguf import GGMLQuantizationType

logger = logging.getLogger("pdserve.model")

# GGUF's default data alignment (GGUF_DEFAULT_ALIGNMENT in llama.cpp's gguf-py/gguf/constants.py)
_DEFAULT_ALIGNMENT = 32
# The string arrays read out in full; the fast reader leaves any other string array as its count.
STRING_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")


@dataclass(frozen=True)
class GgufTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: its llama.cpp name (``blk.0.attn_q.weight``).
        ggml_type: its ``gguf.GGMLQuantizationType``.
        shape: its logical shape, outermost first (``[out, in]`` for a linear weight).
        data: the stored values as ``gguf.GGUFReader`` presents them: for a float or integer
            type an array of that type shaped ``shape``; for a quantized type ``uint8`` shaped
            ``shape[:-1] + (bytes per row,)``. A read-only view of the file's memory map.
    """

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """A new, writable float32 array of shape :attr:`shape` (``gguf.dequantize``)."""
        from gguf import dequantize

        # np.array copies: an unquantized tensor would otherwise stay a view of the file's map
        return np.array(dequantize(self.data, self.ggml_type), dtype=np.float32)


@dataclass(frozen=True)
class GgufFile:
    """A parsed GGUF file.

    Attributes:
        metadata: ``{key: value}``; the arrays named in :data:`STRING_ARRAYS` as lists of
            ``str``, other numeric arrays as lists, any other string array as its length
            (``int``) or as a list of ``str``.
        tensors: every tensor, in file order.
    """

    metadata: dict[str, Any]
    tensors: tuple[GgufTensor, ...]

    def config_token_ids(self) -> dict[str, int]:
        """The special-token ids of the metadata as Hugging Face config arguments
        (``bos_token_id``, ``eos_token_id``, ``pad_token_id``, ``unk_token_id``), those present."""
        return {f"{name}_token_id": self.metadata[f"tokenizer.ggml.{key}_token_id"]
                for key, name in _TOKEN_ID_KEYS
                if f"tokenizer.ggml.{key}_token_id" in self.metadata}

    def ties_word_embeddings(self) -> bool:
        """True when the file has no ``output.weight``: the LM head is the token embedding."""
        return all(t.name != "output.weight" for t in self.tensors)


# GGUF special-token key (``tokenizer.ggml.KEY_token_id``) -> Hugging Face config name prefix
_TOKEN_ID_KEYS = (("bos", "bos"), ("eos", "eos"), ("padding", "pad"), ("unknown", "unk"))


def read_gguf(path: Path) -> GgufFile:
    """Parse a GGUF file's metadata and tensor table once (no tensor data is read).

    Raises:
        ValueError: not a GGUF file (from ``gguf.GGUFReader``).
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    parsed = _read_header_fast(path)
    if parsed is None:
        return _read_with_gguf_reader(path)
    metadata, entries, table_end, blob = parsed
    alignment = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = (table_end + alignment - 1) // alignment * alignment
    tensors = []
    for name, shape, raw_type, offset in entries:
        ggml_type = GGMLQuantizationType(raw_type)
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        count = int(np.prod(shape, dtype=np.int64))
        start = data_start + offset
        stored = _PLAIN_TYPES.get(ggml_type.name)
        if stored is not None:  # stored as plain values
            data = blob[start:start + count * np.dtype(stored).itemsize].view(stored).reshape(shape)
        else:
            byte_shape = quant_shape_to_byte_shape(shape, ggml_type)
            data = blob[start:start + count * type_size // block_size].reshape(byte_shape)
        tensors.append(GgufTensor(name, ggml_type, tuple(shape), data))
    return GgufFile(metadata, tuple(tensors))


# ggml types stored as plain values, and their numpy dtype (as gguf.GGUFReader maps them)
_PLAIN_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8,
                "I16": np.int16, "I32": np.int32, "I64": np.int64}


def _read_header_fast(path: Path):
    """``(metadata, [(name, shape, ggml_type, offset)], end of the tensor table, memory map)``
    through ``transformers``' GGUF reader, or None when that reader is unavailable or fails."""
    try:
        # Private helpers of transformers/integrations/gguf/reader.py: the public
        # read_gguf_metadata() returns the tensor names but not their types and offsets.
        from transformers.integrations.gguf.reader import (
            _mapped,
            _read_metadata,
            _read_tensor_table,
        )

        blob = _mapped(str(path))
        metadata, tensor_count, pos = _read_metadata(blob, str(path), STRING_ARRAYS)
        entries, table_end = _read_tensor_table(blob, tensor_count, pos)
    except (ImportError, TypeError, ValueError) as e:
        # helpers gone or changed, or a value type that reader does not know: gguf.GGUFReader
        # reads what it can (and raises its own error for a file that is not GGUF)
        logger.info("transformers' GGUF reader cannot read %s (%s); using gguf.GGUFReader",
                    path, e)
        return None
    return metadata, entries, table_end, blob


def _read_with_gguf_reader(path: Path) -> GgufFile:
    """The slow path: the same :class:`GgufFile` through ``gguf.GGUFReader``."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    metadata = {key: field.contents() for key, field in reader.fields.items()
                if not key.startswith("GGUF.")}
    tensors = tuple(
        GgufTensor(t.name, t.tensor_type, tuple(int(d) for d in reversed(t.shape.tolist())),
                   t.data)
        for t in reader.tensors)
    return GgufFile(metadata, tensors)


# Tensor names follow llama.cpp's GGUF conventions for Llama-family and Qwen3 models
# (llama.cpp's gguf-py/gguf/constants.py).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}
_BLOCK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor name, or None for one the models do not use."""
    m = _BLOCK.match(gguf_name)
    if m is not None:
        part = _LAYER_NAMES.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    part = _GLOBAL_NAMES.get(base)
    return None if part is None else f"{part}.{kind}"
