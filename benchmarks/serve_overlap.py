"""Online TPOT / TTFT of one ``pdserve serve`` with overlapped scheduling on and off, measured in
the same run by ``pdserve bench multi-turn``.

Starts ``pdserve serve MODEL`` (dummy weights) once per entry of ``--order`` (``sync`` =
``--no-async-scheduling``, ``async`` = ``--async-scheduling``), one after the other on the same
GPU, replays the same generated conversations with ``--clients`` concurrent streams
(``--output-tokens`` per answer, forced by ``min_tokens``), turns 2+ measured, and writes each
run's statistics. Alternate the order (``sync,async,sync,async``): the first server of a run pays
warm-up (Triton compilations of new shapes) inside its measured requests.

Example (one H200, docs/benchmarks.md, "Overlapped scheduling on the H200")::

    python3 benchmarks/make_llama8b_dummy.py --preset qwen3-0.6b /tmp/qwen3-dummy
    python3 benchmarks/serve_overlap.py /tmp/qwen3-dummy --out /tmp/overlap --clients 64
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx


def _serve(model: str, port: int, flag: str, extra: list[str], log: Path) -> subprocess.Popen:
    with open(log, "w") as sink:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(port),
             "--load-format", "dummy", "--dtype", "bfloat16", "--max-model-len", "4096",
             "--gpu-memory-utilization", "0.5", *extra, flag],
            stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)


def _wait_ready(proc: subprocess.Popen, port: int, timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"pdserve serve not ready after {timeout_s:g} s")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model directory (config and tokenizer; weights are dummy)")
    ap.add_argument("--out", required=True, help="folder for the statistics and server logs")
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=200)
    ap.add_argument("--order", default="sync,async,sync,async")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--serve-args", default="", help="more `pdserve serve` options")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import pdserve

    spec = {"filetype": "generate_conversations", "num_conversations": args.clients * 2,
            "text_files": [str(Path(pdserve.__file__).parent / "data" / "public_domain_prose.txt")],
            "prompt_input": {
                "num_turns": {"distribution": "uniform", "min": 4, "max": 6},
                "common_prefix_num_tokens": {"distribution": "constant", "value": 200},
                "prefix_num_tokens": {"distribution": "lognormal", "average": 400, "max": 1500},
                "num_tokens": {"distribution": "uniform", "min": 60, "max": 120}},
            "prompt_output": {"num_tokens": {"distribution": "constant",
                                             "value": args.output_tokens}}}
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    flags = {"sync": "--no-async-scheduling", "async": "--async-scheduling"}
    for i, mode in enumerate(args.order.split(",")):
        label = f"{mode}{i}"
        proc = _serve(args.model, args.port, flags[mode], args.serve_args.split(),
                      out / f"serve_{label}.log")
        try:
            ready = _wait_ready(proc, args.port, 300)
            stats = out / f"bench_{label}.json"
            subprocess.run(
                [sys.executable, "-m", "pdserve.cli", "bench", "multi-turn", "-m", args.model,
                 "-i", str(spec_path), "-u", f"http://127.0.0.1:{args.port}",
                 "-p", str(args.clients), "-n", str(args.clients * 6),
                 "--limit-min-tokens", str(args.output_tokens),
                 "--limit-max-tokens", str(args.output_tokens), "--warmup-step", "--no-progress",
                 "--stats-json-output", str(stats)],
                stdout=subprocess.DEVNULL, timeout=600)  # exits 1 when a request failed
        finally:
            _stop(proc)
        s = json.loads(stats.read_text())["summary"]
        t = s["sections"]["turns 2+"]
        print(f"{label:<8} ready {ready:5.0f} s  {s['num_failed']} failed  "
              f"{s['output_tokens_per_sec']:8.0f} tok/s  TPOT "
              f"p50/p99 {t['tpot_ms']['p50']:.2f}/{t['tpot_ms']['p99']:.2f} ms  TTFT p50/p99 "
              f"{t['ttft_ms']['p50']:.0f}/{t['ttft_ms']['p99']:.0f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
