"""DeepSeek's weights in memory are the checkpoint's, once: the model's parameter and buffer bytes
against ``transformers``' parameter count of the same config (tiny configs of each version, and
DeepSeek-V2-Lite itself built on the ``meta`` device, so no memory is used), so that no weight is
kept twice (per-expert tensors beside the stacked ones, float32 copies, absorbed ``W_UK`` /
``W_UV`` copies beside ``kv_b_proj``, tensors held as plain attributes)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from benchmarks.model_configs import deepseek_v2_lite_config
from pdserve.models.deepseek import DeepseekForCausalLM
from pdserve.models.loader import arch_config_from_hf
from pdserve.testing.tiny_models import _CONFIG_CLASSES, _COMMON, _DEFAULTS

GiB = 1 << 30
META = torch.device("meta")


def _unique(tensors) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _router_numel(model: nn.Module) -> int:
    """Elements of the routers' float32 tensors (weights, and V3's correction bias: kept in
    float32 as the routing is computed in float32; the one allowed difference from 2 bytes a
    parameter)."""
    return sum(p.numel() for n, p in model.named_parameters()
               if ".mlp.gate." in n and p.dtype == torch.float32)


def _check(hf_config: dict) -> tuple[int, int]:
    """Build pdserve's model of ``hf_config`` in bfloat16 on the meta device; check its bytes and
    return ``(parameter elements, parameter + buffer bytes)``."""
    from transformers import AutoModelForCausalLM

    arch = arch_config_from_hf(hf_config)
    model = DeepseekForCausalLM(arch, torch.bfloat16, META, 16, max_positions=4096)
    params = _unique(model.parameters())
    buffers = _unique(model.buffers())
    numel = sum(p.numel() for p in params)

    # transformers' model of the same config, also on the meta device
    config_cls = getattr(__import__("transformers"), _CONFIG_CLASSES[
        "deepseek_v3" if "V3" in hf_config["architectures"][0] else "deepseek_v2"])
    fields = {k: v for k, v in hf_config.items() if k not in ("architectures", "model_type")}
    with torch.device("meta"):
        hf_model = AutoModelForCausalLM.from_config(config_cls(**fields), dtype=torch.bfloat16)
    hf_numel = sum(p.numel() for p in hf_model.parameters())
    # V3's e_score_correction_bias: a buffer in transformers, a parameter here
    hf_numel += sum(b.numel() for n, b in hf_model.named_buffers()
                    if n.endswith("e_score_correction_bias"))
    assert numel == hf_numel

    # every parameter in the model's dtype but the routers' float32 ones: 2 bytes an element
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    assert param_bytes == 2 * numel + 2 * _router_numel(model)
    # buffers: the rotary cos/sin caches only (shared by every layer: counted once)
    buffer_bytes = sum(b.numel() * b.element_size() for b in buffers)
    assert buffer_bytes <= 2 * 4096 * arch.qk_rope_head_dim * 4
    # no tensor kept as a plain attribute of a module (a copy the two sums above miss)
    registered = {id(t) for t in params + buffers}
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not attr.startswith("_"):
                assert id(value) in registered, f"{name}.{attr}: an unregistered tensor"
    return numel, param_bytes + buffer_bytes


def _tiny(arch: str) -> dict:
    config_cls = getattr(__import__("transformers"), _CONFIG_CLASSES[arch])
    config = config_cls(**{**_COMMON, **_DEFAULTS[arch]})
    fields = json.loads(config.to_json_string(use_diff=False))
    fields["architectures"] = [
        "DeepseekV3ForCausalLM" if arch == "deepseek_v3" else "DeepseekV2ForCausalLM"]
    return fields


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_lite", "deepseek_v3"])
def test_tiny_model_holds_each_weight_once(arch):
    _check(_tiny(arch))


def test_v2_lite_weights_are_its_parameter_count_in_bf16():
    numel, nbytes = _check(deepseek_v2_lite_config())
    assert 15.6e9 < numel < 15.8e9  # "15.7B parameters"
    assert 29.0 * GiB < nbytes < 29.5 * GiB  # 2 bytes each, the float32 routers, rotary caches
