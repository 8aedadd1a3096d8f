"""Multi-turn TTFT with and without the host-memory KV cache tier, when the conversations' KV
does not fit in the device cache.

Runs one in-process engine (the real model runner; no HTTP, no proxy) twice in one invocation,
on the same workload:

* ``no tier``: the device KV cache alone (``--num-gpu-blocks-override`` sized so that the
  conversations' total KV is ``--overcommit`` times the cache), so a conversation's history is
  usually evicted by the others before its next turn and recomputed;
* ``host tier``: the same cache plus ``--kv-offloading-size`` (enough host memory for every
  conversation's KV), so evicted history comes back by a copy.

Workload: ``--conversations`` conversations of ``--turns`` turns, ``--concurrency`` of them in
flight at a time; turn 1 sends ``--first-tokens`` random prompt tokens, every later turn the
history (prompt and answer so far) plus ``--user-tokens`` new ones; every answer is
``--output-tokens`` greedy tokens (``ignore_eos``). A conversation that finishes a turn goes to
the back of the queue, so the others run before its next turn. TTFT: from a turn's request
entering the engine to its first token leaving it.

The runs' greedy answers are compared. With a float32 KV cache (the CPU default, or
``--engine-args "--dtype float32"`` on a GPU) they must be identical: any difference is an
error (a tier that served wrong KV). In bf16 / fp16 they need not be: KV computed in another
batch shape (a prefill of another size, another batch's kernels) differs in its last bits, and
with random dummy weights the greedy tokens then part ways; a device prefix-cache hit against a
recompute does the same. The bf16 report says how many answers are identical and where the
first divergence of each conversation lies (turn, token); turn 1 never reads the tier (random
prompts), so a divergence there is batch-shape numerics alone. ``--device-cache-run`` adds a
third run with a device cache that holds every conversation (no eviction, no tier): its answers
are the same numerics class as the tier's (cached KV against cached KV, no recompute).

Each engine first runs an untimed warm-up (``--warmup-conversations``, another seed), after
which its prefix cache and tier are emptied, so that no timed run pays first-time costs (the
model is loaded twice: once per engine).

Prints, per run: TTFT of turn 1 and of turns 2+ (p50 / p90, ms), throughput (generated and
prompt tokens per second of wall time), prompt tokens computed and those served by the host
tier; then a summary line (the turns-2+ ratio, and whether the greedy answers were identical).

Examples::

    python benchmarks/kv_tiers.py                         # CPU, a tiny random Llama (~1 min)
    python benchmarks/kv_tiers.py --device cuda --model /path/llama8b-dummy \\
        --engine-args="--load-format dummy" --conversations 32 --turns 4 \\
        --first-tokens 2048 --user-tokens 256 --output-tokens 64 --concurrency 8

Raises:
    SystemExit: bad options, or (float32 KV cache) answers that differ between the runs.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shlex
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.types.engine_config import EngineConfig

GiB = 1 << 30


@dataclass
class Conversation:
    """One conversation's token history and its turns' answers."""

    history: list[int]
    turn: int = 0
    answers: list[list[int]] = field(default_factory=list)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def _engine_config(args: argparse.Namespace, num_blocks: int, max_model_len: int,
                   offload_gib: float | None) -> "EngineConfig":
    """``pdserve serve``'s own parsing of ``--engine-args`` plus this run's cache sizes."""
    from pdserve.entrypoints.cli_args import build_parser, engine_config_from_args

    argv = [args.model, "--device", args.device, "--num-gpu-blocks-override", str(num_blocks),
            "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.concurrency),
            "--seed", str(args.seed), *shlex.split(args.engine_args)]
    if offload_gib is not None:
        argv += ["--kv-offloading-size", f"{offload_gib:.6f}"]
        if args.disk_dir is not None:
            argv += ["--kv-offloading-disk-dir", args.disk_dir,
                     "--kv-offloading-disk-size", f"{args.disk_gib:.6f}"]
    return engine_config_from_args(build_parser().parse_args(argv), None)


def _run(args: argparse.Namespace, engine: "LLMEngine") -> dict:
    """One run of the workload on ``engine`` (its prefix cache empty); returns its figures
    (counters: this run's increase) and every answer."""
    from pdserve.types.core_messages import AddRequest
    from pdserve.types.sampling_params import SamplingParams

    core = engine.core
    before = engine.stats()
    vocab = core.model_info.vocab_size
    rng = random.Random(args.seed)
    convs = [Conversation([rng.randrange(100, vocab - 1) for _ in range(args.first_tokens)])
             for _ in range(args.conversations)]
    user = [[[rng.randrange(100, vocab - 1) for _ in range(args.user_tokens)]
             for _ in range(args.turns)] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_tokens, ignore_eos=True)
    queue = deque(range(args.conversations))
    active: dict[str, tuple[int, float, list[int]]] = {}  # request -> (conv, start, tokens)
    ttft: dict[int, list[float]] = {}
    prompt_tokens = generated = 0
    t0 = time.perf_counter()
    while queue or active:
        while queue and len(active) < args.concurrency:
            c = queue.popleft()
            conv = convs[c]
            rid = f"s{args.seed}-c{c}-t{conv.turn}"
            core.add_request(AddRequest(rid, list(conv.history), params))
            prompt_tokens += len(conv.history)
            active[rid] = (c, time.perf_counter(), [])
        outputs, progressed = core.step()
        if not progressed and not outputs:
            time.sleep(0.0005)
        now = time.perf_counter()
        for o in outputs:
            c, start, tokens = active[o.request_id]
            if not tokens and o.new_token_ids:
                ttft.setdefault(convs[c].turn, []).append(now - start)
            tokens.extend(o.new_token_ids)
            if o.finish_reason is None:
                continue
            if o.finish_reason != "length":
                raise SystemExit(f"request {o.request_id} ended with {o.finish_reason}: {o.error}")
            del active[o.request_id]
            generated += len(tokens)
            conv = convs[c]
            conv.answers.append(tokens)
            conv.turn += 1
            if conv.turn < args.turns:
                conv.history += tokens + user[c][conv.turn]
                queue.append(c)
    wall = time.perf_counter() - t0
    stats = engine.stats()
    later = [t for turn, ts in ttft.items() if turn > 0 for t in ts]

    def delta(key: str) -> int:
        return stats[key] - before[key]

    tiers = stats.get("kv_tiers")
    loaded = (tiers["prompt_tokens_loaded"]
              - before["kv_tiers"]["prompt_tokens_loaded"]) if tiers else 0
    return {
        "ttft_turn1_ms": [1e3 * _percentile(ttft.get(0, []), q) for q in (50, 90)],
        "ttft_later_ms": [1e3 * _percentile(later, q) for q in (50, 90)],
        "wall_s": wall, "generated_tok_s": generated / wall,
        "prompt_tok_s": prompt_tokens / wall,
        "prompt_tokens": delta("prompt_tokens_total"),
        "prompt_tokens_computed": delta("prompt_tokens_computed_total"),
        "prompt_tokens_from_tier": loaded,
        "preemptions": delta("num_preemptions_total"),
        "answers": [c.answers for c in convs],
    }


def _compare(base: list[list[list[int]]], other: list[list[list[int]]]) -> dict:
    """Answers of two runs (per conversation, per turn): how many are identical, and the
    first divergence of each conversation that diverges (``[turn, token index]``, 0-based)."""
    same = total = 0
    first: list[list[int]] = []
    for conv_a, conv_b in zip(base, other):
        diverged = None
        for turn, (a, b) in enumerate(zip(conv_a, conv_b)):
            total += 1
            if a == b:
                same += 1
            elif diverged is None:
                pos = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                diverged = [turn, pos]
        if diverged is not None:
            first.append(diverged)
    return {"identical": same, "answers": total, "first_divergence": first}


def _describe(c: dict) -> str:
    text = f"{c['identical']}/{c['answers']} answers identical"
    if c["first_divergence"]:
        turns = sorted(t for t, _ in c["first_divergence"])
        pos = sorted(p for _, p in c["first_divergence"])
        text += (f"; {len(turns)} conversations diverge, first at turn {turns[0] + 1} (turn-1 "
                 f"divergences: {sum(t == 0 for t in turns)}), median token {pos[len(pos) // 2]}")
    return text


def _timed(args: argparse.Namespace, config: "EngineConfig") -> tuple[dict, int, bool]:
    """Build an engine, warm it up (then empty its prefix cache), run the workload; returns
    the run's figures, the engine's block size in bytes and whether its KV cache is float32
    (answers must then be identical)."""
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)
    try:
        spec = engine.core.runner.kv_cache_spec
        block_bytes, exact = spec.block_bytes, spec.dtype == "float32"
        if args.warmup_conversations:
            # first-time costs of each batch shape (kernel selection, allocator growth) are
            # paid here, not by the timed run
            warm = argparse.Namespace(**{**vars(args), "conversations": args.warmup_conversations,
                                         "seed": args.seed + 1})
            _run(warm, engine)
            for _ in range(1000):  # a launched step (async scheduling) may still hold blocks
                if not engine.core.has_work():
                    break
                engine.core.step()
            if not engine.core.scheduler.reset_kv_caches():
                raise SystemExit("the warm-up left KV blocks in use; cannot empty the caches")
        return _run(args, engine), block_bytes, exact
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="model directory or built-in name (default: a tiny random Llama)")
    ap.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--engine-args", default="", help="extra 'pdserve serve' options")
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--first-tokens", type=int, default=192)
    ap.add_argument("--user-tokens", type=int, default=48)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16,
                    help="tokens per block (must match --engine-args' --block-size)")
    ap.add_argument("--overcommit", type=float, default=1.75,
                    help="total KV of all conversations / device cache (1.5-2 is the point)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-conversations", type=int, default=None,
                    help="conversations of each engine's untimed warm-up (default: 2 x "
                         "--concurrency; 0: none)")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    ap.add_argument("--host-tier-gib", type=float, default=None,
                    help="host tier of the tier run in GiB (default: room for every "
                         "conversation's KV and a quarter more)")
    ap.add_argument("--disk-dir", default=None,
                    help="a disk tier below the host tier in the tier run (with --disk-gib)")
    ap.add_argument("--disk-gib", type=float, default=None, help="the disk tier's size in GiB")
    ap.add_argument("--device-cache-run", action="store_true",
                    help="a third run whose device cache holds every conversation (no tier): "
                         "the tier run's answers are compared with it too (cached KV both)")
    args = ap.parse_args(argv)
    for name in ("conversations", "turns", "first_tokens", "output_tokens", "concurrency"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.overcommit <= 0:
        ap.error("--overcommit must be > 0 (below 1: the working set fits the device cache)")
    if (args.disk_dir is None) != (args.disk_gib is None):
        ap.error("--disk-dir and --disk-gib go together")
    for name in ("host_tier_gib", "disk_gib"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            ap.error(f"--{name.replace('_', '-')} must be a finite number > 0")
    if args.warmup_conversations is None:
        args.warmup_conversations = 2 * args.concurrency
    if args.model is None:
        from pdserve.testing.tiny_models import make_tiny_model

        args.model = str(make_tiny_model(tempfile.mkdtemp(prefix="kv-tiers-tiny-"), "llama"))
    per_turn = args.user_tokens + args.output_tokens
    final_len = args.first_tokens + args.output_tokens + (args.turns - 1) * per_turn
    max_model_len = final_len + args.block_size
    total_tokens = args.conversations * final_len
    num_blocks = math.ceil(total_tokens / args.overcommit / args.block_size)
    fits = -(-max_model_len // args.block_size) * args.concurrency
    if num_blocks < fits:
        ap.error(f"the device cache ({num_blocks} blocks) cannot hold --concurrency "
                 f"{args.concurrency} conversations of {final_len} tokens; add conversations "
                 "or lower --overcommit / --concurrency")
    print(f"workload: {args.conversations} conversations x {args.turns} turns "
          f"({args.first_tokens} + {args.turns - 1} x ({args.user_tokens} user + "
          f"{args.output_tokens} answer) tokens), {args.concurrency} in flight; total KV "
          f"{total_tokens} tokens = {args.overcommit:g}x the device cache of {num_blocks} "
          f"blocks x {args.block_size}", flush=True)
    results = {}
    results["no tier"], block_bytes, exact = _timed(
        args, _engine_config(args, num_blocks, max_model_len, None))
    # room for every conversation's whole KV (and a quarter more) in the host tier
    offload_gib = 1.25 * total_tokens / args.block_size * block_bytes / GiB
    if args.host_tier_gib is not None:
        offload_gib = args.host_tier_gib
    disk = f", disk tier {args.disk_gib:g} GiB in {args.disk_dir}" if args.disk_dir else ""
    print(f"host tier: {offload_gib:.4f} GiB ({block_bytes} bytes per block){disk}", flush=True)
    results["host tier"], _, _ = _timed(
        args, _engine_config(args, num_blocks, max_model_len, offload_gib))
    if args.device_cache_run:
        big = math.ceil(1.1 * total_tokens / args.block_size) + fits
        results["dev cache"], _, _ = _timed(args, _engine_config(args, big, max_model_len, None))
    for label, r in results.items():
        print(f"{label:>9}: TTFT turn 1 p50/p90 {r['ttft_turn1_ms'][0]:.1f}/"
              f"{r['ttft_turn1_ms'][1]:.1f} ms, turns 2+ p50/p90 {r['ttft_later_ms'][0]:.1f}/"
              f"{r['ttft_later_ms'][1]:.1f} ms; {r['generated_tok_s']:.1f} generated tok/s, "
              f"{r['prompt_tok_s']:.1f} prompt tok/s ({r['wall_s']:.1f} s); prompt tokens "
              f"computed {r['prompt_tokens_computed']} of {r['prompt_tokens']}, "
              f"{r['prompt_tokens_from_tier']} from the host tier", flush=True)
    base, tier = results["no tier"], results["host tier"]
    same = base["answers"] == tier["answers"]
    checks = {"host tier vs no tier": _compare(base["answers"], tier["answers"])}
    if "dev cache" in results:
        checks["host tier vs dev cache"] = _compare(results["dev cache"]["answers"],
                                                    tier["answers"])
        checks["no tier vs dev cache"] = _compare(results["dev cache"]["answers"],
                                                  base["answers"])
    print(f"summary: turns 2+ TTFT p50 {base['ttft_later_ms'][0]:.1f} -> "
          f"{tier['ttft_later_ms'][0]:.1f} ms "
          f"({base['ttft_later_ms'][0] / tier['ttft_later_ms'][0]:.2f}x), p90 "
          f"{base['ttft_later_ms'][1]:.1f} -> {tier['ttft_later_ms'][1]:.1f} ms; throughput "
          f"{base['generated_tok_s']:.1f} -> {tier['generated_tok_s']:.1f} generated tok/s; "
          f"greedy answers identical: {same}")
    kind = "float32 KV cache: must be identical" if exact else (
        "not float32: batch-shape numerics may differ, reported only")
    for label, c in checks.items():
        print(f"  check ({kind}) {label}: {_describe(c)}", flush=True)
    if args.json:
        out = {k: {kk: vv for kk, vv in v.items() if kk != "answers"} for k, v in results.items()}
        out["checks"] = checks
        out["exact_check"] = exact
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if exact and not all(c["identical"] == c["answers"] for c in checks.values()):
        print("error: the runs' greedy answers differ with a float32 KV cache", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
