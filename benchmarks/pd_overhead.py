"""What a P/D hand-off adds to TTFT: one engine against P/D, per hand-off mode, in one run.

Starts, per mode (below), one deployment of fresh processes, all with the phase trace on
(``PDSERVE_PHASE_TRACE``, pdserve/utils/phase_trace.py):

* ``single``: one ``pdserve serve`` (no KV role), the baseline;
* one prefiller P (``pdserve serve``, ``kv_role: kv_producer``) and one decoder D
  (``kv_consumer``), NixlConnector, ``bidirectional_kv_xfer`` in the ``bidi`` mode;
* one ``pdserve proxy`` over that P and D per entry of ``--handoffs``
  (``pdserve proxy --handoff sequential``: P's answer comes back through the proxy before the
  decode leg goes out; ``--handoff concurrent``: both legs at once, docs/proxy.md), targets
  ``pd-sequential`` and ``pd-concurrent``. The proxies are built as ``pdserve up`` builds its
  own (``--migration-limit 3``; ``--multi-turn`` in the ``bidi`` mode). A proxy without the
  ``--handoff`` flag (before the concurrent hand-off existed) is started without it and serves
  ``sequential``; asking it for ``concurrent`` is an error.

Every engine gets the same resources: on CUDA all three share the first visible GPU, each with a
third of ``--gpu-memory-utilization`` (from ``--engine-args``, default 0.9; not with
``--kv-cache-memory``); on CPU each its default KV cache. The processes start in their own
sessions (pdserve.launcher's ``Launcher``, as ``pdserve up`` does) and are all stopped when the
script ends, fails or gets Ctrl-C / SIGTERM.

One client sends one streamed ``/v1/chat/completions`` request at a time, greedy,
``ignore_eos``, ``--output-len`` tokens, the same requests to every target, alternating targets
request by request (the order rotates by one per request, so no target always follows another),
with ``--gap-ms`` between requests. Modes (``--mode first|bidi|both``, default ``both``, each
with a deployment of its own):

* ``first``: first turns of ``--prompt-lens`` tokens (rendered chat prompt, fitted with the
  engine's ``/tokenize``). The system message starts with random words drawn per request *and*
  per target, so no prompt shares a KV block with any earlier one (no prefix-cache hit on any
  engine; the engines' counters printed after the tables show 0 cached tokens); the rest of the
  prompt is the same for all targets.
* ``bidi``: turns 2+ of chats of ``--turns`` turns: turn 1 (not counted) is a ~``--history``
  token prompt, every later turn adds the previous answer and a ~``--turn-len`` token user
  message, with a ``conversation_id``. Through the ``--multi-turn`` proxies P pulls the history's
  KV back from D, prefills the new tokens, and D reads from P only the blocks its own prefix
  cache does not hold (the new ones: the history's blocks, which D kept for P's pull, stay in
  D's cache). P runs with ``--no-enable-prefix-caching`` (unless ``--engine-args`` has
  ``--enable-prefix-caching``) so that it pulls instead of finding the history in its own cache,
  as once other conversations have evicted it; D and ``single`` keep prefix caching on (the
  engine default; ``--engine-args`` may turn it off for every engine), so ``single``'s cache
  hits the history: the same compute (the new tokens) as P/D.

Mode ``load`` (``--mode load``) asks whether P/D keeps throughput and TPOT under concurrent
streams: benchmarks/pd_overhead_load.py says what it does and prints.

TTFT is the time from just before the client sends the request to the stream event that carries
the first generated token, as the client (httpx) sees it. Every request asks for vLLM's
``return_token_ids``, so that a token that decodes to no text yet still comes in a chunk of its
own (its choice's ``token_ids``): with dummy weights most sampled ids decode to nothing (the
dummies' vocabulary is larger than the tokenizer's), and without the ids the "first token" would
be the first one that happens to have text, several decode steps later.

Printed per mode, one row per prompt length (``first``: the length asked for; ``bidi``: ``h`` and
the history) and target:

* ``n``: counted requests; ``tokens``: median prompt tokens (the answering engine's ``usage``);
* ``p50`` / ``p90``: TTFT percentiles, ms (p90: the value at index ``int(0.9 n)`` of the sorted
  samples, as benchmarks/pd_latency.py);
* ``diff p50`` / ``diff p90``: percentiles of the *paired* differences: for request k (same
  prompt shape, sent right after or before ``single``'s request k), ``TTFT(target, k) -
  TTFT(single, k)``; so ``diff p50`` is the median extra latency of a P/D request, not the
  difference of the two medians.

Then, per length and target, the phase breakdown (benchmarks/pd_phases.py's ``timeline``): for
each mark of any process (``role phase``, ``#k`` for a repeat within the request, only marks
seen in at least half of the requests), its median offset from the client's send (ms) and the
step from the row before, in order of the median, down to ``client cl.first`` (the client saw
the first token; its offset is about the median TTFT). The marks are listed in
docs/architecture.md ("Phase trace"); each is an append to a buffer that a thread of each
process writes every 50 ms, in every target alike. Last, the engines' prompt-token counters over the whole mode (warm-up included):
computed, cached (prefix cache) and transferred (pulled over NIXL).

``--out FILE`` writes every raw sample (warm-up and history turns flagged), the rows, the
timelines and the counters as JSON. The deployments' logs and traces stay in ``--work-dir``
(default: a new temporary directory, printed).

CPU (a tiny random 2-layer Llama is made with pdserve/testing/tiny_models.py, with the SmolLM2
tokenizer and enough positions; default lengths 512 and a 2,048-token history; about half a
minute on the 2-core development machine)::

    python benchmarks/pd_overhead.py --device cpu --handoffs sequential,concurrent

CPU, while ``pdserve proxy`` has no ``--handoff`` flag yet: ``--handoffs sequential``.

CPU, mode ``load`` at 8 streams (about 15 s; the defaults, 64 streams and 256 requests per
target and round, about 40 s)::

    python benchmarks/pd_overhead.py --device cpu --mode load --streams 8 --load-requests 16 \\
        --load-rounds 1

CUDA (one GPU, Qwen3-0.6B or 8B-class dummy from ``benchmarks/make_llama8b_dummy.py [--preset
qwen3-0.6b] DIR``; default lengths 256,1024,4096,16384 and a 4,096-token history; a length
that does not fit the model's positions with the output, such as 16,384 in these dummies' 16,384,
is measured as the longest that does, and a note says so)::

    python benchmarks/make_llama8b_dummy.py --preset qwen3-0.6b /tmp/qwen3-0.6b-dummy
    python benchmarks/pd_overhead.py --device cuda --model /tmp/qwen3-0.6b-dummy \\
        --engine-args "--load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.9" \\
        --out pd_overhead.json
    python benchmarks/pd_overhead.py --device cuda --model /tmp/qwen3-0.6b-dummy --mode load \\
        --engine-args "--load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.9" \\
        --out pd_overhead_load.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pd_latency import _percentile  # noqa: E402
from pd_multi_turn import read_counters  # noqa: E402
from pd_phases import print_timeline, read_traces, timeline  # noqa: E402

from pd_overhead_deploy import (HANDOFFS, SINGLE, Deployment, Prompts, _body,  # noqa: E402
                                _fmt, _rotated, proxy_has_handoff_flag, stream_chat)
from pd_overhead_load import run_load_mode  # noqa: E402


def run_first(args, dep: Deployment, client, prompts: Prompts, mark) -> dict:
    """Mode ``first``: {length: {target: [records]}}."""
    targets = list(dep.targets)
    out: dict = {}
    for length in args.prompt_lens:
        # Prompts first (the /tokenize calls stay out of the measurement): a body per request,
        # a random head per request and target.
        reqs = []
        for k in range(args.warmup + args.requests):
            heads = {t: prompts.head() for t in targets}
            msgs, _ = prompts.fit(next(iter(heads.values())), length,
                                  random.Random(f"{args.seed}-{length}-{k}"))
            user = msgs[1]["content"]
            reqs.append({t: [{"role": "system", "content": heads[t]},
                             {"role": "user", "content": user}] for t in targets})
        rec: dict = {t: [] for t in targets}
        for k, per_target in enumerate(reqs):
            warm = k < args.warmup
            for t in _rotated(targets, k):
                group = None if warm else f"first.{length}.{t}"
                r = stream_chat(client, dep.targets[t], _body(args, per_target[t]), group, mark)
                r.update(k=k - args.warmup, warmup=warm)
                rec[t].append(r)
                time.sleep(args.gap_ms / 1e3)
        out[str(length)] = rec
        print(f"  first, {length} tokens: done", file=sys.stderr, flush=True)
    return out


def run_bidi(args, dep: Deployment, client, prompts: Prompts, mark) -> dict:
    """Mode ``bidi``: {"h<history>": {target: [records]}}, one per turn (turn 1 flagged)."""
    targets = list(dep.targets)
    counted_per_conv = args.turns - 1
    warm_convs = math.ceil(args.warmup / counted_per_conv) if args.warmup else 0
    convs = warm_convs + math.ceil(args.requests / counted_per_conv)
    rec: dict = {t: [] for t in targets}
    counted = 0
    seq = 0
    for conv in range(convs):
        warm = conv < warm_convs
        body_rng = random.Random(f"{args.seed}-bidi-{conv}")
        heads = {t: prompts.head() for t in targets}
        first, _ = prompts.fit(next(iter(heads.values())), args.history, body_rng)
        history = {t: [{"role": "system", "content": heads[t]}, dict(first[1])] for t in targets}
        cids = {t: f"pd-overhead-{conv}-{t}-{prompts.rng.getrandbits(32):08x}" for t in targets}
        turn_words = [prompts.words(max(1, round(args.turn_len / prompts.per_word)), body_rng)
                      for _ in range(args.turns)]
        for turn in range(args.turns):
            if turn > 0 and not warm:
                if counted >= args.requests:
                    break
                counted += 1
            for t in _rotated(targets, seq):
                group = None if (warm or turn == 0) else f"bidi.h{args.history}.{t}"
                r = stream_chat(client, dep.targets[t], _body(args, history[t], cids[t]), group,
                                mark)
                r.update(conv=conv, turn=turn + 1, warmup=warm, history_turn=turn == 0)
                rec[t].append(r)
                history[t] = history[t] + [{"role": "assistant", "content": r["text"]},
                                           {"role": "user", "content": turn_words[turn]}]
                time.sleep(args.gap_ms / 1e3)
            seq += 1
    print("  bidi: done", file=sys.stderr, flush=True)
    return {f"h{args.history}": rec}


# --------------------------------------------------------------------------- analysis
def group_timeline(events: list, group: str) -> list:
    """pd_phases.timeline() of the requests marked ``cl.send.G`` .. ``cl.end.G``.

    ``timeline`` leaves out the first turn of every conversation of ``turns`` turns; all n
    requests are counted as turns 2..n+1 of one conversation whose first turn is an empty
    stand-in.
    """
    send, end = f"cl.send.{group}", f"cl.end.{group}"
    n = sum(1 for _, role, phase in events if role == "client" and phase == send)
    if n == 0:
        return []
    stand_in = [(float("-inf"), "client", send), (float("-inf"), "client", end)]
    return timeline(stand_in + events, n + 1, skip=0, send=send, end=end)


def counted(records: list[dict]) -> list[dict]:
    return [r for r in records if not r["warmup"] and not r.get("history_turn")]


def _key(r: dict):
    return (r.get("conv"), r.get("turn")) if "conv" in r else r["k"]


def summarize(mode: str, samples: dict) -> list[dict]:
    rows = []
    for length, per_target in samples.items():
        base = {_key(r): r["ttft_ms"] for r in counted(per_target[SINGLE])}
        for t, records in per_target.items():
            recs = [r for r in counted(records) if r["ttft_ms"] is not None]
            xs = [r["ttft_ms"] for r in recs]
            toks = [r["prompt_tokens"] for r in recs if r["prompt_tokens"] is not None]
            diffs = [r["ttft_ms"] - base[_key(r)] for r in recs
                     if base.get(_key(r)) is not None]
            row = {"mode": mode, "length": length, "target": t, "n": len(xs),
                   "missing_ttft": len(counted(records)) - len(xs),
                   "prompt_tokens": statistics.median(toks) if toks else None,
                   "p50": statistics.median(xs) if xs else None,
                   "p90": _percentile(xs, 0.9) if xs else None,
                   "diff_p50": statistics.median(diffs) if diffs and t != SINGLE else None,
                   "diff_p90": _percentile(diffs, 0.9) if diffs and t != SINGLE else None}
            rows.append(row)
    return rows


def print_mode(mode: str, rows: list[dict], timelines: dict, counters: dict, args) -> None:
    what = ("first turns, a fresh prompt each (no prefix-cache hit)" if mode == "first" else
            f"turns 2-{args.turns} of chats with a ~{args.history}-token history, +~"
            f"{args.turn_len} tokens a turn; single: prefix-cache hit, P/D: bidirectional pull")
    print(f"\n== mode {mode}: {what}; {args.output_len} output tokens; TTFT ms, streamed chat")
    print(f"{'prompt':>7} {'target':<15} {'n':>4} {'tokens':>7} {'p50':>8} {'p90':>8} "
          f"{'diff p50':>9} {'diff p90':>9}")
    for r in rows:
        miss = f"  ({r['missing_ttft']} without a token event)" if r["missing_ttft"] else ""
        print(f"{r['length']:>7} {r['target']:<15} {r['n']:>4} "
              f"{_fmt(r['prompt_tokens'], '7.0f')} {_fmt(r['p50'])} {_fmt(r['p90'])} "
              f"{_fmt(r['diff_p50'], '9.1f', True)} {_fmt(r['diff_p90'], '9.1f', True)}{miss}")
    print("diff = percentiles of TTFT(target, k) - TTFT(single, k) over requests k")
    for length, per_target in timelines.items():
        for t, tl in per_target.items():
            print(f"\n-- phases, {mode} {length}, {t}: median ms from the client's send, step "
                  f"from the row before")
            print_timeline(tl)
    print(f"\n-- {mode}: engines' prompt tokens over the mode (warm-up included)")
    for eng, c in counters.items():
        print(f"   {eng}: total {c['pdserve:prompt_tokens_total']:.0f}, computed "
              f"{c['pdserve:prompt_tokens_computed_total']:.0f}, cached "
              f"{c['pdserve:prompt_tokens_cached_total']:.0f}, transferred "
              f"{c['pdserve:prompt_tokens_transferred_total']:.0f}")


def run_mode(mode: str, args, work: Path, handoff_flag: bool) -> dict:
    import httpx

    from pdserve.utils import phase_trace

    mode_dir = work / mode
    trace_dir = mode_dir / "traces"
    trace_dir.mkdir(parents=True)
    os.environ[phase_trace.ENV] = str(trace_dir)  # the deployment's processes inherit it
    dep = Deployment(args, mode == "bidi", mode_dir / "logs", handoff_flag)
    try:
        print(f"{mode}: starting {', '.join(s.name for s in dep.specs)} (logs in "
              f"{mode_dir / 'logs'})", file=sys.stderr, flush=True)
        took = dep.start(args.startup_timeout)
        print(f"{mode}: ready after {took:.1f} s", file=sys.stderr, flush=True)
        phase_trace.configure(str(trace_dir))
        phase_trace.set_role("client")
        with httpx.Client(timeout=600) as client:
            prompts = Prompts(client, dep.targets[SINGLE], args.seed)
            before = {e: read_counters(u) for e, u in dep.engines.items()}
            runner = run_first if mode == "first" else run_bidi
            samples = runner(args, dep, client, prompts, phase_trace.mark)
            after = {e: read_counters(u) for e, u in dep.engines.items()}
    finally:
        phase_trace.configure(None)
        dep.stop()
        os.environ.pop(phase_trace.ENV, None)
    events = read_traces(trace_dir)
    timelines = {length: {t: group_timeline(events, f"{mode}.{length}.{t}") for t in per_target}
                 for length, per_target in samples.items()}
    counters = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in after}
    rows = summarize(mode, samples)
    print_mode(mode, rows, timelines, counters, args)
    return {"rows": rows, "samples": samples, "timelines": timelines, "counters": counters,
            "dir": str(mode_dir)}


# --------------------------------------------------------------------------- main
def _model_positions(model: str | None) -> int | None:
    """``max_position_embeddings`` of a model directory's config.json (None if unknown)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (TypeError, OSError, ValueError):
        return None
    config = config.get("text_config", config)
    return config.get("max_position_embeddings")


def _needed_len(args) -> int:
    need = args.output_len + 64
    if args.mode in ("first", "both"):
        need = max(need, max(args.prompt_lens) + args.output_len + 64)
    if args.mode in ("bidi", "both"):
        need = max(need, args.history + args.turns * (args.turn_len + args.output_len + 64) + 64)
    if args.mode == "load":
        need = max(need, args.load_prompt_len + args.load_output_len + 64)
    return 256 * math.ceil(need / 256)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["first", "bidi", "both", "load"], default="both",
                    help="both: first, then bidi (default); load: concurrent streams "
                         "(--streams), a mode of its own")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None,
                    help="default: cuda when a GPU is visible, else cpu")
    ap.add_argument("--model", default=None,
                    help="model directory (CPU default: a tiny random 2-layer Llama made here; "
                         "required on CUDA)")
    ap.add_argument("--engine-args", default=None,
                    help="'pdserve serve' options for every engine (CPU default "
                         "'--dtype float32'; --max-model-len is added when missing)")
    ap.add_argument("--handoffs", default="sequential,concurrent",
                    help="proxy hand-off modes, one proxy each (default sequential,concurrent)")
    ap.add_argument("--prompt-lens", default=None,
                    help="first mode: prompt tokens, comma-separated (default 512 on CPU, "
                         "256,1024,4096,16384 on CUDA)")
    ap.add_argument("--history", type=int, default=None,
                    help="bidi: tokens of turn 1's prompt (default 2048 on CPU, 4096 on CUDA)")
    ap.add_argument("--turns", type=int, default=3, help="bidi: turns per chat (1 + counted)")
    ap.add_argument("--turn-len", type=int, default=200,
                    help="bidi: tokens of each later user message (about)")
    ap.add_argument("--output-len", type=int, default=4)
    ap.add_argument("--requests", type=int, default=20,
                    help="counted requests per (length, target)")
    ap.add_argument("--warmup", type=int, default=3,
                    help="uncounted requests per (length, target) before them (bidi: whole "
                         "chats, ceil(warmup / (turns - 1)) of them)")
    ap.add_argument("--gap-ms", type=float, default=20.0,
                    help="pause after every request (keeps late marks of one request out of "
                         "the next one's trace window)")
    ap.add_argument("--streams", type=int, default=64,
                    help="load: requests in flight at once (default 64)")
    ap.add_argument("--load-prompt-len", type=int, default=None,
                    help="load: prompt tokens (default 256 on CPU, 1024 on CUDA)")
    ap.add_argument("--load-output-len", type=int, default=None,
                    help="load: output tokens of every request (default 32 on CPU, 128 on CUDA)")
    ap.add_argument("--load-requests", type=int, default=None,
                    help="load: requests per target and round (default 4 x --streams)")
    ap.add_argument("--load-rounds", type=int, default=2,
                    help="load: rounds; each runs every target once, one after the other")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="write all raw samples and results as JSON")
    ap.add_argument("--work-dir", default=None,
                    help="logs, traces (and the CPU tiny model, removed at the end); default "
                         "a new temporary directory, kept")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    if args.device is None:
        from pdserve.utils.host_devices import detect_gpus

        args.device = "cuda" if detect_gpus() else "cpu"
    cuda = args.device == "cuda"
    args.handoffs = [h.strip() for h in args.handoffs.split(",") if h.strip()]
    for h in args.handoffs:
        if h not in HANDOFFS:
            ap.error(f"--handoffs: {h!r} is not one of {', '.join(HANDOFFS)}")
    args.prompt_lens = [int(x) for x in (args.prompt_lens or
                                         ("256,1024,4096,16384" if cuda else "512")).split(",")]
    args.history = args.history or (4096 if cuda else 2048)
    if args.engine_args is None:
        args.engine_args = "" if cuda else "--dtype float32"
    if args.turns < 2:
        ap.error("--turns must be at least 2 (turn 1 builds the history)")
    args.load_prompt_len = args.load_prompt_len or (1024 if cuda else 256)
    args.load_output_len = args.load_output_len or (128 if cuda else 32)
    args.load_requests = args.load_requests or 4 * args.streams
    if min(args.streams, args.load_output_len, args.load_requests, args.load_rounds) < 1:
        ap.error("--streams, --load-output-len, --load-requests and --load-rounds must be >= 1")
    from pdserve.launcher.plan import option_value

    given_len = option_value(shlex.split(args.engine_args), "--max-model-len")
    limit = int(given_len) if given_len else _model_positions(args.model)
    if limit is not None:
        longest = limit - args.output_len - 8  # the fit is within 2 tokens
        clipped = [min(n, longest) for n in args.prompt_lens]
        if clipped != args.prompt_lens and args.mode != "bidi":
            print(f"note: the model takes {limit} positions; prompt lengths "
                  f"{args.prompt_lens} measured as {clipped}", file=sys.stderr)
            args.prompt_lens = clipped
        if args.mode == "load" and args.load_prompt_len > limit - args.load_output_len - 8:
            longest = limit - args.load_output_len - 8
            print(f"note: the model takes {limit} positions; load prompts of "
                  f"{args.load_prompt_len} tokens measured as {longest}", file=sys.stderr)
            args.load_prompt_len = longest
    args.max_model_len = int(given_len) if given_len else min(_needed_len(args),
                                                               limit or 1 << 30)
    handoff_flag = proxy_has_handoff_flag()
    if not handoff_flag and "concurrent" in args.handoffs:
        raise SystemExit("this pdserve proxy has no --handoff flag (no concurrent hand-off "
                         "yet); run with --handoffs sequential")

    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="pd_overhead_"))
    work.mkdir(parents=True, exist_ok=True)
    made_model = None

    def on_term(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGHUP, on_term)
    results: dict = {}
    try:
        if args.model is None:
            if cuda:
                raise SystemExit("--device cuda needs --model DIR")
            from pdserve.testing.tiny_models import make_tiny_model

            made_model = work / "tiny-llama"
            positions = max(4096, args.max_model_len)
            make_tiny_model(made_model, "llama", max_position_embeddings=positions)
            args.model = str(made_model)
            model_desc = f"tiny random 2-layer Llama ({positions} positions)"
        else:
            model_desc = args.model
        print(f"pd_overhead: model {model_desc}, device {args.device}, engine args "
              f"{args.engine_args!r} (+ --max-model-len {args.max_model_len} if not given), "
              f"handoffs {','.join(args.handoffs)}"
              + ("" if handoff_flag else " (proxy without --handoff: today's flow)")
              + (f", {args.requests} requests + {args.warmup} warm-up per length and target; "
                 if args.mode != "load" else
                 f", {args.streams} streams, {args.load_requests} requests per target x "
                 f"{args.load_rounds} rounds; ")
              + f"work dir {work}", flush=True)
        for mode in (["first", "bidi"] if args.mode == "both" else [args.mode]):
            if mode == "load":
                results[mode] = run_load_mode(args, work, handoff_flag)
            else:
                results[mode] = run_mode(mode, args, work, handoff_flag)
    except KeyboardInterrupt as e:
        print(f"\ninterrupted ({e or 'Ctrl-C'}); every process this run started is stopped",
              file=sys.stderr)
        return 130
    finally:
        if made_model is not None:
            shutil.rmtree(made_model, ignore_errors=True)
        wall = time.monotonic() - t_start
        if args.out and results:
            Path(args.out).write_text(json.dumps(
                {"args": {k: v for k, v in vars(args).items()}, "handoff_flag": handoff_flag,
                 "wall_s": wall, "modes": results}, indent=1))
    print(f"\nwall time {wall:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
