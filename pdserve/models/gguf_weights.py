"""The tensors of a GGUF file as :class:`~pdserve.layers.weights.LazyWeight`s with Hugging Face
names, read from the file's memory map: a tensor-parallel rank dequantizes only the rows of its
shard (GGUF quantizes row by row, so a row range is a contiguous byte range of whole quantized
rows); a column shard dequantizes that one tensor whole, never the whole model.

Names follow llama.cpp's GGUF conventions for Llama-family and Qwen3 models (``token_embd``,
``blk.N.attn_q``, ...; llama.cpp's ``gguf-py/gguf/constants.py``). llama.cpp stores the query
and key weights of ``llama``-architecture files with the rows of each head permuted for its
rotary layout; they are permuted back, head by head, as ``transformers``' GGUF loader does
(``LlamaTensorProcessor._reverse_permute_weights``), so a row range of whole heads can be read
alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.layers.weights import LazyWeight
from pdserve.model_files.gguf_file import hf_name

def _unpermute(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """Undo llama.cpp's per-head rotary permutation of whole heads' rows ``[n*head_dim, ...]``
    (``transformers``' ``_reverse_permute_weights`` on those heads)."""
    n = rows.shape[0] // head_dim
    w = rows.reshape(n, head_dim // 2, 2, *rows.shape[1:])
    return w.swapaxes(2, 1).reshape(rows.shape)


def _lazy(tensor: Any, permuted_head_dim: int | None) -> LazyWeight:
    from gguf.quants import dequantize

    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF lists ne0 first

    def rows(start: int, length: int) -> torch.Tensor:
        data = tensor.data[start:start + length] if len(shape) > 1 else tensor.data
        values = np.asarray(dequantize(np.asarray(data), qtype), dtype=np.float32)
        values = values.reshape((length, *shape[1:]) if len(shape) > 1 else shape)
        if permuted_head_dim is not None:
            values = _unpermute(values, permuted_head_dim)
        if not values.flags.writeable:  # an unquantized tensor: a view of the memory map
            values = values.copy()
        return torch.from_numpy(np.ascontiguousarray(values))

    def read(dim: int | None, start: int, length: int) -> torch.Tensor:
        if dim == 0 and len(shape) > 1:
            if permuted_head_dim is not None and (start % permuted_head_dim
                                                  or length % permuted_head_dim):
                return rows(0, shape[0]).narrow(0, start, length)
            return rows(start, length)
        whole = rows(0, shape[0] if len(shape) > 1 else 0)
        return whole if dim is None else whole.narrow(dim, start, length)

    return LazyWeight(shape, read)


def iter_gguf(path: Path, hf_config: dict[str, Any]) -> Iterator[tuple[str, LazyWeight]]:
    """Yield ``(hf_name, weight)`` for every tensor of the GGUF file the models use.

    Args:
        path: the ``.gguf`` file.
        hf_config: its Hugging Face config (``model_type`` decides the query/key un-permute;
            ``hidden_size`` and ``num_attention_heads`` / ``head_dim`` give the head size).
    """
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    permuted = str(hf_config.get("model_type", "")).lower() in ("llama", "mistral")
    head_dim = int(hf_config.get("head_dim") or
                   int(hf_config["hidden_size"]) // int(hf_config["num_attention_heads"]))
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        unpermute = permuted and (".self_attn.q_proj.weight" in name
                                  or ".self_attn.k_proj.weight" in name)
        yield name, _lazy(tensor, head_dim if unpermute else None)


def gguf_hf_config(path: Path) -> dict[str, Any]:
    """The Hugging Face config of a GGUF file, read from its metadata only (no tensors)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    return config.to_dict()
