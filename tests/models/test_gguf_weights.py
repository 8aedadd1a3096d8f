"""GGUF tensors read lazily from the memory map: a rank's row or column shard equals the same
slice of the whole tensor (query/key rows un-permuted head by head), for the embedded SmolLM2's
quantized (Q4_1, Q8_0) and float tensors."""

from __future__ import annotations

import pytest
import torch

from pdserve.model_files.gguf_file import hf_name
from pdserve.models.gguf_weights import iter_gguf


def test_gguf_names():
    assert hf_name("blk.3.attn_q.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_down.weight") == "model.layers.0.mlp.down_proj.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_name("output.weight") == "lm_head.weight"
    assert hf_name("rope_freqs.weight") is None


@pytest.mark.slow
def test_shards_equal_slices_of_the_whole_tensor():
    from pdserve.model_files import builtin_models

    try:
        path = builtin_models.builtin_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    # SmolLM2-135M: 9 heads of 64, 3 KV heads; llama files store q/k rows permuted per head
    hf = {"model_type": "llama", "hidden_size": 576, "num_attention_heads": 9}
    wanted = {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
              "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight",
              "model.layers.0.input_layernorm.weight"}
    seen = set()
    for name, weight in iter_gguf(path, hf):
        if name not in wanted:
            continue
        seen.add(name)
        whole = weight.load()
        assert tuple(whole.shape) == tuple(weight.shape) and whole.dtype == torch.float32
        if whole.dim() == 1:
            continue
        for dim in (0, 1):
            step = whole.shape[dim] // 3
            for rank in range(3):
                torch.testing.assert_close(weight.narrow(dim, rank * step, step),
                                           whole.narrow(dim, rank * step, step), rtol=0, atol=0)
    assert seen == wanted
