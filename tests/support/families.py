"""The tiny random models of the families added for issue 17 (Qwen2, rope scaling, Qwen3-MoE),
shared by the greedy tests (tests/models/test_families.py) and the P/D end-to-end tests
(tests/kv_transfer/test_families_pd_e2e.py).

The rope-scaled models were trained (so to speak) on ``ORIGINAL_CTX`` tokens: any longer prompt
runs past the scaling threshold. Models whose positions matter get ``initializer_range`` 0.2 so
that attention is not nearly uniform (then a wrong rotary table changes greedy tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: ``original_max_position_embeddings`` of the rope-scaled models (tokens).
ORIGINAL_CTX = 32

# factor = max_position_embeddings (1024, tiny_models' default) / ORIGINAL_CTX, as YaRN configs
# state it (transformers warns otherwise)
YARN = {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 32.0,
        "original_max_position_embeddings": ORIGINAL_CTX}
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": ORIGINAL_CTX}

#: name -> (``make_tiny_model`` arch, config overrides)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2": ("qwen2", {}),  # tied embeddings, q/k/v bias
    "qwen2-yarn": ("qwen2", {"rope_parameters": YARN}),
    "llama3-rope": ("llama", {"rope_parameters": LLAMA3, "initializer_range": 0.2}),
    "qwen3-moe": ("qwen3_moe", {}),  # norm_topk_prob, layer 1 dense
    "qwen3-moe-unnormalized": ("qwen3_moe", {"norm_topk_prob": False, "mlp_only_layers": []}),
}


def make_family_model(name: str, directory: Path) -> str:
    """Write the tiny model ``name`` of :data:`MODELS` into ``directory``; returns its path."""
    from pdserve.testing.tiny_models import make_tiny_model

    arch, overrides = MODELS[name]
    return str(make_tiny_model(directory, arch, **overrides))
