"""``pdserve bench <benchmark> ...``: dispatch to the benchmark's own parser."""

from __future__ import annotations

import importlib
import sys

_BENCHMARKS = {
    "multi-turn": ("pdserve.bench.multi_turn", "multi-turn chat load: TTFT/TPOT/latency per turn"),
}


def _usage() -> str:
    lines = ["usage: pdserve bench <benchmark> [options]", "", "benchmarks:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in _BENCHMARKS.items()]
    lines += ["", "Run 'pdserve bench <benchmark> --help' for its options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``pdserve bench``; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    name = argv[0]
    if name not in _BENCHMARKS:
        print(f"pdserve bench: unknown benchmark {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_BENCHMARKS[name][0])
    return int(module.main(argv[1:]) or 0)
