"""Prometheus metrics of one pdserve API server: every exposed name lives in this module.

Three sources feed ``GET /metrics``:

* **Engine snapshot and cumulative counters** — read from ``engine.stats()`` (an ``EngineStats``
  object or a dict with the same keys) at scrape time by :class:`EngineStatsCollector`, so the
  numbers are never older than the engine's last step.
* **Per-request latencies and outcomes** — TTFT, TPOT, end-to-end latency and
  ``pdserve:request_success_total{finish_reason}``, observed by the HTTP front end
  (:meth:`ServerMetrics.observe_first_token`, :meth:`ServerMetrics.observe_finished`,
  :meth:`ServerMetrics.count_finished`), because the front end sees the request arrive, the
  tokens leave, and the requests its clients abandon.
* **KV cache tiers** — the snapshot's ``kv_tiers``, rendered by
  :class:`~pdserve.entrypoints.tier_metrics.KVTierCollector` (its module lists the families).
* **KV connector observations** — delta dicts pushed by the engine through
  ``engine.add_stats_listener(fn)`` (see :meth:`ServerMetrics.on_connector_stats`).

Each :class:`ServerMetrics` owns its own :class:`prometheus_client.CollectorRegistry` (never the
global one), so several apps in one process (tests) do not collide.

``prometheus_client`` appends ``_total`` to every counter family it renders. Engine counters are
therefore declared without the suffix (``pdserve:prompt_tokens`` is exposed as
``pdserve:prompt_tokens_total``), and the connector counters, whose names have no ``_total``,
are rendered by hand in the text format (``# TYPE pdserve:nixl_num_failed_transfers counter``).
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdserve.entrypoints.tier_metrics import KVTierCollector

logger = logging.getLogger(__name__)

PREFIX = "pdserve:"

# --- gauges (engine snapshot) -----------------------------------------------------------------
NUM_REQUESTS_RUNNING = "pdserve:num_requests_running"
NUM_REQUESTS_WAITING = "pdserve:num_requests_waiting"
KV_CACHE_USAGE_PERC = "pdserve:kv_cache_usage_perc"
KV_CACHE_FREE_BLOCKS = "pdserve:kv_cache_free_blocks"
KV_CACHE_TOTAL_BLOCKS = "pdserve:kv_cache_total_blocks"

# --- counters (engine, cumulative); exposed names end in _total ------------------------------
PROMPT_TOKENS_TOTAL = "pdserve:prompt_tokens_total"
PROMPT_TOKENS_COMPUTED_TOTAL = "pdserve:prompt_tokens_computed_total"
PROMPT_TOKENS_CACHED_TOTAL = "pdserve:prompt_tokens_cached_total"
PROMPT_TOKENS_TRANSFERRED_TOTAL = "pdserve:prompt_tokens_transferred_total"
GENERATION_TOKENS_TOTAL = "pdserve:generation_tokens_total"
REQUEST_SUCCESS_TOTAL = "pdserve:request_success_total"  # label: finish_reason
NUM_PREEMPTIONS_TOTAL = "pdserve:num_preemptions_total"

# --- histograms (front end) --------------------------------------------------------------------
TIME_TO_FIRST_TOKEN_SECONDS = "pdserve:time_to_first_token_seconds"
TIME_PER_OUTPUT_TOKEN_SECONDS = "pdserve:time_per_output_token_seconds"
E2E_REQUEST_LATENCY_SECONDS = "pdserve:e2e_request_latency_seconds"

# --- KV connector (NIXL) -----------------------------------------------------------------------
NIXL_XFER_TIME_SECONDS = "pdserve:nixl_xfer_time_seconds"
# P/D hand-off on the owner: from a prompt lease's start to its reader's "done" (seconds)
KV_HANDOFF_SECONDS = "pdserve:kv_handoff_seconds"
NIXL_POST_TIME_SECONDS = "pdserve:nixl_post_time_seconds"
NIXL_BYTES_TRANSFERRED = "pdserve:nixl_bytes_transferred"
NIXL_NUM_DESCRIPTORS = "pdserve:nixl_num_descriptors"
NIXL_NUM_FAILED_TRANSFERS = "pdserve:nixl_num_failed_transfers"
# transfers that read only the leading blocks the owner still held (not failures)
NIXL_NUM_PARTIAL_TRANSFERS = "pdserve:nixl_num_partial_transfers"
NIXL_NUM_FAILED_NOTIFICATIONS = "pdserve:nixl_num_failed_notifications"
NIXL_NUM_KV_EXPIRED_REQS = "pdserve:nixl_num_kv_expired_reqs"
# The path that carries reads from each peer (kv_transfer/nixl/transfer_path.py): 1 for the
# current {peer_engine_id, transport, mem}; and the first sizable read's bandwidth.
KV_TRANSFER_PATH_INFO = "pdserve:kv_transfer_path_info"
KV_TRANSFER_READ_GBPS = "pdserve:kv_transfer_read_gbps"
NIXL_NUM_KV_TURNS_EXPIRED = "pdserve:nixl_num_kv_turns_expired"
KV_LEASES_RELEASED_EARLY = "pdserve:kv_leases_released_early_total"
# a prefiller's pulls whose lease claim took longer than computing their tokens (not failures)
NIXL_NUM_PULLS_GIVEN_UP = "pdserve:nixl_num_pulls_given_up"

# Bucket bounds. Latencies: roughly x2-x2.5 steps from 1 ms to 10 min, wide enough for a CPU
# engine under load and fine enough for a GPU decode step. Sizes: powers of two.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)
TPOT_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1,
    0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)
XFER_TIME_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)
BYTES_BUCKETS = tuple(float(2**k) for k in range(10, 37, 2))  # 1 KiB .. 64 GiB
DESCRIPTOR_BUCKETS = tuple(float(2**k) for k in range(0, 17))  # 1 .. 65536


@dataclass(frozen=True)
class _EngineMetric:
    """How engine stats fields are exposed: family name (without ``_total`` for counters),
    kind (``gauge`` or ``counter``), the stats attribute it reads (``extra``: attributes added
    to it when present), and its help text."""

    family: str
    kind: str
    attr: str
    doc: str
    extra: tuple[str, ...] = ()


# Engine stats fields (EngineStats attribute or dict key) -> exposed metric.
ENGINE_METRICS: tuple[_EngineMetric, ...] = (
    _EngineMetric(NUM_REQUESTS_RUNNING, "gauge", "num_running",
                  "Requests in the running batch."),
    _EngineMetric(NUM_REQUESTS_WAITING, "gauge", "num_waiting",
                  "Requests waiting to be scheduled, including those waiting for remote KV.",
                  extra=("num_waiting_for_remote_kvs",)),
    _EngineMetric(KV_CACHE_USAGE_PERC, "gauge", "kv_cache_usage",
                  "Fraction of KV cache blocks in use (0..1; 1 means 100 percent)."),
    _EngineMetric(KV_CACHE_FREE_BLOCKS, "gauge", "num_free_blocks",
                  "KV cache blocks that are free (cached-but-unreferenced blocks count as free)."),
    _EngineMetric(KV_CACHE_TOTAL_BLOCKS, "gauge", "num_blocks",
                  "KV cache blocks in total."),
    _EngineMetric(PROMPT_TOKENS_TOTAL[: -len("_total")], "counter", "prompt_tokens_total",
                  "Prompt tokens received by the engine."),
    _EngineMetric(PROMPT_TOKENS_COMPUTED_TOTAL[: -len("_total")], "counter",
                  "prompt_tokens_computed_total", "Prompt tokens this engine actually prefilled."),
    _EngineMetric(PROMPT_TOKENS_CACHED_TOTAL[: -len("_total")], "counter",
                  "prompt_tokens_cached_total",
                  "Prompt tokens served from the local prefix cache."),
    _EngineMetric(PROMPT_TOKENS_TRANSFERRED_TOTAL[: -len("_total")], "counter",
                  "prompt_tokens_transferred_total",
                  "Prompt tokens whose KV was loaded from another instance."),
    _EngineMetric(GENERATION_TOKENS_TOTAL[: -len("_total")], "counter",
                  "generation_tokens_total",
                  "Tokens generated."),
    _EngineMetric(NUM_PREEMPTIONS_TOTAL[: -len("_total")], "counter",
                  "num_preemptions_total",
                  "Requests preempted (KV freed, recomputed later) because blocks ran out."),
)
# Label of the engine metrics' samples with data parallelism: the rank's number.
DP_RANK_LABEL = "dp_rank"
# finish_reason label values counted by pdserve:request_success_total (errors are not successes).
SUCCESS_FINISH_REASONS = ("stop", "length", "abort")

# Keys of the connector's delta dicts -> histogram names.
CONNECTOR_HISTOGRAM_KEYS = {
    "xfer_time_s": NIXL_XFER_TIME_SECONDS,
    "post_time_s": NIXL_POST_TIME_SECONDS,
    "bytes": NIXL_BYTES_TRANSFERRED,
    "num_descriptors": NIXL_NUM_DESCRIPTORS,
    "handoff_s": KV_HANDOFF_SECONDS,
}
CONNECTOR_COUNTER_KEYS = {
    "num_failed_transfers": NIXL_NUM_FAILED_TRANSFERS,
    "num_partial_transfers": NIXL_NUM_PARTIAL_TRANSFERS,
    "num_failed_notifications": NIXL_NUM_FAILED_NOTIFICATIONS,
    "num_kv_expired_reqs": NIXL_NUM_KV_EXPIRED_REQS,
    "num_kv_turns_expired": NIXL_NUM_KV_TURNS_EXPIRED,
    "num_kv_leases_released_early": KV_LEASES_RELEASED_EARLY,
    "num_pulls_given_up": NIXL_NUM_PULLS_GIVEN_UP,
}
_CONNECTOR_COUNTER_DOCS = {
    NIXL_NUM_FAILED_TRANSFERS: "KV transfers that failed.",
    NIXL_NUM_PARTIAL_TRANSFERS: ("KV transfers that read only the leading blocks the owner still "
                                 "held (a decoder's restored turn); the rest was computed. Not "
                                 "failures."),
    NIXL_NUM_FAILED_NOTIFICATIONS: "Transfer-done notifications that could not be sent.",
    NIXL_NUM_KV_EXPIRED_REQS: "Requests whose KV lease expired before the remote read.",
    NIXL_NUM_KV_TURNS_EXPIRED: ("Multi-turn decoder blocks freed by their TTL without a pull "
                                "(also counted in nixl_num_kv_expired_reqs; expected traffic)."),
    KV_LEASES_RELEASED_EARLY: ("Prefill leases released at once because their decode leg will "
                               "not read them (D refused or unreachable, client gone)."),
    NIXL_NUM_PULLS_GIVEN_UP: ("Pulls of a decoder's turn given up because its lease claim was "
                              "not answered within the time computing those tokens takes; "
                              "the tokens were computed. Not failures."),
}


def _field(stats: Any, name: str) -> Any:
    """Reads ``name`` from an EngineStats object or a dict; None when absent."""
    if isinstance(stats, Mapping):
        return stats.get(name)
    return getattr(stats, name, None)


class EngineStatsCollector:
    """Custom collector that turns ``engine.stats()`` into gauges and counters at scrape time.

    Fields missing from the stats object are not exposed (no invented zeros). With data
    parallelism (``per_rank`` of the stats not empty) each engine metric has one sample per
    rank, labelled ``dp_rank``; with one engine core the samples have no label.
    """

    def __init__(self, stats_fn: Callable[[], Any]):
        self._stats_fn = stats_fn

    def describe(self) -> Iterable[Metric]:
        return []  # collected lazily; avoids calling the engine at registration time

    def collect(self) -> Iterable[Metric]:
        try:
            stats = self._stats_fn()
        except Exception:  # noqa: BLE001 - a dead engine must not break the scrape
            logger.warning("engine.stats() failed; engine metrics omitted", exc_info=True)
            return
        ranks = _field(stats, "per_rank") or ()
        for m in ENGINE_METRICS:
            cls = GaugeMetricFamily if m.kind == "gauge" else CounterMetricFamily
            if ranks:  # data parallelism: one sample per rank, labelled dp_rank
                family = cls(m.family, m.doc, labels=[DP_RANK_LABEL])
                for rank, rank_stats in enumerate(ranks):
                    value = _engine_value(rank_stats, m)
                    if value is not None:
                        family.add_metric([str(rank)], value)
                if family.samples:
                    yield family
                continue
            value = _engine_value(stats, m)
            if value is not None:
                yield cls(m.family, m.doc, value=value)


def _engine_value(stats: Any, m: _EngineMetric) -> float | None:
    """The value of engine metric ``m`` in one stats snapshot, or None when absent."""
    value = _field(stats, m.attr)
    if value is None:
        return None
    return float(value + sum(_field(stats, a) or 0 for a in m.extra))


class TransferPathCollector:
    """The path that carries KV reads from each peer engine (connector stats key
    ``transfer_paths``, see kv_transfer/nixl/transfer_path.py), rendered at scrape time:
    ``pdserve:kv_transfer_path_info{peer_engine_id, transport, mem} 1`` and, once a read of at
    least 16 MiB was measured, ``pdserve:kv_transfer_read_gbps{peer_engine_id, transport}``.
    Nothing is rendered before the first handshake."""

    def __init__(self) -> None:
        self._peers: dict[str, tuple[str, str, float | None]] = {}
        self._lock = threading.Lock()

    def update(self, paths: Mapping[str, Any]) -> None:
        """``{peer: {"transport": str, "mem": str, "read_gbps": float | None}}``; a peer's new
        entry replaces its old one. May be called from any thread."""
        with self._lock:
            for peer, entry in paths.items():
                if not isinstance(entry, Mapping):
                    continue
                gbps = entry.get("read_gbps")
                ok = isinstance(gbps, (int, float)) and math.isfinite(gbps)
                self._peers[str(peer)] = (str(entry.get("transport")), str(entry.get("mem")),
                                          float(gbps) if ok else None)

    def describe(self) -> Iterable[Metric]:
        return []

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            peers = dict(self._peers)
        if not peers:
            return
        info = GaugeMetricFamily(KV_TRANSFER_PATH_INFO,
                                 "1 for the path that carries KV reads from a peer engine "
                                 "(transport cuda_ipc or nixl; mem source->destination).",
                                 labels=["peer_engine_id", "transport", "mem"])
        gbps = GaugeMetricFamily(KV_TRANSFER_READ_GBPS,
                                 "Bandwidth of the first KV read of at least 16 MiB from a "
                                 "peer engine (GB/s).", labels=["peer_engine_id", "transport"])
        for peer, (transport, mem, rate) in sorted(peers.items()):
            info.add_metric([peer, transport, mem], 1.0)
            if rate is not None:
                gbps.add_metric([peer, transport], rate)
        yield info
        if gbps.samples:
            yield gbps


class ServerMetrics:
    """All Prometheus metrics of one API server instance.

    Args:
        engine: the engine; ``engine.stats()`` is read at scrape time and, when the engine has
            ``add_stats_listener``, connector deltas are subscribed to.
    """

    def __init__(self, engine: Any):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(EngineStatsCollector(engine.stats))
        self.registry.register(KVTierCollector(engine.stats))
        self.ttft = Histogram(
            TIME_TO_FIRST_TOKEN_SECONDS,
            "Time from request arrival at the server to its first generated token (s).",
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.tpot = Histogram(
            TIME_PER_OUTPUT_TOKEN_SECONDS,
            "Mean time per output token after the first, per request (s).",
            buckets=TPOT_BUCKETS_S, registry=self.registry,
        )
        self.request_success = Counter(
            REQUEST_SUCCESS_TOTAL,
            "Finished requests by finish_reason (stop, length, abort), counted by the front end.",
            labelnames=["finish_reason"], registry=self.registry,
        )
        for reason in SUCCESS_FINISH_REASONS:
            self.request_success.labels(reason)
        self.e2e = Histogram(
            E2E_REQUEST_LATENCY_SECONDS,
            "Time from request arrival at the server to its last token (s).",
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self._connector_hist = {
            NIXL_XFER_TIME_SECONDS: Histogram(
                NIXL_XFER_TIME_SECONDS, "KV transfer time, post to completion (s).",
                buckets=XFER_TIME_BUCKETS_S, registry=self.registry),
            NIXL_POST_TIME_SECONDS: Histogram(
                NIXL_POST_TIME_SECONDS, "Time to post one KV transfer (s).",
                buckets=XFER_TIME_BUCKETS_S, registry=self.registry),
            NIXL_BYTES_TRANSFERRED: Histogram(
                NIXL_BYTES_TRANSFERRED, "Bytes moved per KV transfer.",
                buckets=BYTES_BUCKETS, registry=self.registry),
            NIXL_NUM_DESCRIPTORS: Histogram(
                NIXL_NUM_DESCRIPTORS, "Descriptors per KV transfer.",
                buckets=DESCRIPTOR_BUCKETS, registry=self.registry),
            KV_HANDOFF_SECONDS: Histogram(
                KV_HANDOFF_SECONDS, "P/D hand-off on the prefiller: from holding a prompt's "
                "KV to the decoder's read done (s).",
                buckets=XFER_TIME_BUCKETS_S, registry=self.registry),
        }
        self._connector_counts = {name: 0 for name in CONNECTOR_COUNTER_KEYS.values()}
        self.transfer_paths = TransferPathCollector()
        self.registry.register(self.transfer_paths)
        self._lock = threading.Lock()
        add_listener = getattr(engine, "add_stats_listener", None)
        if add_listener is not None:
            add_listener(self.on_connector_stats)

    # ---- front-end observations ---------------------------------------------------------------
    def observe_first_token(self, ttft_s: float) -> None:
        """Records a time to first token, in seconds."""
        self.ttft.observe(ttft_s)

    def count_finished(self, finish_reason: str | None) -> None:
        """Counts one finished engine request; ``error`` (and None) are not counted."""
        if finish_reason in SUCCESS_FINISH_REASONS:
            self.request_success.labels(finish_reason).inc()

    def observe_finished(self, e2e_s: float, ttft_s: float | None, num_output_tokens: int) -> None:
        """Records a finished request: end-to-end latency and, with two or more output tokens,
        its mean TPOT = (e2e - ttft) / (num_output_tokens - 1), in seconds."""
        self.e2e.observe(e2e_s)
        if ttft_s is not None and num_output_tokens > 1:
            self.tpot.observe(max(0.0, e2e_s - ttft_s) / (num_output_tokens - 1))

    # ---- connector ----------------------------------------------------------------------------
    def on_connector_stats(self, delta: Mapping[str, Any]) -> None:
        """Adds one connector delta dict.

        Keys (all optional): ``xfer_time_s``, ``post_time_s``, ``handoff_s`` (lists of
        seconds), ``bytes``,
        ``num_descriptors`` (lists of ints), ``num_failed_transfers``, ``num_partial_transfers``,
        ``num_failed_notifications``, ``num_kv_expired_reqs``, ``num_kv_turns_expired``,
        ``num_kv_leases_released_early``, ``num_pulls_given_up`` (ints, increments),
        ``transfer_paths`` (each peer's read path, see
        :meth:`~pdserve.kv_transfer.nixl.transfer_path.TransferPaths.take_delta`). Unknown keys
        are ignored. May be called from any thread.
        """
        for key, name in CONNECTOR_HISTOGRAM_KEYS.items():
            hist = self._connector_hist[name]
            for v in delta.get(key) or ():
                if v is not None and math.isfinite(float(v)):
                    hist.observe(float(v))
        with self._lock:
            for key, name in CONNECTOR_COUNTER_KEYS.items():
                inc = delta.get(key)
                if inc:
                    self._connector_counts[name] += int(inc)
        paths = delta.get("transfer_paths")
        if isinstance(paths, Mapping):
            self.transfer_paths.update(paths)

    def connector_counts(self) -> dict[str, int]:
        """Cumulative connector counters, by exposed name."""
        with self._lock:
            return dict(self._connector_counts)

    # ---- exposition ---------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """Text exposition (format 0.0.4) of every metric, and its content type.

        The connector counters are written by hand so that their exposed names are exactly the
        ``pdserve:nixl_num_*`` names (``prometheus_client`` would append ``_total``).
        """
        lines = []
        for name, value in self.connector_counts().items():
            lines.append(f"# HELP {name} {_CONNECTOR_COUNTER_DOCS[name]}\n")
            lines.append(f"# TYPE {name} counter\n")
            lines.append(f"{name} {float(value)!r}\n")
        return generate_latest(self.registry) + "".join(lines).encode(), CONTENT_TYPE_LATEST
