"""What the engine, the front end and the connector know about a loaded model: a plain,
torch-free dataclass, so that the API process can rebuild it without importing torch."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass
class ModelInfo:
    """What the engine needs to know about the loaded model (plain Python, picklable).

    Attributes:
        name: served model name.
        architecture: HF architecture name, e.g. ``LlamaForCausalLM``.
        num_layers: decoder layers.
        num_kv_heads: KV heads.
        head_dim: head size.
        vocab_size: logits width.
        max_position_embeddings: the model's context length in tokens.
        eos_token_ids: end-of-sequence token ids (config and generation config, in that order).
        dtype: torch dtype name of the weights, e.g. ``"bfloat16"`` (the KV cache's is
            ``KVCacheSpec.dtype``: this one, or ``"float8_e4m3fn"`` with ``--kv-cache-dtype fp8``).
        device: ``"cpu"`` or ``"cuda"`` (``"cuda:N"``).
    """

    name: str
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    eos_token_ids: list[int]
    dtype: str
    device: str

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelInfo":
        """Rebuild from ``dataclasses.asdict`` output (keys this class does not know are ignored).

        Raises:
            TypeError: a field is missing.
        """
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
