"""Compatibility fields: the KV cache properties two instances must share for one to read the
other's blocks, their hash (exchanged at the handshake, :mod:`.side_channel`) and how a
mismatch is told."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pdserve.kv_transfer.base import KVCacheSpec

PROTOCOL_VERSION = 2


def total_kv_heads(spec: KVCacheSpec) -> int:
    """KV heads of the whole model (``spec.total_num_kv_heads``, or the rank's own at TP 1)."""
    return spec.total_num_kv_heads or spec.num_kv_heads


def compat_fields(spec: KVCacheSpec) -> dict[str, Any]:
    """The KV cache properties two instances must share for one to read the other's blocks.
    The TP sizes may differ (:mod:`.tp_plan` says who reads what); the model's KV heads may
    not."""
    return {
        "protocol": PROTOCOL_VERSION,
        "model": spec.model_name,
        "dtype": spec.dtype,
        "kv_scales": list(spec.kv_scales),
        "num_layers": spec.num_layers,
        "total_num_kv_heads": total_kv_heads(spec),
        "head_dim": spec.head_dim,
        "block_size": spec.block_size,
        "layout": spec.layout,
        "cache_kind": spec.kind.value,
    }


def cache_kind_mismatch(local: dict[str, Any], remote: dict[str, Any]) -> str | None:
    """Why two instances whose caches hold different things cannot pair (their
    :class:`~pdserve.types.kv_cache_kind.KVCacheKind`: per-head K/V against a multi-head
    latent), or None when the kinds agree. Checked before the head counts, whose mismatch would
    otherwise hide the reason."""
    mine, theirs = local.get("cache_kind"), remote.get("cache_kind")
    if mine == theirs:
        return None
    return (f"cache_kind: local={mine!r} remote={theirs!r}: a multi-head latent (MLA) cache holds "
            "one latent entry per token, a per-head cache holds keys and values per head; "
            "neither can read the other's blocks (pair instances that serve the same model)")


def compat_hash(fields: dict[str, Any]) -> str:
    """SHA-256 (hex) of the canonical JSON of :func:`compat_fields`."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def compat_mismatch(local: dict[str, Any], remote: dict[str, Any]) -> str:
    """Human-readable list of differing compatibility fields (empty when equal); per-layer
    ``kv_scales`` are summarised (:func:`scales_mismatch`)."""
    diffs = [
        scales_mismatch(local.get(k), remote.get(k), local.get("num_layers")) if k == "kv_scales"
        else f"{k}: local={local.get(k)!r} remote={remote.get(k)!r}"
        for k in sorted(set(local) | set(remote))
        if local.get(k) != remote.get(k)
    ]
    return "; ".join(diffs)


def scales_mismatch(local: Any, remote: Any, num_layers: Any, shown: int = 2) -> str:
    """How two fp8 caches' ``kv_scales`` (per layer: all key scales, then all value scales)
    differ: how many layers, and the first ``shown`` of them, not every scale."""
    local, remote = list(local or ()), list(remote or ())
    if len(local) != len(remote) or not isinstance(num_layers, int) or \
            len(local) != 2 * num_layers:
        return (f"kv_scales: local has {len(local) or 'none'}, remote {len(remote) or 'none'} "
                f"(per-layer key and value scales of an fp8 KV cache)")
    differ = [layer for layer in range(num_layers)
              if (local[layer], local[num_layers + layer])
              != (remote[layer], remote[num_layers + layer])]
    first = "; ".join(
        f"layer {layer}: local k={local[layer]:.6g} v={local[num_layers + layer]:.6g}, remote "
        f"k={remote[layer]:.6g} v={remote[num_layers + layer]:.6g}" for layer in differ[:shown])
    more = f"; ... ({len(differ) - shown} more)" if len(differ) > shown else ""
    return f"kv_scales differ in {len(differ)} of {num_layers} layers ({first}{more})"
