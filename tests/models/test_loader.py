"""Loader: HF directories (single and sharded safetensors), dummy weights, dtypes, rope scaling,
Mistral-style configs (with and without a sliding window), Gemma 3 configs, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.models.arch_config import ArchConfig, rope_inv_freq
from pdserve.models.loader import (
    arch_config_from_hf,
    load_model,
    resolve_device,
    resolve_dtype,
)
from pdserve.runner.model_runner import ModelRunner
from pdserve.testing.tiny_models import make_tiny_model

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _greedy_tokens(path: str, n: int = 5, **cfg) -> list[int]:
    r = ModelRunner(EngineConfig(model=path, max_model_len=128, num_gpu_blocks_override=16, **cfg))
    r.allocate_kv_cache(16)
    req = DrivenRequest("a", list(range(500, 537)), n, greedy(n))
    MiniScheduler(r, 16).run([req])
    return req.output


def _hf_greedy(path: str, prompt: list[int], n: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                      do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def test_dummy_weights_deterministic_and_finite(tiny_qwen3_path, tmp_path):
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    shutil.copy(f"{tiny_qwen3_path}/config.json", config_only / "config.json")
    a = load_model(EngineConfig(model=str(config_only), load_format="dummy", seed=1))
    b = load_model(EngineConfig(model=str(config_only), load_format="dummy", seed=1))
    c = load_model(EngineConfig(model=str(config_only), load_format="dummy", seed=2))
    real = load_model(EngineConfig(model=tiny_qwen3_path))
    pa, pb, pc, pr = (_params(x.model) for x in (a, b, c, real))
    assert pa.keys() == pr.keys()
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pc["layers.0.self_attn.qkv_proj.weight"])
    assert not torch.equal(pa["layers.0.self_attn.qkv_proj.weight"], pr["layers.0.self_attn.qkv_proj.weight"])
    tokens = _greedy_tokens(str(config_only), load_format="dummy", dtype="bfloat16")
    assert len(tokens) == 5 and all(0 <= t < 49152 for t in tokens)


def test_sharded_safetensors_equal_single_file(tiny_llama_path, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_path)
    sharded = tmp_path / "sharded"
    hf.save_pretrained(str(sharded), max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 1
    single = _params(load_model(EngineConfig(model=tiny_llama_path)).model)
    multi = _params(load_model(EngineConfig(model=str(sharded))).model)
    assert all(torch.equal(single[k], multi[k]) for k in single)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
])
def test_rope_scaling_matches_transformers(scaling, tmp_path):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                         max_position_embeddings=1024, rope_parameters=dict(scaling))
    ref, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu")
    ours = rope_inv_freq(arch_config_from_hf(hf_cfg.to_dict()))
    torch.testing.assert_close(ours, ref.float())
    # end to end on a tiny model with this scaling (positions beyond the original length)
    path = str(make_tiny_model(tmp_path / "m", "llama",
                               rope_parameters=dict(scaling)))
    assert _greedy_tokens(path) == _hf_greedy(path, list(range(500, 537)), 5)


def test_legacy_rope_keys_and_mistral_config(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                        max_position_embeddings=512, sliding_window=None, bos_token_id=1,
                        eos_token_id=2)
    torch.manual_seed(0)
    model = MistralForCausalLM(cfg)
    out = tmp_path / "mistral"
    model.save_pretrained(str(out))
    arch = arch_config_from_hf(json.loads((out / "config.json").read_text()))
    assert arch.architecture == "MistralForCausalLM" and arch.num_kv_heads == 1
    assert _greedy_tokens(str(out)) == _hf_greedy(str(out), list(range(500, 537)), 5)
    legacy = arch_config_from_hf({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 10,
        "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": [7, 8]}, {"eos_token_id": [8, 9]})
    assert legacy.rope_theta == 5e5 and legacy.rope_scaling["rope_type"] == "linear"
    assert legacy.head_dim == 16 and legacy.num_kv_heads == 4 and legacy.eos_token_ids == [7, 8, 9]


def test_dtype_and_device_resolution():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("bf16", cpu) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", cpu)
    assert resolve_device("cpu") == cpu
    with pytest.raises(ValueError, match="device"):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == cpu
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def _write_config(tmp_path, **fields):
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
    base.update(fields)
    (d / "config.json").write_text(json.dumps(base))
    return str(d)


def test_errors(tmp_path, tiny_llama_path):
    with pytest.raises(ValueError, match="not found"):
        load_model(EngineConfig(model=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="no config.json"):
        load_model(EngineConfig(model=str(tmp_path)))
    with pytest.raises(ValueError, match="unsupported model architecture"):
        load_model(EngineConfig(model=_write_config(tmp_path, architectures=["GPT2LMHeadModel"]),
                                load_format="dummy"))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(EngineConfig(model=_write_config(tmp_path)))
    with pytest.raises(ValueError, match="hidden_act"):
        load_model(EngineConfig(model=_write_config(tmp_path, hidden_act="gelu"),
                                load_format="dummy"))
    with pytest.raises(ValueError, match="load format"):
        load_model(EngineConfig(model=tiny_llama_path, load_format="pt"))
    with pytest.raises(ValueError, match="lacks required key"):
        cfg = json.loads(open(f"{tiny_llama_path}/config.json").read())
        del cfg["hidden_size"]
        arch_config_from_hf(cfg)
    # weights that do not match the config
    wrong = tmp_path / "wrong"
    shutil.copytree(tiny_llama_path, wrong)
    cfg = json.loads((wrong / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="shape"):
        load_model(EngineConfig(model=str(wrong)))
    cfg["intermediate_size"] = 128
    cfg["num_hidden_layers"] = 3
    (wrong / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="missing"):
        load_model(EngineConfig(model=str(wrong)))


def test_arch_config_defaults_for_qwen3():
    arch = arch_config_from_hf({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 64,
                                "intermediate_size": 128, "num_hidden_layers": 1,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 100})
    assert isinstance(arch, ArchConfig)
    assert arch.qk_norm and arch.head_dim == 128 and arch.rope_scaling is None


def test_mistral_sliding_window_matches_transformers(tmp_path):
    """Mistral with ``sliding_window`` shorter than the prompt: every layer slides, as in
    transformers (it was once ignored)."""
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=49152, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512, sliding_window=6, bos_token_id=1,
                        eos_token_id=2)
    torch.manual_seed(1)
    out = tmp_path / "mistral-swa"
    MistralForCausalLM(cfg).save_pretrained(str(out))
    arch = arch_config_from_hf(json.loads((out / "config.json").read_text()))
    assert arch.sliding_window == 6 and arch.layer_sliding_window(1) == 6
    assert _greedy_tokens(str(out)) == _hf_greedy(str(out), list(range(500, 537)), 5)


_GEMMA3_LEGACY = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 7, "num_attention_heads": 4,
    "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144, "sliding_window": 512,
    "sliding_window_pattern": 3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
    "hidden_activation": "gelu_pytorch_tanh", "eos_token_id": [1, 106],
}


def test_gemma3_config_legacy_keys_and_refusals():
    arch = arch_config_from_hf(dict(_GEMMA3_LEGACY))
    assert arch.architecture == "Gemma3ForCausalLM" and arch.tie_word_embeddings
    assert [arch.layer_sliding_window(i) for i in range(7)] == [512, 512, None, 512, 512, None,
                                                                 512]
    assert (arch.rope_theta, arch.rope_local_theta) == (1e6, 1e4)
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert arch.query_pre_attn_scalar == 256 and arch.eos_token_ids == [1, 106]
    by_type = arch_config_from_hf({k: v for k, v in _GEMMA3_LEGACY.items()
                                   if k not in ("architectures", "sliding_window_pattern")})
    assert by_type.architecture == "Gemma3ForCausalLM"
    assert [by_type.layer_sliding_window(i) for i in range(7)].count(None) == 1  # pattern 6
    for bad, match in [({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
                       ({"use_bidirectional_attention": True}, "bidirectional"),
                       ({"hidden_activation": "relu"}, "hidden_activation"),
                       ({"layer_types": ["sliding_attention"]}, "layer_types")]:
        with pytest.raises(ValueError, match=match):
            arch_config_from_hf({**_GEMMA3_LEGACY, **bad})


def test_gemma3_dummy_weights_and_softcapping(tiny_gemma3_path, tmp_path):
    """Dummy Gemma 3 weights give finite logits; final logit soft-capping bounds them."""
    config_only = tmp_path / "cfg"
    config_only.mkdir()
    hf = json.loads((Path(tiny_gemma3_path) / "config.json").read_text())
    (config_only / "config.json").write_text(json.dumps({**hf, "final_logit_softcapping": 0.5}))
    tokens = _greedy_tokens(str(config_only), load_format="dummy")
    assert len(tokens) == 5
    loaded = load_model(EngineConfig(model=str(config_only), load_format="dummy", seed=1,
                                     device="cpu"))
    model = loaded.model
    assert loaded.arch.final_logit_softcapping == 0.5
    bs = model.attn_backend.block_size
    meta = model.attn_backend.build_metadata([(0, [0, 1], 5)], [], torch.device("cpu"))
    kv = torch.zeros(2, 3, 2, 2, bs, 32)
    logits = model(torch.arange(5) + 100, torch.arange(5), kv, meta)
    assert torch.isfinite(logits).all() and logits.abs().max() <= 0.5
