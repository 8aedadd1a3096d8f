"""Prometheus families of the KV cache tiers (``--kv-offloading-size``) and of a decoder's
demoted turn leases, read at scrape time from the engine snapshot's ``kv_tiers``
(:meth:`pdserve.engine.kv_tiers.TierManager.stats`) and ``kv_turns``
(:meth:`pdserve.engine.turn_demotion.TurnDemoter.stats`).

Families (``medium``: ``CPU`` the host-memory tier, ``DISK`` the disk tier; ``GPU``, for bytes,
the engine's KV cache):

* ``pdserve:kv_offload_capacity_blocks{medium}`` / ``pdserve:kv_offload_used_blocks{medium}``
  (gauges): the tier's size and the blocks it holds;
* ``pdserve:kv_offload_hits_total{medium}``: blocks a prefix lookup found there and loaded;
* ``pdserve:kv_offload_stored_blocks_total{medium}``: blocks written into the tier;
* ``pdserve:kv_offload_evictions_total{medium}``: blocks that left it for lack of room;
* ``pdserve:kv_offload_bytes_total{medium}``: bytes copied into that medium;
* ``pdserve:kv_offload_prompt_tokens_loaded_total``: prompt tokens whose KV came back from a
  tier; ``pdserve:kv_offload_failed_loads_total``: loads with an unreadable block (a corrupt or
  truncated file: recomputed);
* ``pdserve:kv_offload_copy_seconds`` (histogram): time of each batch of tier copies;
* a bidirectional decoder's turn leases under GPU pressure (:mod:`pdserve.engine.turn_demotion`;
  with or without tiers: without, the blocks go to the prefix cache only):
  ``pdserve:kv_offload_turns_demoted_total`` (leases whose blocks left the GPU),
  ``pdserve:kv_offload_turns_restored_total`` (demoted turns brought back for the next turn's
  reader), ``pdserve:kv_offload_turn_blocks_restored_total{medium}`` (their blocks, by where
  they came from: ``GPU`` still in the prefix cache, ``TIER`` loaded from the host or disk
  tier), ``pdserve:kv_offload_turns_lost_total`` (claimed after every tier lost them: the
  reader recomputed).

Nothing is rendered for an engine without tiers and without a KV connector.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from prometheus_client.metrics_core import (
    CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric,
)

from pdserve.types.kv_tiers import COPY_TIME_BUCKETS_S

logger = logging.getLogger(__name__)

KV_OFFLOAD_CAPACITY_BLOCKS = "pdserve:kv_offload_capacity_blocks"
KV_OFFLOAD_USED_BLOCKS = "pdserve:kv_offload_used_blocks"
KV_OFFLOAD_HITS = "pdserve:kv_offload_hits"  # counters: rendered with _total
KV_OFFLOAD_STORED_BLOCKS = "pdserve:kv_offload_stored_blocks"
KV_OFFLOAD_EVICTIONS = "pdserve:kv_offload_evictions"
KV_OFFLOAD_BYTES = "pdserve:kv_offload_bytes"
KV_OFFLOAD_PROMPT_TOKENS_LOADED = "pdserve:kv_offload_prompt_tokens_loaded"
KV_OFFLOAD_FAILED_LOADS = "pdserve:kv_offload_failed_loads"
KV_OFFLOAD_COPY_SECONDS = "pdserve:kv_offload_copy_seconds"
KV_OFFLOAD_TURNS_DEMOTED = "pdserve:kv_offload_turns_demoted"
KV_OFFLOAD_TURNS_RESTORED = "pdserve:kv_offload_turns_restored"
KV_OFFLOAD_TURN_BLOCKS_RESTORED = "pdserve:kv_offload_turn_blocks_restored"
KV_OFFLOAD_TURNS_LOST = "pdserve:kv_offload_turns_lost"

# (family, kind, key in a medium's stats, help)
_PER_MEDIUM = (
    (KV_OFFLOAD_CAPACITY_BLOCKS, "gauge", "capacity_blocks", "Blocks the KV cache tier holds at most."),
    (KV_OFFLOAD_USED_BLOCKS, "gauge", "used_blocks", "Blocks in the KV cache tier now."),
    (KV_OFFLOAD_HITS, "counter", "hits",
     "Blocks a prefix lookup found in the KV cache tier and copied back."),
    (KV_OFFLOAD_STORED_BLOCKS, "counter", "stored", "Blocks written into the KV cache tier."),
    (KV_OFFLOAD_EVICTIONS, "counter", "evictions",
     "Blocks that left the KV cache tier for lack of room."),
)


def _field(stats: Any, name: str) -> Any:
    if isinstance(stats, Mapping):
        return stats.get(name)
    return getattr(stats, name, None)


class KVTierCollector:
    """Renders the ``kv_tiers`` part of ``engine.stats()`` (summed over data-parallel ranks).

    Args:
        stats_fn: ``engine.stats``.
    """

    def __init__(self, stats_fn: Callable[[], Any]):
        self._stats_fn = stats_fn

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:  # noqa: BLE001 - a dead engine must not break the scrape
            logger.warning("engine.stats() failed; KV tier metrics omitted", exc_info=True)
            return
        tiers, turns = _field(stats, "kv_tiers"), _field(stats, "kv_turns")
        if tiers:
            yield from _tier_families(tiers)
        if turns:
            yield from _turn_families(turns)


def _tier_families(tiers: Mapping[str, Any]) -> Iterable[Metric]:
    """The families of the KV cache tiers (see the module docstring)."""
    media: Mapping[str, Mapping[str, Any]] = tiers.get("media", {})
    for family, kind, key, doc in _PER_MEDIUM:
        cls = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
        fam = cls(family, doc, labels=["medium"])
        for medium, values in sorted(media.items()):
            fam.add_metric([medium], float(values.get(key, 0)))
        yield fam
    moved = CounterMetricFamily(KV_OFFLOAD_BYTES, "Bytes copied into a medium by the KV "
                                "cache tiers (GPU: back into the KV cache).", labels=["medium"])
    for medium, values in sorted(media.items()):
        moved.add_metric([medium], float(values.get("bytes_in", 0)))
    moved.add_metric(["GPU"], float(tiers.get("bytes_to_device", 0)))
    yield moved
    yield CounterMetricFamily(KV_OFFLOAD_PROMPT_TOKENS_LOADED,
                              "Prompt tokens whose KV came back from a KV cache tier.",
                              value=float(tiers.get("prompt_tokens_loaded", 0)))
    yield CounterMetricFamily(KV_OFFLOAD_FAILED_LOADS,
                              "KV cache tier loads with an unreadable block (recomputed).",
                              value=float(tiers.get("failed_loads", 0)))
    counts = list(tiers.get("copy_time_counts") or [0] * (len(COPY_TIME_BUCKETS_S) + 1))
    cumulative, running = [], 0
    for bound, n in zip([*map(str, COPY_TIME_BUCKETS_S), "+Inf"], counts):
        running += n
        cumulative.append((bound, float(running)))
    yield HistogramMetricFamily(KV_OFFLOAD_COPY_SECONDS,
                                "Time of one batch of KV cache tier copies (s).",
                                buckets=cumulative, sum_value=float(tiers.get("copy_time_sum_s", 0.0)))


def _turn_families(turns: Mapping[str, Any]) -> Iterable[Metric]:
    """The families of a decoder's demoted turn leases (see the module docstring)."""
    yield CounterMetricFamily(KV_OFFLOAD_TURNS_DEMOTED, "Turn leases whose blocks left the GPU "
                              "under pressure.", value=float(turns.get("turns_demoted", 0)))
    yield CounterMetricFamily(KV_OFFLOAD_TURNS_RESTORED, "Demoted turn leases whose blocks came "
                              "back for a reader.", value=float(turns.get("turns_restored", 0)))
    blocks = CounterMetricFamily(KV_OFFLOAD_TURN_BLOCKS_RESTORED, "Blocks of restored turn "
                                 "leases, by where they came from.", labels=["medium"])
    blocks.add_metric(["GPU"], float(turns.get("turn_blocks_from_gpu", 0)))
    blocks.add_metric(["TIER"], float(turns.get("turn_blocks_from_tiers", 0)))
    yield blocks
    yield CounterMetricFamily(KV_OFFLOAD_TURNS_LOST, "Demoted turn leases claimed after every "
                              "tier lost their blocks (recomputed).",
                              value=float(turns.get("turns_lost", 0)))
