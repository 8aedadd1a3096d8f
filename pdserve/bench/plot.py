"""TTFT-by-turn chart of one or more benchmark runs (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class StatsFileError(ValueError):
    """A ``--compare`` stats file is unreadable or was not written by this benchmark."""


def load_stats_file(path: str | Path) -> tuple[str, list[dict[str, Any]]]:
    """Read a ``--stats-json-output`` file; return (label, per-turn statistics).

    Raises:
        StatsFileError: unreadable file or no ``summary.per_turn`` list in it.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise StatsFileError(f"cannot read stats file {path}: {exc.strerror or exc}") from exc
    except ValueError as exc:
        raise StatsFileError(f"stats file {path} is not valid JSON: {exc}") from exc
    per_turn = data.get("summary", {}).get("per_turn") if isinstance(data, dict) else None
    if not isinstance(per_turn, list) or not all(
        isinstance(e, dict) and "turn" in e and "ttft_ms_mean" in e for e in per_turn
    ):
        raise StatsFileError(
            f"{path} is not a stats file of 'pdserve bench multi-turn --stats-json-output' "
            "(no summary.per_turn list)"
        )
    return str(data.get("label") or path.stem), per_turn


def plot_ttft_by_turn(runs: list[tuple[str, list[dict[str, Any]]]], path: str | Path) -> None:
    """Write a PNG with TTFT (ms) against turn number: mean (solid) and p90 (dashed) per run.

    Args:
        runs: (label, per_turn) pairs; ``per_turn`` entries need ``turn``, ``ttft_ms_mean`` and
            ``ttft_ms_p90`` (as written by :func:`pdserve.bench.stats.summarize`).
        path: output file; the format follows its extension (PNG for ``.png``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"]
    for i, (label, per_turn) in enumerate(runs):
        points = sorted(
            (e["turn"], e["ttft_ms_mean"], e.get("ttft_ms_p90"))
            for e in per_turn
            if e.get("ttft_ms_mean") is not None
        )
        if not points:
            continue
        color = colors[i % len(colors)]
        turns = [p[0] for p in points]
        ax.plot(turns, [p[1] for p in points], marker="o", color=color, label=f"{label} mean")
        p90 = [(p[0], p[2]) for p in points if p[2] is not None]
        if p90:
            ax.plot([t for t, _ in p90], [v for _, v in p90], linestyle="--", marker=".",
                    color=color, alpha=0.8, label=f"{label} p90")
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title("Time to first token by turn")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.xaxis.get_major_locator().set_params(integer=True)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(str(path))
