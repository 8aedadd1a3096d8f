"""The KV geometries of ``benchmarks/kv_transfer.py`` and the TP plan it prints before its
rows (which owner ranks each reader rank reads, and the descriptors of a request)."""

from __future__ import annotations

#: ``--geometry`` name -> layers, KV heads (all ranks), head size and, for a latent, the kind
GEOMETRIES = {
    "smollm2": {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
    "llama-8b": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128},
    "qwen3-0.6b": {"num_layers": 28, "num_kv_heads": 8, "head_dim": 128},
    # DeepSeek-V2-Lite's latent cache: one entry of kv_lora_rank 512 + qk_rope_head_dim 64 per
    # token and layer, as pdserve stores it (one head of half the entry in each of the K and V
    # slots), replicated on every TP rank
    "deepseek-v2-lite": {"num_layers": 27, "num_kv_heads": 1, "head_dim": 288,
                         "kind": "mla_latent"},
}
#: bytes per KV value of each ``--dtype``
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def print_plan(heads: int, prefill_tp: int, decode_tp: int, num_layers: int,
               kind_name: str) -> None:
    """Print the plan of P at ``prefill_tp`` ranks read by D at ``decode_tp`` ranks (``heads``
    KV heads in all, a cache of ``kind_name``, a :class:`~pdserve.types.kv_cache_kind.
    KVCacheKind` value): each D rank's reads and descriptors, and the request's total
    (:mod:`pdserve.kv_transfer.nixl.tp_plan`).

    Raises:
        SystemExit: the two sides cannot pair (the plan's reason).
    """
    from pdserve.kv_transfer.nixl.tp_plan import (
        descriptors_per_request, heads_per_rank, pairing_error, plan_reads)
    from pdserve.types.kv_cache_kind import KVCacheKind

    kind = KVCacheKind(kind_name)
    err = pairing_error(heads, prefill_tp, heads, decode_tp, kind)
    if err is not None:
        raise SystemExit(f"P TP {prefill_tp} -> D TP {decode_tp} with {heads} KV heads: {err}")
    print(f"# {kind.value} cache: P TP {prefill_tp} ({heads_per_rank(heads, prefill_tp)} KV heads "
          f"per rank) -> D TP {decode_tp} ({heads_per_rank(heads, decode_tp)} per rank), {heads} "
          f"KV heads")
    for j in range(decode_tp):
        reads = ", ".join(f"P rank {r.src_rank} heads {r.src_head}..{r.src_head + r.count - 1}"
                          for r in plan_reads(heads, prefill_tp, decode_tp, j, kind))
        per_rank = [descriptors_per_request(heads, prefill_tp, decode_tp, num_layers, n,
                                            kind=kind, dst_rank=j) for n in (1, 8)]
        print(f"#   D rank {j} reads {reads}: {per_rank[0]} descriptors for a run of 1 block, "
              f"{per_rank[1]} for 8")
    print(f"# descriptors per request of n blocks in one run (all D ranks): "
          f"{descriptors_per_request(heads, prefill_tp, decode_tp, num_layers, 1, kind=kind)} "
          f"for n = 1, "
          f"{descriptors_per_request(heads, prefill_tp, decode_tp, num_layers, 8, kind=kind)} "
          f"for n = 8")
