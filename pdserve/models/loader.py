"""Model loading: Hugging Face directories (safetensors, sharded or not), GGUF files
(dequantized from their memory map, :mod:`pdserve.models.gguf_weights`) and ``--load-format
dummy`` (random weights, real config). Checkpoint tensors are read lazily, so a tensor-parallel
rank reads only its shard.

:func:`load_model` is the entry point used by the model runner; it fills the torch-free
:class:`pdserve.types.model_info.ModelInfo` that the rest of the engine (scheduler, front end,
connector) sees.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.model_files.builtin_models import BUILTIN_NAMES, resolve_model_path
from pdserve.distributed.parallel_state import get_tp_rank, get_tp_size
from pdserve.distributed.sharding import check_tp_divisible
from pdserve.layers.weights import LazyWeight
from pdserve.models.gguf_weights import gguf_hf_config, iter_gguf
from pdserve.types.model_info import ModelInfo
from pdserve.models import hf_families
from pdserve.models.deepseek import ARCHITECTURES as DEEPSEEK, DeepseekArchConfig, deepseek_fields
from pdserve.models.gemma3 import ARCHITECTURE as GEMMA3, gemma3_arch_config
from pdserve.models.arch_config import ArchConfig
from pdserve.models.llama import CausalLM
from pdserve.models.registry import SUPPORTED_ARCHITECTURES, model_class
from pdserve.models.summary import summarize

logger = logging.getLogger("pdserve.model")

_MODEL_TYPE_TO_ARCH = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
_MODEL_TYPE_TO_ARCH.update(hf_families.MODEL_TYPES)  # Qwen2, Qwen3-MoE
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Result of :func:`load_model`: the module, its architecture, its summary and its path."""

    model: CausalLM
    arch: ArchConfig
    info: ModelInfo
    path: str


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available else CPU; ``cpu``; ``cuda`` / ``cuda:N``.

    Raises:
        ValueError: unknown name, or CUDA requested but unavailable.
    """
    name = (name or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name} requested but CUDA is not available")
        return torch.device(name)
    raise ValueError(f"unsupported device {name!r} (use auto, cpu or cuda)")


def tp_device(device: torch.device, config: EngineConfig, tp_rank: int) -> torch.device:
    """The device of TP rank ``tp_rank``: ``device`` itself at TP 1; on CUDA
    ``cuda:(base + tp_rank)``, ``base`` being ``device``'s index (0 without one); the CPU for
    every rank on the CPU. A data-parallel rank's engine core sees only its own ``tp`` devices
    (``CUDA_VISIBLE_DEVICES``, :func:`pdserve.engine.core_client.rank_devices`), so the
    data-parallel rank plays no part here."""
    if device.type != "cuda" or config.tensor_parallel_size == 1:
        return device
    return torch.device("cuda", (device.index or 0) + tp_rank)


def check_tp_devices(config: EngineConfig, device: torch.device, device_count: int) -> None:
    """Check that the CUDA devices of every TP rank exist (no-op on the CPU).

    Raises:
        ValueError: a rank's device index is not below ``device_count`` (the message names
            the TP size, the devices needed and those present).
    """
    size = config.tensor_parallel_size
    if device.type != "cuda":
        return
    last = tp_device(device, config, size - 1).index or 0
    if last >= device_count:
        first = tp_device(device, config, 0).index or 0
        raise ValueError(
            f"tensor_parallel_size {size} needs CUDA devices {first}..{last}, but "
            f"{device_count} device(s) are present")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> bfloat16 on CUDA, float32 on CPU; else ``float32``/``bfloat16``/``float16``.

    Raises:
        ValueError: unknown dtype name.
    """
    name = (name or "auto").lower()
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    aliases = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
               "half": "float16"}
    name = aliases.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"unsupported dtype {name!r} (use auto, float32, bfloat16 or float16)")
    return _DTYPES[name]


def _listify(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def arch_config_from_hf(hf: dict[str, Any], generation_config: dict[str, Any] | None = None
                        ) -> ArchConfig:
    """Parse a Hugging Face ``config.json`` dict.

    Understands both the older ``rope_theta`` + ``rope_scaling`` keys and the newer
    ``rope_parameters`` dict. Defaults for absent keys follow the HF config classes.

    Raises:
        ValueError: unsupported architecture, missing required key, or a feature this engine
            does not implement (Qwen sliding windows, activation other than SiLU, an unknown
            rope type, the features :func:`pdserve.models.hf_families.refuse_unsupported` names;
            Gemma 3's in :func:`pdserve.models.gemma3.gemma3_arch_config`).
    """
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = _MODEL_TYPE_TO_ARCH.get(str(hf.get("model_type", "")).lower())
    hf_families.refuse_unsupported(hf, arch)
    if arch is None:
        raise ValueError(
            f"unsupported model architecture {archs or hf.get('model_type')!r}; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES)
        )
    eos = _listify(hf.get("eos_token_id"))
    for e in _listify((generation_config or {}).get("eos_token_id")):
        if e not in eos:
            eos.append(e)
    if arch == GEMMA3:
        return gemma3_arch_config(hf, eos)
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "vocab_size"):
        if key not in hf:
            raise ValueError(f"config.json lacks required key {key!r}")
    if str(hf.get("hidden_act", "silu")).lower() not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {hf.get('hidden_act')!r} (only silu)")
    if arch == "Qwen3ForCausalLM" and hf.get("use_sliding_window"):
        raise ValueError("Qwen3 with use_sliding_window=true is not supported")
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    is_qwen3 = arch == "Qwen3ForCausalLM"
    head_dim = hf.get("head_dim") or (128 if is_qwen3 else hidden // num_heads)  # HF defaults
    rope = dict(hf.get("rope_parameters") or {})
    legacy = hf.get("rope_scaling")
    if legacy:
        rope = {**legacy, **rope}
    rope_theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    rope_scaling = None if rope_type == "default" else {**rope, "rope_type": rope_type}
    sliding_window = None
    if arch == "MistralForCausalLM" and hf.get("sliding_window"):
        sliding_window = int(hf["sliding_window"])  # every layer slides (as transformers does)
    default_max_pos = hf_families.default_max_positions(arch) or (40960 if is_qwen3 else 2048)
    max_pos = int(hf.get("max_position_embeddings", default_max_pos))
    rope_scaling = hf_families.complete_rope_scaling(rope_scaling, hf, max_pos)
    arch_config = ArchConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=int(hf["intermediate_size"]),
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        vocab_size=int(hf["vocab_size"]),
        max_position_embeddings=max_pos,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=is_qwen3,
        initializer_range=float(hf.get("initializer_range", 0.02)),
        eos_token_ids=eos,
        sliding_window=sliding_window,
    )
    if arch in DEEPSEEK:  # MLA and DeepSeek-MoE fields, and the latent cache's geometry
        base = {f.name: getattr(arch_config, f.name) for f in dataclasses.fields(arch_config)}
        return DeepseekArchConfig(**{**base, **deepseek_fields(hf, arch)})
    return dataclasses.replace(arch_config, **hf_families.family_fields(hf, arch))


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    with open(path) as fh:
        return json.load(fh)


def _safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a HF directory: the shards named by ``model.safetensors.index.json``,
    else ``model.safetensors``, else every ``*.safetensors`` file.

    Raises:
        ValueError: no safetensors file, or a shard named by the index is missing.
    """
    index = _read_json(model_dir / "model.safetensors.index.json")
    if index is not None:
        names = sorted(set(index.get("weight_map", {}).values()))
        missing = [n for n in names if not (model_dir / n).is_file()]
        if missing:
            raise ValueError(f"{model_dir}: shards named in model.safetensors.index.json are "
                             f"missing: {', '.join(missing[:4])}")
        return [model_dir / n for n in names]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors weights found (use a HF directory with "
                         "safetensors weights, a .gguf file, or --load-format dummy)")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, LazyWeight]]:
    """Yield ``(name, weight)`` from safetensors files, each weight a
    :class:`~pdserve.layers.weights.LazyWeight` over ``get_slice``: a parameter's loader reads
    the whole tensor, or only its tensor-parallel shard, when it copies it (while the file is
    open, i.e. before the next item is drawn)."""
    from safetensors import safe_open

    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, LazyWeight.from_safetensors(fh.get_slice(name))


def check_model_splits(config: EngineConfig) -> None:
    """Check before any rank starts that a Hugging Face directory's model splits over
    ``config.tensor_parallel_size`` ranks (a ``.gguf`` file is checked when it loads).

    Raises:
        TPShardingError: heads, KV heads, vocabulary or intermediate size do not divide (the
            message names the numbers).
        ValueError: an unreadable or unsupported ``config.json``.
    """
    path = Path(resolve_model_path(config.model))
    hf = _read_json(path / "config.json") if path.is_dir() else None
    if hf is None:
        return
    arch = arch_config_from_hf(hf)
    check_tp_divisible(config.tensor_parallel_size, num_heads=arch.num_heads,
                       num_kv_heads=arch.num_kv_heads, vocab_size=arch.vocab_size,
                       intermediate_size=arch.intermediate_size)


def model_max_len(config: EngineConfig, arch: ArchConfig) -> int:
    """The engine's ``max_model_len``: the configured value, else the model's context length.

    Raises:
        ValueError: ``max_model_len`` is not positive.
    """
    value = config.max_model_len or arch.max_position_embeddings
    if value <= 0:
        raise ValueError(f"max_model_len must be positive, got {value}")
    return int(value)


def load_model(config: EngineConfig) -> LoadedModel:
    """Load the model named by ``config`` onto its device.

    ``config.model`` is the built-in name, a HF directory, or a ``.gguf`` file;
    ``config.load_format`` is ``auto`` (by file type), ``safetensors``, ``gguf`` or ``dummy``
    (random weights from ``config.seed``; needs only ``config.json``).

    Raises:
        ValueError: missing path or files, unsupported architecture / load format / dtype /
            device, or weights that do not match the config.
        FileNotFoundError: the built-in model's package is not installed.
    """
    fmt = (config.load_format or "auto").lower()
    if fmt not in LOAD_FORMATS:
        raise ValueError(f"unsupported load format {config.load_format!r} "
                         f"(use one of {', '.join(LOAD_FORMATS)})")
    device = tp_device(resolve_device(config.device), config, get_tp_rank())
    dtype = resolve_dtype(config.dtype, device)
    path = Path(resolve_model_path(config.model))
    t0 = time.perf_counter()
    gguf_file: Path | None = None
    if path.is_file() and path.suffix == ".gguf":
        if fmt == "safetensors":
            raise ValueError(f"{path} is a GGUF file but --load-format safetensors was given")
        hf, gguf_file = gguf_hf_config(path), path
        gen_cfg = None
    elif path.is_dir():
        hf = _read_json(path / "config.json")
        if hf is None:
            raise ValueError(f"{path} has no config.json (not a Hugging Face model directory)")
        if fmt == "gguf":
            raise ValueError(f"{path} is a directory; --load-format gguf needs a .gguf file")
        gen_cfg = _read_json(path / "generation_config.json")
    elif path.exists():
        raise ValueError(f"{path}: expected a model directory or a .gguf file")
    else:
        raise ValueError(f"model {config.model!r} not found (expected a local Hugging Face "
                         "directory, a .gguf file, or a built-in name: "
                         + ", ".join(BUILTIN_NAMES) + ")")
    arch = arch_config_from_hf(hf, gen_cfg)
    check_tp_divisible(get_tp_size(), num_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                       vocab_size=arch.vocab_size, intermediate_size=arch.intermediate_size)
    max_len = model_max_len(config, arch)
    model = model_class(arch.architecture)(arch, dtype, device, config.block_size,
                                           max_positions=max_len)
    if fmt == "dummy":
        model.init_dummy_weights(config.seed)
    elif gguf_file is not None:
        model.load_weights(iter_gguf(gguf_file, hf))
    else:
        model.load_weights(iter_safetensors(_safetensors_files(path)))
    model.eval()
    logger.info("loaded %s (%s, %d layers, %s, %s, load_format=%s) in %.1f s", path,
                arch.architecture, arch.num_layers, str(dtype).removeprefix("torch."), device,
                fmt, time.perf_counter() - t0)
    logger.info("%s", summarize(arch, model, dtype).line())
    info = ModelInfo(
        name=config.name,
        architecture=arch.architecture,
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        max_position_embeddings=arch.max_position_embeddings,
        eos_token_ids=list(arch.eos_token_ids),
        dtype=str(dtype).removeprefix("torch."),
        device=str(device),
    )
    return LoadedModel(model=model, arch=arch, info=info, path=str(path))

