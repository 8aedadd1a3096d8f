"""The served families beyond Llama/Qwen3 and rope scaling: greedy tokens of the runner equal
``transformers``' on tiny random models (Qwen2 with tied embeddings, Qwen2 with YaRN, Llama 3
rope scaling, dynamic NTK, Qwen3-MoE with and without ``norm_topk_prob``), in mixed batches with
chunked prefill and prompts past the rope-scaling threshold; the loader's start-up summary and
the config features it refuses by name."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from pdserve.types.engine_config import EngineConfig
from pdserve.layers import rotary
from pdserve.models.loader import arch_config_from_hf, load_model
from pdserve.runner.model_runner import ModelRunner
from pdserve.testing.tiny_models import make_tiny_model

from tests.support.model_driver import DrivenRequest, MiniScheduler, greedy

from tests.support.families import MODELS, ORIGINAL_CTX, YARN, make_family_model

B = 16
NUM_NEW = 6
NUM_BLOCKS = 64


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


def _hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                            do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request, tmp_path_factory) -> str:
    return make_family_model(request.param, tmp_path_factory.mktemp(request.param))


def test_mixed_batch_matches_transformers(model_path):
    """Short prompts, a block-boundary one and a long one prefilled in chunks (past the rope
    threshold), joining at different steps so prefills and decodes share batches."""
    from transformers import AutoModelForCausalLM

    runner = ModelRunner(EngineConfig(model=model_path, max_model_len=256, block_size=B,
                                      num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(runner.determine_num_blocks())
    lens = [1, B + 1, 3 * ORIGINAL_CTX + 5]
    reqs = [DrivenRequest(f"r{i}", _prompt(n, seed=n), NUM_NEW, greedy(NUM_NEW), start_step=i,
                          chunks=[n // 2, n - n // 2] if n > ORIGINAL_CTX else None)
            for i, n in enumerate(lens)]
    MiniScheduler(runner, NUM_BLOCKS).run(reqs)
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    outputs = set()
    for r in reqs:
        ref = _hf_greedy(hf, r.prompt, NUM_NEW)
        assert r.output[:len(ref)] == ref, f"prompt {len(r.prompt)}: {r.output} != {ref}"
        outputs.add(tuple(ref))
    assert len(outputs) == len(reqs)  # the model is not degenerate


def test_rope_parameters_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cases = [YARN, dict(YARN, factor=2.0, beta_fast=16, beta_slow=2,
                        mscale=0.8, mscale_all_dim=0.6),
             dict(YARN, truncate=False), {"rope_type": "dynamic", "rope_theta": 10000.0,
                                          "factor": 2.0}]
    for scaling in cases:
        params = dict(scaling)
        hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                             max_position_embeddings=128, rope_parameters=dict(params))
        seq_len = 300 if scaling["rope_type"] == "dynamic" else None
        ref, ref_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf_cfg, "cpu", seq_len=seq_len)
        arch = arch_config_from_hf(hf_cfg.to_dict())
        ours, factor = rotary.rope_parameters(arch.head_dim, arch.rope_theta, arch.rope_scaling,
                                              max_positions=300)
        torch.testing.assert_close(ours, ref.float(), msg=str(scaling))
        assert factor == pytest.approx(ref_factor), scaling
    assert rotary.rope_parameters(16, 1e4, {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 32})[1] > 1.0


def test_dynamic_rope_within_its_context_equals_transformers(tmp_path):
    """``dynamic`` leaves the frequencies alone while the engine's context stays within the
    config's ``max_position_embeddings`` (as Hugging Face does for such sequences)."""
    from transformers import AutoModelForCausalLM

    path = str(make_tiny_model(tmp_path / "m", "llama", max_position_embeddings=256,
                               rope_parameters={"rope_type": "dynamic", "factor": 4.0,
                                                "rope_theta": 10000.0}))
    runner = ModelRunner(EngineConfig(model=path, max_model_len=256, block_size=B,
                                      num_gpu_blocks_override=NUM_BLOCKS))
    runner.allocate_kv_cache(NUM_BLOCKS)
    req = DrivenRequest("a", _prompt(100, 1), NUM_NEW, greedy(NUM_NEW))
    MiniScheduler(runner, NUM_BLOCKS).run([req])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert req.output == _hf_greedy(hf, req.prompt, NUM_NEW)
    # past the threshold the table is Hugging Face's for a sequence of max_model_len tokens
    longer = load_model(EngineConfig(model=path, max_model_len=512)).model
    inv = rotary.rope_inv_freq(16, 10000.0, {"rope_type": "dynamic", "factor": 4.0,
                                             "original_max_position_embeddings": 256}, 512)
    freqs = 511 * inv
    torch.testing.assert_close(longer.layers[0].self_attn.rotary_emb.cos_cache[511], freqs.cos())


def _config(**fields) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 100}
    base.update(fields)
    return base


@pytest.mark.parametrize("fields, message", [
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope'"),
    ({"rope_scaling": {"type": "su", "factor": 2.0}}, "'su'"),
    ({"rope_scaling": {"rope_type": "linear"}}, "needs a positive 'factor'"),
    ({"architectures": ["MixtralForCausalLM"]}, "'MixtralForCausalLM'"),
    ({"architectures": ["Qwen2MoeForCausalLM"]}, "shared experts"),
    ({"num_local_experts": 8}, "mixture-of-experts keys"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2,
      "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64}, "shared experts"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8, "num_experts_per_tok": 2},
     "'moe_intermediate_size'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 2, "num_experts_per_tok": 4,
      "moe_intermediate_size": 32}, "exceeds"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True}, "use_sliding_window"),
    ({"quantization_config": {"quant_method": "fp8"}}, "'fp8'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary"),
])
def test_unsupported_features_are_refused_by_name(fields, message):
    with pytest.raises(ValueError, match=message):
        arch_config_from_hf(_config(**fields))


def test_family_fields_and_start_up_summary(caplog, tmp_path):
    qwen2 = arch_config_from_hf(_config(architectures=["Qwen2ForCausalLM"]))
    assert qwen2.qkv_bias and not qwen2.attention_bias and qwen2.max_position_embeddings == 32768
    moe = arch_config_from_hf(_config(model_type="qwen3_moe", architectures=None, num_experts=8,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      decoder_sparse_step=2, num_hidden_layers=4))
    assert moe.architecture == "Qwen3MoeForCausalLM" and moe.qk_norm and moe.head_dim == 16
    assert [moe.moe.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    path = make_tiny_model(tmp_path / "m", "qwen3_moe", tokenizer_dir=tmp_path)
    with caplog.at_level(logging.INFO, logger="pdserve.model"):
        loaded = load_model(EngineConfig(model=str(path), dtype="bfloat16"))
    line = next(r.getMessage() for r in caplog.records if "parameters" in r.getMessage())
    total = sum(p.numel() for p in loaded.model.parameters())
    # layer 0 has 8 experts of 3 * 64 * 32 weights, 2 of them active per token
    active = total - 6 * 3 * 64 * 32
    cfg = json.loads((path / "config.json").read_text())
    kv = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    assert line.startswith("Qwen3-MoE: ")
    assert f"{total / 1e6:.1f}M parameters ({active / 1e6:.1f}M active per token)" in line
    assert f"KV 2 layers x 2 heads x 32 = {kv / 1024:.1f} KiB per token, rope default" in line


@pytest.mark.slow
def test_serve_refuses_an_unknown_rope_type_at_start_up(tmp_path):
    """``pdserve serve`` on a config with a rope type it lacks exits non-zero with the type's
    name, before serving anything."""
    import subprocess
    import sys

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_config(
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})))
    r = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", str(d), "--port", "0",
                        "--load-format", "dummy", "--num-gpu-blocks-override", "16"],
                       capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)
    assert r.returncode != 0
    assert "unsupported rope scaling type 'longrope'" in r.stderr, r.stderr[-2000:]
