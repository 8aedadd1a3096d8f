"""The tensor-parallel layers on two gloo ranks equal their unsharded computation: QKV by
heads (KV heads split, and replicated when fewer than the ranks), merged gate|up, row-parallel
with bias, vocab-parallel embedding and LM head; weights loaded per rank from a safetensors
file through lazy slices (only the rank's shard is read) and from tensors. At TP 1 the same
layers hold the whole weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.layers.weights import LazyWeight

HIDDEN, HEAD_DIM, VOCAB, INTER = 16, 4, 12, 8


def _weights(num_kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    kv = num_kv_heads * HEAD_DIM

    def r(*shape):
        return torch.randn(*shape, generator=g)

    return {"q": r(4 * HEAD_DIM, HIDDEN), "k": r(kv, HIDDEN), "v": r(kv, HIDDEN),
            "qb": r(4 * HEAD_DIM), "kb": r(kv), "vb": r(kv),
            "gate": r(INTER, HIDDEN), "up": r(INTER, HIDDEN), "o": r(HIDDEN, 4 * HEAD_DIM),
            "ob": r(HIDDEN), "embed": r(VOCAB, HIDDEN), "x": r(5, HIDDEN)}


def _lazy(path: str):
    """name -> LazyWeight over the safetensors file, and a log of the slices read."""
    from safetensors import safe_open

    fh = safe_open(path, framework="pt")
    reads = []

    def get(name):
        inner = LazyWeight.from_safetensors(fh.get_slice(name))

        def read(dim, start, length):
            reads.append((name, dim, start, length))
            return inner.load() if dim is None else inner.narrow(dim, start, length)

        return LazyWeight(tuple(inner.shape), read)

    return get, reads


def _check_layers(rank: int, size: int, path: str, num_kv_heads: int) -> None:
    """On TP rank ``rank`` of ``size`` (at 2, one of the package's two ranks: ``tp2`` fixture)."""
    from pdserve.distributed.sharding import kv_head_range
    from pdserve.layers.embedding import LMHead, VocabEmbedding
    from pdserve.layers.linear import MergedLinear, QKVLinear, RowParallelLinear

    torch.set_num_threads(1)
    w = _weights(num_kv_heads)
    get, reads = _lazy(path)
    cpu, f32 = torch.device("cpu"), torch.float32
    x = w["x"]

    qkv = QKVLinear(HIDDEN, 4, num_kv_heads, HEAD_DIM, True, f32, cpu)
    for i, n in enumerate("qkv"):
        qkv.weight_loader(qkv.weight, get(n), i)
        qkv.weight_loader(qkv.bias, w[n + "b"], i)  # tensors work too
    q, k, v = qkv.split(qkv(x))
    nq = 4 // size
    first_kv, nkv = kv_head_range(num_kv_heads, size, rank)
    qs = slice(rank * nq * HEAD_DIM, (rank + 1) * nq * HEAD_DIM)
    ks = slice(first_kv * HEAD_DIM, (first_kv + nkv) * HEAD_DIM)
    torch.testing.assert_close(q, F.linear(x, w["q"], w["qb"])[:, qs])
    torch.testing.assert_close(k, F.linear(x, w["k"], w["kb"])[:, ks])
    torch.testing.assert_close(v, F.linear(x, w["v"], w["vb"])[:, ks])
    assert (qkv.num_heads, qkv.num_kv_heads) == (nq, nkv)
    if size > 1:  # a rank read only its rows of the file
        assert ("q", 0, rank * nq * HEAD_DIM, nq * HEAD_DIM) in reads
        assert not [r for r in reads if r[1] is None]

    gate_up = MergedLinear(HIDDEN, [INTER, INTER], False, f32, cpu)
    gate_up.weight_loader(gate_up.weight, get("gate"), 0)
    gate_up.weight_loader(gate_up.weight, get("up"), 1)
    gate, up = gate_up.split(gate_up(x))
    rows = slice(rank * INTER // size, (rank + 1) * INTER // size)
    torch.testing.assert_close(gate, F.linear(x, w["gate"])[:, rows])
    torch.testing.assert_close(up, F.linear(x, w["up"])[:, rows])

    o = RowParallelLinear(4 * HEAD_DIM, HIDDEN, True, f32, cpu)
    o.weight_loader(o.weight, get("o"))
    o.weight_loader(o.bias, get("ob"))
    attn_full = F.linear(x, w["q"], w["qb"])  # stands in for the attention output
    torch.testing.assert_close(o(attn_full[:, qs].contiguous()),
                               F.linear(attn_full, w["o"], w["ob"]))

    embed = VocabEmbedding(VOCAB, HIDDEN, f32, cpu)
    embed.weight_loader(embed.weight, get("embed"))
    ids = torch.tensor([0, 5, 6, 11, 3])
    torch.testing.assert_close(embed(ids), F.embedding(ids, w["embed"]))
    head = LMHead(VOCAB, HIDDEN, f32, cpu, tie_to=embed)
    torch.testing.assert_close(head(x), F.linear(x, w["embed"]))
    # logits come in the weights' dtype: no float32 copy (the sampler upcasts where it computes)
    head16 = LMHead(VOCAB, HIDDEN, torch.bfloat16, cpu)
    head16.weight_loader(head16.weight, get("embed"))
    logits16 = head16(x.bfloat16())
    assert logits16.dtype == torch.bfloat16 and logits16.shape == (x.shape[0], VOCAB)
    torch.testing.assert_close(logits16, F.linear(x.bfloat16(), w["embed"].bfloat16()))


def _save(tmp_path, num_kv_heads: int) -> str:
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    save_file({k: v for k, v in _weights(num_kv_heads).items() if k != "x"}, path)
    return path


def test_tp1_layers_hold_the_whole_weight(tmp_path):
    _check_layers(0, 1, _save(tmp_path, 2), 2)


@pytest.mark.slow
def test_tp2_layers_equal_unsharded_kv_heads_split(tmp_path, tp2):
    tp2.run(_check_layers, 2, _save(tmp_path, 2), 2)


@pytest.mark.slow
def test_tp2_layers_equal_unsharded_kv_heads_replicated(tmp_path, tp2):
    tp2.run(_check_layers, 2, _save(tmp_path, 1), 1)
