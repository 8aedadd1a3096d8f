"""Write an 8B Llama-class (or Qwen3-0.6B-shaped) model directory for ``--load-format dummy``
runs.

The directory holds ``config.json`` (hidden 4096, 32 layers, 32 heads, 8 KV heads, head size 128,
intermediate 14336, rope theta 500000, 16k positions; vocabulary 49,152 so that the embedded
SmolLM2 tokenizer and chat template fit) and the tokenizer files of the converted SmolLM2 model.
No weights: engines started with ``--load-format dummy`` fill them with random values, which is
enough for speed work (docs/architecture.md, "Models and weights"). ``--preset qwen3-0.6b`` writes Qwen3-0.6B's configuration
instead (``benchmarks/offline_throughput.py``'s ``QWEN3_0_6B_CONFIG``: 28 layers, 8 KV heads,
head size 128, vocabulary 151,936, which the SmolLM2 tokenizer's ids fit in).

Usage::

    python benchmarks/make_llama8b_dummy.py OUT_DIR
    python benchmarks/make_llama8b_dummy.py --preset qwen3-0.6b OUT_DIR

Raises:
    SystemExit: the embedded model package is missing (see README).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
    "tie_word_embeddings": False, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
    "attention_bias": False, "mlp_bias": False, "torch_dtype": "bfloat16",
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def _config(preset: str) -> dict:
    if preset == "llama-8b":
        return CONFIG
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from offline_throughput import QWEN3_0_6B_CONFIG

    return dict(QWEN3_0_6B_CONFIG, max_position_embeddings=16384)


def main(argv: list[str] | None = None) -> int:
    """Create the directory given as the only argument (after an optional ``--preset NAME``);
    returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    preset = "llama-8b"
    if len(argv) == 3 and argv[0] == "--preset" and argv[1] in ("llama-8b", "qwen3-0.6b"):
        preset, argv = argv[1], argv[2:]
    if len(argv) != 1:
        print(__doc__)
        return 2
    from pdserve.model_files.builtin_models import resolve_model_path

    src = Path(resolve_model_path("smollm2-135m-instruct"))
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    (out / "config.json").write_text(json.dumps(_config(preset), indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
