"""P/D request latency of two pdserve source trees, measured side by side in one run.

Starts one ``pdserve up`` deployment (prefiller, decoder, proxy) per source tree given with
``--tree`` (each launched with ``PYTHONPATH`` set to that tree, so two commits can be compared
without installing either), then sends the same sequence of non-streaming completion requests
through each proxy, alternating between the deployments request by request (A, B, A, B, ...), so
that machine noise hits both alike. Every request has a new random prompt (no prefix-cache hit)
and goes the full P/D path: P prefills and leases its blocks, D claims the lease, reads the KV
over NIXL and decodes ``--max-tokens`` tokens. The first ``--warmup`` requests of each deployment
pay the handshake and are not counted.

Prints, per tree: requests, p50 / p90 / mean latency in ms, and the p50 difference to the first
tree. ``--json-out`` writes the raw latencies.

Example (the claim answer carrying P's first token, before and after)::

    git worktree add /tmp/before 928e57f~1 && git worktree add /tmp/after 928e57f
    python benchmarks/pd_latency.py --tree /tmp/before --tree /tmp/after \
        --engine-args "--dtype float32 --max-model-len 2048"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", default=[],
                    help="pdserve source tree to measure (repeat; default: this checkout)")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-args", default="--dtype float32 --max-model-len 2048")
    ap.add_argument("--requests", type=int, default=60, help="counted requests per tree")
    ap.add_argument("--warmup", type=int, default=3, help="uncounted first requests per tree")
    ap.add_argument("--prompt-len", type=int, default=200, help="prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args(argv)
    trees = [str(Path(t).resolve()) for t in args.tree] or [str(HERE.parent)]

    import httpx

    sys.path.insert(0, str(HERE))
    from pd_multi_turn import _start_up, _stop

    work = Path(tempfile.mkdtemp(prefix="pd_latency_"))
    procs, proxies = [], []
    old_pp = os.environ.get("PYTHONPATH")
    try:
        for i, tree in enumerate(trees):
            os.environ["PYTHONPATH"] = tree + (os.pathsep + old_pp if old_pp else "")
            log_dir = work / f"tree{i}"
            log_dir.mkdir()
            proc, status = _start_up(args, False, log_dir)
            procs.append(proc)
            proxies.append(next(p["url"] for p in status["children"] if p["role"] == "proxy"))
            print(f"tree {i} ({tree}): ready, proxy {proxies[-1]}", flush=True)
        if old_pp is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_pp
        rng = random.Random(0)
        lat: list[list[float]] = [[] for _ in trees]
        with httpx.Client(timeout=300) as client:
            for n in range(args.warmup + args.requests):
                prompt = [rng.randrange(100, 40000) for _ in range(args.prompt_len)]
                for i, url in enumerate(proxies):
                    t = time.perf_counter()
                    r = client.post(f"{url}/v1/completions", json={
                        "model": args.model, "prompt": prompt, "max_tokens": args.max_tokens,
                        "ignore_eos": True, "temperature": 0})
                    dt = 1e3 * (time.perf_counter() - t)
                    if r.status_code != 200:
                        raise SystemExit(f"tree {i}: HTTP {r.status_code}: {r.text[:300]}")
                    if n >= args.warmup:
                        lat[i].append(dt)
    finally:
        for proc in procs:
            _stop(proc)
    base = statistics.median(lat[0])
    print(f"{'tree':<40} {'n':>4} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8} {'p50 diff':>9}")
    for tree, xs in zip(trees, lat):
        p50 = statistics.median(xs)
        print(f"{tree[-40:]:<40} {len(xs):>4} {p50:8.1f} {_percentile(xs, 0.9):8.1f} "
              f"{statistics.fmean(xs):8.1f} {p50 - base:+9.1f}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"trees": trees, "latency_ms": lat}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
