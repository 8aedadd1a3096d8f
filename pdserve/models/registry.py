"""The supported model architectures: Hugging Face ``architectures`` name -> model class."""

from __future__ import annotations

from pdserve.models.deepseek import DeepseekForCausalLM
from pdserve.models.gemma3 import Gemma3ForCausalLM
from pdserve.models.llama import CausalLM
from pdserve.models.qwen3_moe import Qwen3MoeCausalLM

# One class serves the Llama family and Qwen3 (ArchConfig.qk_norm marks Qwen3's q/k norm).
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
}
# Qwen2 / Qwen2.5 (and the DeepSeek-R1 Qwen distills): the Llama structure with a bias on the
# query/key/value projection (ArchConfig.qkv_bias).
MODEL_REGISTRY["Qwen2ForCausalLM"] = CausalLM
# Qwen3-MoE: Qwen3 attention, mixture-of-experts MLP.
MODEL_REGISTRY["Qwen3MoeForCausalLM"] = Qwen3MoeCausalLM
# DeepSeek-V2 / V3: multi-head latent attention over a latent cache, DeepSeek-MoE.
MODEL_REGISTRY["DeepseekV2ForCausalLM"] = DeepseekForCausalLM
MODEL_REGISTRY["DeepseekV3ForCausalLM"] = DeepseekForCausalLM
SUPPORTED_ARCHITECTURES = tuple(MODEL_REGISTRY)


def model_class(architecture: str) -> type[CausalLM]:
    """The model class of a Hugging Face architecture name.

    Raises:
        ValueError: the architecture is not supported.
    """
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"unsupported model architecture {architecture!r}; supported: "
                         + ", ".join(SUPPORTED_ARCHITECTURES)) from None
