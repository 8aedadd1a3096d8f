"""Prometheus metrics of the proxy, in a registry of their own (served at ``GET /metrics``).

Names (kept here until the project-wide ``pdserve/entrypoints/metrics.py`` takes them over):

* ``pdserve:proxy_requests_total{endpoint, status}``: generation requests answered, by endpoint
  (``completions`` / ``chat_completions``) and HTTP status (``499`` = client went away; a
  stream that ends with an error event: that error's status).
* ``pdserve:proxy_errors_total{upstream, leg}``: upstream failures (unreachable, timeout,
  connection lost, invalid response, HTTP 5xx), by instance URL and leg. Client errors (4xx) that
  an instance reports are not counted: they are the client's.
* ``pdserve:proxy_added_latency_seconds``: time the proxy itself adds before the first byte of
  the answer leaves it: wall time from receiving the request to sending the first response byte,
  minus the time spent waiting on the prefill leg and on the decode leg's response headers
  (non-streaming: its whole body).
* ``pdserve:proxy_in_flight_requests{upstream, leg}``: requests this proxy has open per instance.
* ``pdserve:proxy_conversations``: remembered multi-turn conversations (in-process store).
* ``pdserve:proxy_routing_decisions_total{leg, reason}``: routing decisions per leg, by
  :class:`pdserve.router.kv_routing.RoutingReason` value.
* ``pdserve:proxy_routing_cache_hit_blocks{leg}``: kv-aware: prompt blocks already cached on the
  chosen instance, per decision.
* ``pdserve:proxy_kv_params_forwarded_total``: multi-turn turns whose prefill leg carried the
  decoder's ``kv_transfer_params`` of the previous turn (P may pull the history from D).
* ``pdserve:proxy_state_store_errors_total{op}``: state store operations (``load`` /
  ``record``) that failed or were skipped after a failure; those turns were served as recompute.
* ``pdserve:proxy_kv_leases_released_total{outcome}``: leases the proxy asked an instance to free
  early: P's when the decode leg will not read them, and in multi-turn mode D's for a request
  without a conversation (``released``, ``not_held``, ``failed``).
* ``pdserve:proxy_migrations_total{reason}``: streamed decode legs moved to another P/D pair
  after failing mid-stream (``connection``, ``eof``, ``upstream_error``, ``stall``;
  :mod:`pdserve.router.migration`).
* ``pdserve:proxy_prefills_skipped_total``: requests answered 503 before the prefill leg because
  no decode instance was reachable.
* ``pdserve:proxy_retries_total{leg}``: legs sent again after an instance failed before the
  first token (``--max-retries``); a decode-leg retry that needs a new prefill counts once, on
  the decode leg.
* ``pdserve:proxy_decode_only_fallback_total``: requests a decoder served alone (it prefilled
  them itself) because no prefill instance was available.
* ``pdserve:proxy_local_prefills_total``: requests a decoder prefilled itself because it held
  all but at most ``--local-prefill-max-tokens`` of their prompt tokens
  (:mod:`pdserve.router.local_prefill`).
* ``pdserve:proxy_upstream_healthy{upstream, leg}``: 1 while the instance is in rotation (its
  circuit breaker closed or half-open), 0 while it is out (open).
* ``pdserve:proxy_handoff_seconds{leg}``: the P/D hand-off per leg, in seconds: ``prefill``
  from sending the prefill leg to P's whole answer; ``decode`` from sending the decode leg (in
  the concurrent hand-off at the same time as the prefill leg, in the sequential one after P's
  answer) to D's first token at the proxy (a stream's first event with output; a non-streamed
  answer's response, which comes with its whole body). Legs that failed are not observed.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Buckets of the cache-hit-blocks histogram (blocks).
HIT_BLOCKS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
#: Buckets of the added-latency histogram, in seconds (50 µs .. 1 s).
ADDED_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                         0.1, 0.25, 1.0)
#: Buckets of the hand-off histogram, in seconds (0.5 ms .. 60 s).
HANDOFF_BUCKETS = (5e-4, 1e-3, 2e-3, 3e-3, 5e-3, 7.5e-3, 1e-2, 1.5e-2, 2e-2, 3e-2, 5e-2, 7.5e-2,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ProxyMetrics:
    """The proxy's metrics; label children are created up front so the hot path only adds.

    Args:
        prefillers, decoders: base URLs of the instances (label values of ``upstream``).
    """

    def __init__(self, prefillers: tuple[str, ...] | list[str], decoders: tuple[str, ...] | list[str]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("pdserve:proxy_requests", "Generation requests answered by the proxy",
                                ["endpoint", "status"], registry=self.registry)
        self.errors = Counter("pdserve:proxy_errors", "Upstream failures seen by the proxy",
                              ["upstream", "leg"], registry=self.registry)
        self.added_latency = Histogram("pdserve:proxy_added_latency_seconds",
                                       "Latency the proxy adds before the first response byte (s)",
                                       buckets=ADDED_LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("pdserve:proxy_in_flight_requests",
                               "Requests open on each instance through this proxy",
                               ["upstream", "leg"], registry=self.registry)
        self.conversations = Gauge("pdserve:proxy_conversations",
                                   "Remembered multi-turn conversations", registry=self.registry)
        self.routing_decisions = Counter("pdserve:proxy_routing_decisions",
                                         "Routing decisions per leg, by reason",
                                         ["leg", "reason"], registry=self.registry)
        self.cache_hit_blocks = Histogram("pdserve:proxy_routing_cache_hit_blocks",
                                          "kv-aware: prompt blocks cached on the chosen instance",
                                          ["leg"], buckets=HIT_BLOCKS_BUCKETS,
                                          registry=self.registry)
        self.state_store_errors = Counter("pdserve:proxy_state_store_errors",
                                          "State store operations that failed or were skipped",
                                          ["op"], registry=self.registry)
        self.kv_params_forwarded = Counter("pdserve:proxy_kv_params_forwarded",
                                           "Turns whose prefill leg carried D's previous params",
                                           registry=self.registry)
        for op in ("load", "record"):
            self.state_store_errors.labels(op=op)
        self._decision_children: dict[tuple[str, str], Counter] = {}
        self.kv_releases = Counter("pdserve:proxy_kv_leases_released",
                                   "KV leases the proxy asked P (or, multi-turn, D) to free early",
                                   ["outcome"], registry=self.registry)
        self.prefills_skipped = Counter("pdserve:proxy_prefills_skipped",
                                        "Requests refused before prefill: no decoder reachable",
                                        registry=self.registry)
        self.retries = Counter("pdserve:proxy_retries",
                               "Legs sent again after an instance failed before the first token",
                               ["leg"], registry=self.registry)
        self.retries_child = {leg: self.retries.labels(leg=leg) for leg in ("prefill", "decode")}
        self.decode_only_fallback = Counter(
            "pdserve:proxy_decode_only_fallback",
            "Requests a decoder served alone because no prefill instance was available",
            registry=self.registry)
        self.local_prefills = Counter(
            "pdserve:proxy_local_prefills",
            "Requests a decoder prefilled itself: it held all but a few of their prompt tokens",
            registry=self.registry)
        self.upstream_healthy = Gauge("pdserve:proxy_upstream_healthy",
                                      "1 while the instance is in rotation (circuit breaker "
                                      "closed or half-open), 0 while it is out (open)",
                                      ["upstream", "leg"], registry=self.registry)
        self.migrations = Counter("pdserve:proxy_migrations",
                                  "Streamed decode legs moved to another P/D pair mid-stream",
                                  ["reason"], registry=self.registry)
        for reason in ("connection", "eof", "upstream_error", "stall"):
            self.migrations.labels(reason=reason)
        self.handoff = Histogram("pdserve:proxy_handoff_seconds",
                                 "P/D hand-off per leg: prefill = leg sent to P's answer, decode "
                                 "= leg sent to D's first token (s)",
                                 ["leg"], buckets=HANDOFF_BUCKETS, registry=self.registry)
        self.handoff_child = {leg: self.handoff.labels(leg=leg) for leg in ("prefill", "decode")}
        self.in_flight_child = {}
        for leg, urls in (("prefill", prefillers), ("decode", decoders)):
            for url in urls:
                self.in_flight_child[(leg, url)] = self.in_flight.labels(upstream=url, leg=leg)
                self.errors.labels(upstream=url, leg=leg)  # export zeros from the start
        self._request_children: dict[tuple[str, int], Counter] = {}

    def count_request(self, endpoint: str, status: int) -> None:
        """Count one answered generation request."""
        child = self._request_children.get((endpoint, status))
        if child is None:
            child = self.requests.labels(endpoint=endpoint, status=str(status))
            self._request_children[(endpoint, status)] = child
        child.inc()

    def count_decision(self, leg: str, reason: str, hit_blocks: int | None) -> None:
        """Count one routing decision; ``hit_blocks`` (kv-aware only) goes to the histogram."""
        child = self._decision_children.get((leg, reason))
        if child is None:
            child = self.routing_decisions.labels(leg=leg, reason=reason)
            self._decision_children[(leg, reason)] = child
        child.inc()
        if hit_blocks is not None:
            self.cache_hit_blocks.labels(leg=leg).observe(hit_blocks)

    def count_state_store_error(self, op: str) -> None:
        """Count one failed or skipped state store operation."""
        self.state_store_errors.labels(op=op).inc()

    def count_migration(self, reason: str) -> None:
        """Count one mid-stream migration (``reason``: a ``MigrationReason`` value)."""
        self.migrations.labels(reason=reason).inc()

    def count_error(self, upstream: str, leg: str) -> None:
        """Count one upstream failure."""
        self.errors.labels(upstream=upstream, leg=leg).inc()

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` of the text exposition format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
