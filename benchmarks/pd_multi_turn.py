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

``--kv-tiers`` measures the host-memory KV cache tier instead (:mod:`pd_multi_turn_tiers`):
two ``pdserve up --multi-turn`` deployments whose P and D have a small device KV cache
(``--overcommit``), without and with ``--kv-offloading-size``, on a generated workload of many
interleaved conversations; it prints turns 1 and 2+ TTFT p50 / p90, throughput, P's prompt
token counters, the tier counters of P and D and D's demoted / restored turns, then the
turns-2+ ratios. Its default model is a tiny random Llama (2 layers; SmolLM2's tokenizer).

Examples::

    python benchmarks/pd_multi_turn.py                               # CPU, embedded SmolLM2
    python benchmarks/pd_multi_turn.py --model /path/llama8b-dummy --device cuda \\
        --engine-args="--load-format dummy --max-model-len 16384" --spec long_histories.json
    python benchmarks/pd_multi_turn.py --kv-tiers --device cpu       # host tier, 1.75x overcommit
    python benchmarks/pd_multi_turn.py --kv-tiers --device cpu --overcommit 0.7   # it fits
    python benchmarks/pd_multi_turn.py --kv-tiers --device cuda --model /path/llama8b-dummy \\
        --engine-args="--load-format dummy" --conversations 32 --turns 4 --first-tokens 2048 \\
        --user-tokens 256 --output-tokens 64 --num-clients 8

Raises:
    SystemExit: a deployment failed to start or the benchmark failed (its output is shown).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pd_multi_turn_tiers as tiers  # noqa: E402

_COUNTERS = (
    "pdserve:prompt_tokens_total",
    "pdserve:prompt_tokens_computed_total",
    "pdserve:prompt_tokens_cached_total",
    "pdserve:prompt_tokens_transferred_total",
)


def read_counters(url: str) -> dict[str, float]:
    """Sum of each counter in ``_COUNTERS`` on one engine's ``/metrics`` (over its labels)."""
    series = _read_series(url)
    return {name: series.get(name, 0.0) for name in _COUNTERS}


def _read_series(url: str) -> dict[str, float]:
    """Every ``pdserve:`` series on one engine's ``/metrics`` (:func:`tiers.parse_series`)."""
    return tiers.parse_series(httpx.get(f"{url}/metrics", timeout=10).text)


def _start_up(args: argparse.Namespace, multi_turn: bool, log_dir: Path,
              output: Path | None = None,
              extra_engine_args: list[str] | None = None) -> tuple[subprocess.Popen, dict]:
    """Start ``pdserve up`` and wait until its status file says ready (its own output goes to
    ``output`` when given, else nowhere); ``extra_engine_args`` go to every engine before
    ``--engine-args``.

    Returns:
        The launcher process and its parsed ``pdserve-up.json`` status.
    """
    cmd = [sys.executable, "-m", "pdserve.cli", "up", args.model, "--port", "0",
           "--log-dir", str(log_dir), "--device", args.device]
    if multi_turn:
        cmd.append("--multi-turn")
    if args.local_prefill_max_tokens:
        cmd += ["--local-prefill-max-tokens", str(args.local_prefill_max_tokens)]
    if args.cuda_mps:
        cmd.append("--cuda-mps")
    engine_args = [*(extra_engine_args or []), *shlex.split(args.engine_args)]
    if engine_args:
        cmd += ["--", *engine_args]
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


def _run_case(args: argparse.Namespace, name: str, multi_turn: bool, work: Path,
              spec: str | None = None, extra_engine_args: list[str] | None = None,
              extra_bench_args: list[str] | None = None) -> dict:
    """One deployment + one benchmark run (``spec``: the workload, default ``--spec``); returns
    the summary, P's ``_COUNTERS`` deltas and every ``pdserve:`` series' increase on P and on
    D (summed over the engines of each role)."""
    log_dir = work / name
    log_dir.mkdir()
    proc, status = _start_up(args, multi_turn, log_dir, extra_engine_args=extra_engine_args)
    try:
        parts = status["children"]
        proxy = next(p["url"] for p in parts if p["role"] == "proxy")
        engines = {role: [p["url"] for p in parts if p["role"] == role]
                   for role in ("prefill", "decode")}
        engines["proxy"] = [proxy]
        before = {role: [_read_series(u) for u in urls] for role, urls in engines.items()}
        stats_path = log_dir / "stats.json"
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "multi-turn", "-u", proxy,
               "-i", spec or args.spec, "-m", args.tokenizer or args.model,
               "--seed", str(args.seed), "-p", str(args.num_clients), "--send-conversation-id",
               "--no-progress", "--stats-json-output", str(stats_path),
               *(extra_bench_args or []), *shlex.split(args.bench_args)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode not in (0, 1) or not stats_path.exists():
            raise SystemExit(f"benchmark failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        after = {role: [_read_series(u) for u in urls] for role, urls in engines.items()}
    finally:
        _stop(proc)
    summary = json.loads(stats_path.read_text())["summary"]
    series = {role: tiers.delta(after[role], before[role],
                                set().union(*after[role], *before[role]))
              for role in engines}
    p_delta = {k: series["prefill"].get(k, 0.0) for k in _COUNTERS}
    return {"summary": summary, "prefill_counters": p_delta, "series": series}


def _run_tiers(args: argparse.Namespace, work: Path) -> dict:
    """The ``--kv-tiers`` comparison: the deployments, results keyed ``no tier`` /
    ``host tier`` (``no tier, depth-first`` and ``host tier, depth-first`` with
    ``--depth-first-run``, ``device cache`` with ``--device-cache-run``; each: ``ttft`` figures,
    ``prefill`` and ``decode`` series increases)."""
    from pdserve.model_files.builtin_models import resolve_model_path

    if args.model is None:
        from pdserve.testing.tiny_models import make_tiny_model

        args.model = str(make_tiny_model(
            work / "tiny-llama", "llama",
            max_position_embeddings=max(1024, tiers.plan(args)["max_model_len"])))
    spec = work / "workload.json"
    spec.write_text(json.dumps(tiers.spec(args)))
    p = tiers.plan(args)
    gib = tiers.offload_gib(args, resolve_model_path(args.model))
    print(f"workload: {args.conversations} conversations x {args.turns} turns ({args.first_tokens} "
          f"+ {args.turns - 1} x {args.user_tokens} user tokens, {args.output_tokens}-token "
          f"answers), {args.num_clients} in flight; total KV ~{p['total_tokens']} tokens = "
          f"{args.overcommit:g}x a device cache of {p['num_blocks']} blocks x {args.block_size} "
          f"on P and on D; host tier {gib:.3f} GiB each; D's cache "
          f"{'holds' if p['fits'] else 'cannot hold'} every conversation's last turn",
          flush=True)
    results = {}
    if args.device_cache_run:
        print(f"device cache: {p['device_cache_blocks']} blocks on P and on D (every "
              f"conversation)", flush=True)
    for name, engine_args, device_cache in tiers.cases(args, gib):
        try:
            r = _run_case(args, name.replace(" ", "-").replace(",", ""), True, work,
                          spec=str(spec), extra_engine_args=engine_args,
                          extra_bench_args=tiers.bench_args(args))
        except SystemExit as e:
            if not device_cache:
                raise
            # a cache this large may not fit the GPU beside the weights: keep the comparison
            print(f"device cache deployment failed, left out: {str(e)[-2000:]}", flush=True)
            continue
        results[name] = {"ttft": tiers.ttft_percentiles(r["summary"]),
                         "prefill": r["series"]["prefill"], "decode": r["series"]["decode"],
                         "proxy": r["series"]["proxy"], "summary": r["summary"]}
    return results


@contextlib.contextmanager
def _work_dir(path: Path | None, prefix: str) -> Iterator[Path]:
    """``path`` (created; kept), else a temporary directory removed on exit."""
    if path is not None:
        path.mkdir(parents=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def _ttft(summary: dict, section: str) -> tuple[float | None, float | None, int]:
    s = summary["sections"].get(section, {}).get("ttft_ms", {})
    return s.get("mean"), s.get("p90"), s.get("count", 0)


def main(argv: list[str] | None = None) -> int:
    """Run both cases and print the comparison; returns the exit code."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model (default: smollm2-135m-instruct; with --kv-tiers a tiny random "
                         "Llama)")
    ap.add_argument("--tokenizer", default=None, help="tokenizer for the benchmark (default: model)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--spec", default=str(Path(__file__).with_name("pd_multi_turn_spec.json")),
                    help="pdserve bench multi-turn input file")
    ap.add_argument("--engine-args", default="", help="extra 'pdserve serve' options")
    ap.add_argument("--bench-args", default="", help="extra 'pdserve bench multi-turn' options")
    ap.add_argument("--num-clients", type=int, default=None,
                    help="concurrent clients (requests in flight), default 2 (--kv-tiers: 4)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--local-prefill-max-tokens", type=int, default=0, metavar="N",
                    help="'pdserve up --local-prefill-max-tokens N' in every deployment: a "
                         "decoder that holds all but N prompt tokens of a request prefills it "
                         "itself (default 0: every request through a prefiller)")
    ap.add_argument("--cuda-mps", action="store_true",
                    help="'pdserve up --cuda-mps' in every deployment: P and D sharing a GPU "
                         "run their kernels concurrently under an MPS daemon of their own")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="keep the deployments' logs in this new directory (default: a "
                         "temporary one, removed at the end)")
    tiers.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.local_prefill_max_tokens < 0:
        ap.error("--local-prefill-max-tokens must be >= 0")
    if args.num_clients is None:
        args.num_clients = 4 if args.kv_tiers else 2
    if args.kv_tiers:
        error = tiers.check(args)
        if error:
            ap.error(error)
        with _work_dir(args.work_dir, "pd-multi-turn-tiers-") as work:
            results = _run_tiers(args, work)
        print(f"model {args.model}, device {args.device}, {args.num_clients} clients, "
              f"overcommit {args.overcommit:g}{', CUDA MPS' if args.cuda_mps else ''}")
        print("\n".join(tiers.report(results)))
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=2))
        return 0
    if args.model is None:
        args.model = "smollm2-135m-instruct"

    results = {}
    with _work_dir(args.work_dir, "pd-multi-turn-") as work:
        for name, multi_turn in (("recompute", False), ("bidirectional", True)):
            results[name] = _run_case(args, name, multi_turn, work)

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
