"""Multi-turn TTFT through a P/D deployment: bidirectional KV transfer against full recompute.

Runs the same ``pdserve bench multi-turn`` workload twice, in one invocation, against two fresh
``pdserve up`` deployments of the same model:

* ``recompute``: ``pdserve up`` (stateless proxy, ``bidirectional_kv_xfer`` off), so P prefills
  the whole history on every turn (only P's own prefix cache helps);
* ``bidirectional``: ``pdserve up --multi-turn``, so P pulls the earlier turns' KV back from D
  and prefills only the new tokens.

For each it prints the TTFT of turn 1 and of turns 2+ (mean and p90, milliseconds) and what P's
Prometheus counters say it did (prompt tokens computed, cached, transferred), then the ratio of
the turns-2+ mean TTFTs. Both runs use ``--send-conversation-id`` so that the only difference is
the deployment.

Examples::

    python benchmarks/pd_multi_turn.py                               # CPU, embedded SmolLM2
    python benchmarks/pd_multi_turn.py --model /path/llama8b-dummy --device cuda \\
        --engine-args="--load-format dummy --max-model-len 16384" --spec long_histories.json

Raises:
    SystemExit: a deployment failed to start or the benchmark failed (its output is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

_COUNTERS = (
    "pdserve:prompt_tokens_total",
    "pdserve:prompt_tokens_computed_total",
    "pdserve:prompt_tokens_cached_total",
    "pdserve:prompt_tokens_transferred_total",
)


def _read_counters(url: str) -> dict[str, float]:
    """Sum of each counter in ``_COUNTERS`` on one engine's ``/metrics``."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {name: 0.0 for name in _COUNTERS}
    for line in text.splitlines():
        m = re.match(r"^(pdserve:[a-z_]+)(?:\{[^}]*\})? ([0-9.eE+-]+)$", line)
        if m and m.group(1) in out:
            out[m.group(1)] += float(m.group(2))
    return out


def _start_up(args: argparse.Namespace, multi_turn: bool, log_dir: Path,
              output: Path | None = None) -> tuple[subprocess.Popen, dict]:
    """Start ``pdserve up`` and wait until its status file says ready (its own output goes to
    ``output`` when given, else nowhere).

    Returns:
        The launcher process and its parsed ``pdserve-up.json`` status.
    """
    cmd = [sys.executable, "-m", "pdserve.cli", "up", args.model, "--port", "0",
           "--log-dir", str(log_dir), "--device", args.device]
    if multi_turn:
        cmd.append("--multi-turn")
    if args.engine_args:
        cmd += ["--", *shlex.split(args.engine_args)]
    sink = open(output, "ab") if output is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    finally:
        if output is not None:
            sink.close()
    status_file = log_dir / "pdserve-up.json"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve up exited with {proc.returncode}; logs in {log_dir}")
        if status_file.exists():
            try:
                status = json.loads(status_file.read_text())
            except json.JSONDecodeError:
                status = {}
            if status.get("state") == "ready":
                return proc, status
        time.sleep(0.5)
    _stop(proc)
    raise SystemExit(f"pdserve up not ready after {args.startup_timeout} s; logs in {log_dir}")


def _stop(proc: subprocess.Popen) -> None:
    """Stop the launcher as Ctrl-C would (it stops its children) and wait."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _run_case(args: argparse.Namespace, name: str, multi_turn: bool, work: Path) -> dict:
    """One deployment + one benchmark run; returns the summary and P's counter deltas."""
    log_dir = work / name
    log_dir.mkdir()
    proc, status = _start_up(args, multi_turn, log_dir)
    try:
        parts = status["children"]
        proxy = next(p["url"] for p in parts if p["role"] == "proxy")
        prefillers = [p["url"] for p in parts if p["role"] == "prefill"]
        before = [_read_counters(u) for u in prefillers]
        stats_path = log_dir / "stats.json"
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "multi-turn", "-u", proxy,
               "-i", args.spec, "-m", args.tokenizer or args.model, "--seed", str(args.seed),
               "-p", str(args.num_clients), "--send-conversation-id", "--no-progress",
               "--stats-json-output", str(stats_path), *shlex.split(args.bench_args)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode not in (0, 1) or not stats_path.exists():
            raise SystemExit(f"benchmark failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        after = [_read_counters(u) for u in prefillers]
    finally:
        _stop(proc)
    summary = json.loads(stats_path.read_text())["summary"]
    p_delta = {k: sum(a[k] - b[k] for a, b in zip(after, before)) for k in _COUNTERS}
    return {"summary": summary, "prefill_counters": p_delta}


def _ttft(summary: dict, section: str) -> tuple[float | None, float | None, int]:
    s = summary["sections"].get(section, {}).get("ttft_ms", {})
    return s.get("mean"), s.get("p90"), s.get("count", 0)


def main(argv: list[str] | None = None) -> int:
    """Run both cases and print the comparison; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for the benchmark (default: model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--spec", default=str(Path(__file__).with_name("pd_multi_turn_spec.json")),
                    help="pdserve bench multi-turn input file")
    ap.add_argument("--engine-args", default="", help="extra 'pdserve serve' options")
    ap.add_argument("--bench-args", default="", help="extra 'pdserve bench multi-turn' options")
    ap.add_argument("--num-clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    results = {}
    with tempfile.TemporaryDirectory(prefix="pd-multi-turn-") as tmp:
        for name, multi_turn in (("recompute", False), ("bidirectional", True)):
            results[name] = _run_case(args, name, multi_turn, Path(tmp))

    print(f"model {args.model}, device {args.device}, spec {os.path.basename(args.spec)}, "
          f"{args.num_clients} clients")
    header = (f"{'case':<14} {'turn1 mean':>11} {'turn1 p90':>10} {'2+ mean':>9} {'2+ p90':>9} "
              f"{'2+ n':>5} {'failed':>6} {'P computed':>11} {'P cached':>9} {'P pulled':>9}")
    print(header)
    for name, r in results.items():
        t1m, t1p, _ = _ttft(r["summary"], "turn 1")
        tm, tp, n = _ttft(r["summary"], "turns 2+")
        c = r["prefill_counters"]
        fmt = lambda v: f"{v:.1f}" if v is not None else "-"  # noqa: E731
        print(f"{name:<14} {fmt(t1m):>11} {fmt(t1p):>10} {fmt(tm):>9} {fmt(tp):>9} {n:>5} "
              f"{r['summary']['num_failed']:>6} "
              f"{c['pdserve:prompt_tokens_computed_total']:>11.0f} "
              f"{c['pdserve:prompt_tokens_cached_total']:>9.0f} "
              f"{c['pdserve:prompt_tokens_transferred_total']:>9.0f}")
    base, bidi = (_ttft(results[k]["summary"], "turns 2+")[0] for k in ("recompute", "bidirectional"))
    if base and bidi:
        print(f"turns 2+ mean TTFT: recompute / bidirectional = {base / bidi:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
