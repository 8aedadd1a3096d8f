"""Per-request records of a benchmark run and the statistics computed from them.

Metrics (per request):

* ``ttft_ms``: time to first token, from sending the request to the first chunk carrying text.
* ``tpot_ms``: time per output token after the first, ``(latency - ttft) / (output_tokens - 1)``;
  counted in tokens, not chunks (a chunk may hold several tokens).
* ``latency_ms``: from sending the request to the end of the answer.
* ``input_num_tokens`` / ``output_num_tokens``: the server's ``usage`` counts when it sends them,
  otherwise counted with the benchmark's tokenizer.
* ``cached_num_tokens``: ``usage.prompt_tokens_details.cached_tokens`` when the server reports it.

Percentiles use numpy's default linear interpolation; ``std`` is the population standard deviation.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterable

import numpy as np

TABLE_METRICS = ("ttft_ms", "tpot_ms", "latency_ms", "input_num_tokens", "output_num_tokens")
OPTIONAL_METRICS = ("cached_num_tokens",)
STAT_COLUMNS = ("count", "mean", "std", "min", "p50", "p90", "p99", "max")
SECTIONS = ("turn 1", "turns 2+")


@dataclass
class RequestRecord:
    """One request of the run, successful or not.

    Attributes:
        conversation_id: id of the conversation in the input.
        turn: 1-based number of the user turn within its conversation.
        client: index of the client that sent it.
        start_s: seconds from the start of the run (or of the warmup) to sending.
        ok: whether the server answered completely.
        error: one-line failure description when not ok.
        ttft_ms, tpot_ms, latency_ms: timings in milliseconds (None when not measurable).
        input_num_tokens, output_num_tokens, cached_num_tokens: token counts.
        num_chunks: stream chunks that carried text.
        max_tokens: the ``max_tokens`` sent (None when not sent).
        usage_from_server: whether the token counts come from the server's ``usage``.
    """

    conversation_id: str
    turn: int
    client: int
    start_s: float
    ok: bool
    error: str | None
    ttft_ms: float | None
    tpot_ms: float | None
    latency_ms: float
    input_num_tokens: int | None
    output_num_tokens: int | None
    cached_num_tokens: int | None
    num_chunks: int
    max_tokens: int | None
    usage_from_server: bool

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def describe(values: Iterable[float | int | None]) -> dict[str, float | int | None]:
    """count/mean/std/min/p50/p90/p99/max of the non-None ``values`` (None entries when empty)."""
    arr = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if arr.size == 0:
        return {name: (0 if name == "count" else None) for name in STAT_COLUMNS}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        "count": int(arr.size),
        "mean": float(arr.mean()),
        "std": float(arr.std()),
        "min": float(arr.min()),
        "p50": float(p50),
        "p90": float(p90),
        "p99": float(p99),
        "max": float(arr.max()),
    }


def _metrics_for(records: list[RequestRecord]) -> tuple[str, ...]:
    extra = tuple(m for m in OPTIONAL_METRICS if any(getattr(r, m) is not None for r in records))
    return TABLE_METRICS + extra


def summarize(records: list[RequestRecord], runtime_s: float) -> dict[str, Any]:
    """Statistics of a run.

    Args:
        records: every measured request (failed ones included; their timings are not used).
        runtime_s: wall time of the measured run in seconds (throughput denominators).

    Returns:
        A JSON-ready dict: ``runtime_sec``, ``num_requests``, ``num_successful``, ``num_failed``,
        ``requests_per_sec`` and ``output_tokens_per_sec`` (successful requests only),
        ``sections`` ({"turn 1"|"turns 2+"|"all turns": {metric: describe(...)}}), ``per_turn``
        (list of {"turn", "count", "<metric>_mean", "<metric>_p90"}), ``errors`` (list of
        {"error", "count"}, most frequent first).
    """
    ok = [r for r in records if r.ok]
    metrics = _metrics_for(ok)
    groups = {
        "turn 1": [r for r in ok if r.turn == 1],
        "turns 2+": [r for r in ok if r.turn >= 2],
        "all turns": ok,
    }
    sections = {
        name: {m: describe(getattr(r, m) for r in group) for m in metrics}
        for name, group in groups.items()
    }
    per_turn = []
    for turn in sorted({r.turn for r in ok}):
        group = [r for r in ok if r.turn == turn]
        entry: dict[str, Any] = {"turn": turn, "count": len(group)}
        for m in metrics:
            d = describe(getattr(r, m) for r in group)
            entry[f"{m}_mean"] = d["mean"]
            entry[f"{m}_p90"] = d["p90"]
        per_turn.append(entry)
    output_tokens = sum(r.output_num_tokens or 0 for r in ok)
    errors = Counter(r.error or "unknown error" for r in records if not r.ok)
    return {
        "runtime_sec": runtime_s,
        "num_requests": len(records),
        "num_successful": len(ok),
        "num_failed": len(records) - len(ok),
        "requests_per_sec": len(ok) / runtime_s if runtime_s > 0 else None,
        "output_tokens_per_sec": output_tokens / runtime_s if runtime_s > 0 else None,
        "total_output_tokens": output_tokens,
        "sections": sections,
        "per_turn": per_turn,
        "errors": [{"error": e, "count": n} for e, n in errors.most_common()],
    }


def _fmt(value: float | int | None, column: str) -> str:
    if value is None:
        return "-"
    if column == "count":
        return str(int(value))
    return f"{value:.2f}"


def format_summary(summary: dict[str, Any], warmup: dict[str, Any] | None = None) -> str:
    """Render :func:`summarize`'s result as the text table printed at the end of a run."""
    width = 100
    rule = "-" * width
    lines = ["=" * width]
    lines.append(
        f"Multi-turn benchmark: {summary['num_requests']} requests "
        f"({summary['num_successful']} successful, {summary['num_failed']} failed) "
        f"in {summary['runtime_sec']:.3f} s"
    )
    if warmup is not None:
        lines.append(
            f"warmup (not included below): {warmup['num_requests']} requests, "
            f"{warmup['num_failed']} failed, {warmup['runtime_sec']:.3f} s"
        )
    rps, tps = summary["requests_per_sec"], summary["output_tokens_per_sec"]
    lines.append(
        f"requests_per_sec = {_fmt(rps, 'mean')}    output_tokens_per_sec = {_fmt(tps, 'mean')}"
    )
    header_cols = "".join(f"{c:>11}" for c in STAT_COLUMNS)
    for section in SECTIONS:
        lines.append(rule)
        lines.append(f"{section:<20}{header_cols}")
        for metric, stats in summary["sections"][section].items():
            cells = "".join(f"{_fmt(stats[c], c):>11}" for c in STAT_COLUMNS)
            lines.append(f"{metric:<20}{cells}")
    lines.append(rule)
    lines.append(f"failed requests: {summary['num_failed']}")
    for item in summary["errors"]:
        lines.append(f"  {item['count']:>5} x {item['error']}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_ttft_comparison(runs: list[tuple[str, list[dict[str, Any]]]]) -> str:
    """Per-turn TTFT (mean / p90, ms) of several runs side by side.

    Args:
        runs: (label, per_turn) pairs; ``per_turn`` as in :func:`summarize`.
    """
    turns = sorted({entry["turn"] for _, per_turn in runs for entry in per_turn})
    col = 26
    lines = ["TTFT by turn, mean / p90 (ms)"]
    lines.append(f"{'turn':>6}" + "".join(f"{label[:col - 2]:>{col}}" for label, _ in runs))
    for turn in turns:
        cells = []
        for _, per_turn in runs:
            entry = next((e for e in per_turn if e["turn"] == turn), None)
            if entry is None or entry.get("ttft_ms_mean") is None:
                cells.append(f"{'-':>{col}}")
            else:
                text = f"{entry['ttft_ms_mean']:.2f} / {_fmt(entry.get('ttft_ms_p90'), 'p90')}"
                cells.append(f"{text:>{col}}")
        lines.append(f"{turn:>6}" + "".join(cells))
    return "\n".join(lines)
