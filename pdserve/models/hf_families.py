"""What a Hugging Face ``config.json`` means for the Qwen2 and Qwen3-MoE families and for rope
scaling: the family's extra :class:`~pdserve.models.arch_config.ArchConfig` fields, the rope settings
completed with Hugging Face's defaults, and the config features pdserve refuses by name.

:func:`pdserve.models.loader.arch_config_from_hf` calls these once, at start-up.
"""

from __future__ import annotations

from typing import Any

from pdserve.layers.fused_moe import MoEConfig
from pdserve.layers.rotary import rope_type_of, validate_rope_scaling

#: ``model_type`` -> architecture, for configs without ``architectures``.
MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
               "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
#: Mixture-of-experts architectures pdserve does not implement, with what they add.
_OTHER_MOE = {
    "Qwen2MoeForCausalLM": "shared experts",
    "MixtralForCausalLM": "Mixtral's experts",
    "Qwen3NextForCausalLM": "shared experts and linear attention",
}
# DeepSeek's MoE keys are its own (pdserve.models.deepseek.deepseek_moe_config).
_DEEPSEEK = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
# Config keys that name a feature this engine lacks, when set to a true value.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def refuse_unsupported(hf: dict[str, Any], arch: str | None) -> None:
    """Refuse, by name, a config feature that would load with wrong results.

    Args:
        hf: the ``config.json`` dict.
        arch: the supported architecture it was matched to, or None (then only the names of
            other mixture-of-experts families are checked, for a clearer error).

    Raises:
        ValueError: a mixture-of-experts family or variant pdserve lacks (shared experts,
            another router), MoE keys on a dense architecture, quantized weights, sliding-window
            attention of the Qwen families, partial rotary embeddings.
    """
    for name in hf.get("architectures") or []:
        if name in _OTHER_MOE:
            raise ValueError(f"unsupported mixture-of-experts architecture {name!r} "
                             f"({_OTHER_MOE[name]}); supported MoE: Qwen3MoeForCausalLM")
    if arch is None:
        return
    if hf.get("quantization_config"):
        method = (hf["quantization_config"] or {}).get("quant_method", "unknown")
        method = str(getattr(method, "value", method)).lower()  # an Enum from transformers
        if method != "gguf":  # GGUF files arrive dequantized (loader.load_gguf_state)
            raise ValueError(f"quantized checkpoints are not supported (quantization_config "
                             f"quant_method={method!r}); use unquantized weights")
    if arch == "Qwen3MoeForCausalLM":
        if hf.get("shared_expert_intermediate_size"):
            raise ValueError("Qwen3-MoE with shared experts (shared_expert_intermediate_size) "
                             "is not supported")
        if str(hf.get("router_type", "softmax")).lower() != "softmax" \
                or hf.get("scoring_func", "softmax") != "softmax":
            raise ValueError("mixture-of-experts routing other than top-k softmax is not "
                             "supported")
    elif arch not in _DEEPSEEK and any(hf.get(k) for k in _MOE_KEYS):
        raise ValueError(f"mixture-of-experts keys in a {arch} config are not supported")
    if arch in ("Qwen2ForCausalLM", "Qwen3MoeForCausalLM") and hf.get("use_sliding_window"):
        raise ValueError(f"{arch} with use_sliding_window=true is not supported")
    partial = (hf.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                    hf.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not "
                         "supported")


def complete_rope_scaling(rope_scaling: dict[str, Any] | None, hf: dict[str, Any],
                          max_position_embeddings: int) -> dict[str, Any] | None:
    """The rope scaling dict with the defaults Hugging Face fills in, checked once.

    - ``yarn`` and ``llama3``: ``original_max_position_embeddings`` from the config's top level
      when present (Hugging Face gives that priority), else the dict's, else
      ``max_position_embeddings``; ``yarn`` also gets ``max_position_embeddings`` (its factor
      when none is given).
    - ``dynamic``: the threshold is the config's ``max_position_embeddings`` (as in Hugging
      Face), stored as ``original_max_position_embeddings``.

    Raises:
        ValueError: an unknown ``rope_type`` or a missing parameter
            (:func:`pdserve.layers.rotary.validate_rope_scaling`).
    """
    if rope_scaling is None:
        return None
    out = dict(rope_scaling)
    rope_type = rope_type_of(out)
    if rope_type in ("yarn", "llama3"):
        out["original_max_position_embeddings"] = int(
            hf.get("original_max_position_embeddings")
            or out.get("original_max_position_embeddings") or max_position_embeddings)
        out.setdefault("max_position_embeddings", max_position_embeddings)
    elif rope_type == "dynamic":
        out["original_max_position_embeddings"] = max_position_embeddings
    validate_rope_scaling(out)
    return out


def family_fields(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """The :class:`~pdserve.models.arch_config.ArchConfig` fields a family sets beyond the Llama ones.

    Qwen2: a bias on q/k/v only (``qkv_bias``), ``attention_bias`` off. Qwen3-MoE: Qwen3's q/k
    norm, ``head_dim`` defaulting to ``hidden_size // num_attention_heads`` (as its HF config),
    and the :class:`MoEConfig` (``num_experts`` or ``num_local_experts``).

    Raises:
        ValueError: a missing or inconsistent mixture-of-experts key.
    """
    if arch == "Qwen2ForCausalLM":
        return {"qkv_bias": True, "attention_bias": False}
    if arch != "Qwen3MoeForCausalLM":
        return {}
    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    for key, value in (("num_experts", num_experts),
                       ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                       ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"Qwen3-MoE config needs a positive integer {key!r}, got {value!r}")
    if hf["num_experts_per_tok"] > num_experts:
        raise ValueError(f"num_experts_per_tok={hf['num_experts_per_tok']} exceeds "
                         f"num_experts={num_experts}")
    step = int(hf.get("decoder_sparse_step", 1) or 1)
    moe = MoEConfig(num_experts=num_experts, top_k=int(hf["num_experts_per_tok"]),
                    moe_intermediate_size=int(hf["moe_intermediate_size"]),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                    decoder_sparse_step=step,
                    mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()))
    head_dim = hf.get("head_dim") or int(hf["hidden_size"]) // int(hf["num_attention_heads"])
    return {"qk_norm": True, "moe": moe, "head_dim": int(head_dim)}


def default_max_positions(arch: str) -> int | None:
    """The Hugging Face config's ``max_position_embeddings`` default of a family, None for the
    others."""
    defaults = {"Qwen2ForCausalLM": 32768, "Qwen3MoeForCausalLM": 32768,
                "DeepseekV2ForCausalLM": 2048, "DeepseekV3ForCausalLM": 4096}
    return defaults.get(arch)
