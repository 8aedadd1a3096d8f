"""Configs of real models written out by functions (no download), for benchmarks that run them
with dummy weights: Qwen3-30B-A3B (mixture of experts), Qwen2.5-7B and DeepSeek-V2-Lite
(multi-head latent attention, DeepSeek-MoE), and two-layer CPU versions of a family."""

from __future__ import annotations


def qwen3_30b_a3b_config() -> dict:
    """Qwen3-30B-A3B's ``config.json`` (Qwen/Qwen3-30B-A3B on the Hugging Face Hub): 48 layers,
    128 experts of width 768 with 8 per token (renormalised), 32 query / 4 KV heads of 128."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
        "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
        "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
        "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
        "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
        "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
        "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
    }


def qwen2_5_7b_config() -> dict:
    """Qwen2.5-7B-Instruct's ``config.json`` (Qwen/Qwen2.5-7B-Instruct on the Hugging Face Hub):
    28 layers, 28 query / 4 KV heads of 128, q/k/v biases, untied LM head."""
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu",
        "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
        "max_position_embeddings": 32768, "max_window_layers": 28, "num_attention_heads": 28,
        "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 152064,
    }


def deepseek_v2_lite_config() -> dict:
    """DeepSeek-V2-Lite's ``config.json`` (deepseek-ai/DeepSeek-V2-Lite on the Hugging Face Hub;
    15.7B parameters, 2.4B active): hidden 2048, 27 layers (the first dense, intermediate
    10944), 16 heads, MLA with ``kv_lora_rank`` 512, no ``q_lora_rank``, rotary 64 / no-rotary
    128 / value 128 dims per head, 64 routed experts of width 1408 with 6 per token (softmax,
    plain top-k) plus 2 shared, YaRN (factor 40 over 4096 positions), vocabulary 102,400."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
        "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 100000,
        "eos_token_id": 100001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 10944,
        "kv_lora_rank": 512, "max_position_embeddings": 163840, "moe_intermediate_size": 1408,
        "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
        "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6,
        "num_hidden_layers": 27, "num_key_value_heads": 16, "q_lora_rank": None,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
        "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax",
        "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy",
        "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 102400,
    }


def tiny_deepseek_config(full: dict) -> dict:
    """A two-layer model of a DeepSeek config for runs on a CPU: one dense layer and one MoE
    layer of 8 experts (2 per token), 4 heads, a latent of 32 + 8."""
    return {**full, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_key_value_heads": 4, "num_hidden_layers": 2, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 2}


def tiny_config(full: dict) -> dict:
    """A two-layer model of ``full``'s family for runs on a CPU (mixture-of-experts configs keep
    8 experts, 2 per token)."""
    tiny = {**full, "hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
            "num_hidden_layers": 2, "num_key_value_heads": 2, "max_window_layers": 2,
            "vocab_size": 1024, "bos_token_id": 1, "eos_token_id": 2}
    if "head_dim" in full:
        tiny["head_dim"] = 32
    if "num_experts" in full:
        tiny.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64)
    return tiny
