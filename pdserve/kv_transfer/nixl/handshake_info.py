"""What an instance answers to a NIXL handshake: each TP rank's agent and KV cache, and the
instance's compatibility fields, lease duration and TP layout (the side channel's ``get_info``
answer, :mod:`.side_channel`)."""

from __future__ import annotations

from typing import Any

from pdserve.kv_transfer.base import KVCacheSpec, TPRank
from pdserve.kv_transfer.nixl.agent import NixlAgent
from pdserve.kv_transfer.nixl.compat import compat_hash, total_kv_heads
from pdserve.kv_transfer.nixl.tp_plan import HeadRange


def rank_entry(agent: NixlAgent, spec: KVCacheSpec, tp: TPRank, heads: HeadRange,
               instance_id: str) -> dict[str, Any]:
    """One TP rank's part of the handshake info: its NIXL agent (name, metadata, registered KV
    cache base address, memory type, device), the cache's ``block_bytes`` and ``num_blocks``,
    the rank and the global KV heads it holds, and its process's ``instance_id``."""
    return {
        "agent_name": agent.name,
        "agent_metadata": agent.metadata(),
        "kv_base_addr": agent.base_addr,
        "block_bytes": spec.block_bytes,
        "num_blocks": spec.num_blocks,
        "mem_type": agent.mem_type,
        "device_id": agent.device_id,
        "tp_rank": tp.rank,
        "head_start": heads.start,
        "num_heads": heads.count,
        "instance_id": instance_id,
    }


def instance_info(engine_id: str, compat: dict[str, Any], lease_duration_s: float,
                  spec: KVCacheSpec, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The instance's handshake info from every rank's :func:`rank_entry` (by rank); its
    ``instance_id`` is rank 0's, which answers claims."""
    return {
        "engine_id": engine_id,
        "instance_id": ranks[0]["instance_id"],
        "compat": compat,
        "compat_hash": compat_hash(compat),
        "lease_duration": lease_duration_s,
        "tp_size": len(ranks),
        "total_num_kv_heads": total_kv_heads(spec),
        "ranks": [{k: v for k, v in r.items() if k != "instance_id"} for r in ranks],
    }
