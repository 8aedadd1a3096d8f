"""Mode ``load`` of benchmarks/pd_overhead.py: throughput and TPOT of one engine against P/D under
concurrent streams.

``--mode load`` (not part of ``both``; a deployment of its own, as mode ``first``'s but
without the phase trace) asks whether P/D keeps throughput and TPOT under concurrent streams
(issue 35: 64 streams): per round (``--load-rounds``, default 2) every target in turn, one after
the other (``single``, then the proxies in ``--handoffs`` order: sequential, concurrent,
sequential, concurrent, ... over the rounds, so warm-up and drift show), gets
``--load-requests`` (default 4 x ``--streams``) streamed chat requests, ``--streams`` (default
64) in flight at a time (one asyncio client; a new request goes out when one ends), each a
first turn of ``--load-prompt-len`` tokens (default 1024 on CUDA, 256 on CPU) with a fresh random
head (no prefix-cache hit: the counters printed after the table show 0 cached tokens) and
exactly ``--load-output-len`` output tokens (default 128 on CUDA, 32 on CPU; greedy,
``ignore_eos``). No warm-up. Printed per round and target: output tokens/s (the completion tokens
of all requests from ``usage``, else their token events, over the wall time from the first send
to the last response), TTFT p50/p90 (ms, as below), TPOT p50/p90 (ms, per request (e2e - TTFT)
/ (tokens - 1)), tokens/s and TPOT p50 against ``single``'s row of the same round, and failed
requests (an error, no token event, or not exactly ``--load-output-len`` tokens; the reasons
follow the table). TTFT is measured as in mode ``first`` (pd_overhead.py).

Imported by ``pd_overhead.py`` (same folder), which parses the options; not a script.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

from pd_latency import _percentile
from pd_multi_turn import read_counters
from pd_overhead_deploy import SINGLE, Deployment, Prompts, _fmt


# --------------------------------------------------------------------------- load
def load_bodies(args, prompts: Prompts) -> list[str]:
    """The user messages of mode ``load``: one per request index k, fitted (with a stand-in
    head) to ``--load-prompt-len`` tokens, the same for every target and round; each request
    gets a fresh head of its own (:func:`run_load_mode`), so no prompt shares a KV block with
    another."""
    bodies = []
    for k in range(args.load_requests):
        msgs, _ = prompts.fit(prompts.head(), args.load_prompt_len,
                              random.Random(f"{args.seed}-load-{k}"))
        bodies.append(msgs[1]["content"])
    return bodies


async def _load_one(client, url: str, body: dict) -> dict:
    """One streamed chat request under load; never raises (a failure is in ``error``)."""
    ttft, usage, chunks, error = None, None, 0, None
    t0 = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
            else:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if chunk.get("error"):
                        error = f"stream error: {str(chunk['error'])[:200]}"
                        break
                    usage = chunk.get("usage") or usage
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        if delta.get("content") or choice.get("token_ids"):
                            chunks += 1
                            if ttft is None:
                                ttft = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - a failed request is a result here
        error = f"{type(e).__name__}: {str(e)[:200]}"
    end = time.perf_counter()
    usage = usage or {}
    return {"t_send": t0, "t_end": end, "ttft_ms": None if ttft is None else 1e3 * ttft,
            "e2e_ms": 1e3 * (end - t0), "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "token_chunks": chunks,
            "error": error}


async def _load_target(client, url: str, bodies: list[dict], streams: int) -> list[dict]:
    """All ``bodies`` against one target, ``streams`` of them in flight at a time (a new one
    goes out as soon as one ends), in order of their index."""
    records: list = [None] * len(bodies)
    next_k = 0

    async def worker() -> None:
        nonlocal next_k
        while next_k < len(bodies):
            k = next_k
            next_k += 1
            records[k] = await _load_one(client, url, bodies[k])
            records[k]["k"] = k

    await asyncio.gather(*(worker() for _ in range(min(streams, len(bodies)))))
    return records


def load_row(args, rnd: int, target: str, records: list[dict]) -> dict:
    """The figures of one target in one round (see the module docstring)."""
    ok, failed = [], {}
    for r in records:
        tokens = r["completion_tokens"] if r["completion_tokens"] is not None \
            else r["token_chunks"]
        r["tokens"] = tokens
        why = r["error"] or (None if r["ttft_ms"] is not None else "no token event") or (
            None if tokens == args.load_output_len else
            f"{tokens} tokens, not {args.load_output_len}")
        if why:
            key = why.split(":")[0] if r["error"] else why
            failed[key] = failed.get(key, 0) + 1
        else:
            ok.append(r)
    wall = max(r["t_end"] for r in records) - min(r["t_send"] for r in records)
    out_tokens = sum(r["tokens"] or 0 for r in records)
    ttfts = [r["ttft_ms"] for r in ok]
    tpots = [(r["e2e_ms"] - r["ttft_ms"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    toks = [r["prompt_tokens"] for r in ok if r["prompt_tokens"] is not None]

    def pct(xs, q):
        return (statistics.median(xs) if q == 0.5 else _percentile(xs, q)) if xs else None

    return {"mode": "load", "round": rnd, "target": target, "n": len(records), "ok": len(ok),
            "failed": len(records) - len(ok), "failed_why": failed,
            "prompt_tokens": statistics.median(toks) if toks else None,
            "output_tokens": out_tokens, "wall_s": wall,
            "tok_s": out_tokens / wall if wall > 0 else None,
            "ttft_p50": pct(ttfts, 0.5), "ttft_p90": pct(ttfts, 0.9),
            "tpot_p50": pct(tpots, 0.5), "tpot_p90": pct(tpots, 0.9)}


def print_load(rows: list[dict], counters: dict, args) -> None:
    print(f"\n== mode load: {args.streams} streams in flight, {args.load_requests} requests per "
          f"target and round, ~{args.load_prompt_len}-token prompts (a fresh head each, no "
          f"prefix-cache hit), {args.load_output_len} output tokens (ignore_eos); streamed chat; "
          f"targets one after the other")
    print(f"{'round':>5} {'target':<15} {'ok':>5} {'failed':>6} {'tokens':>6} {'out tok/s':>10} "
          f"{'vs single':>9} {'TTFT p50':>9} {'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} "
          f"{'vs single':>9} {'wall s':>7}")
    base = {r["round"]: r for r in rows if r["target"] == SINGLE}

    def vs_single(r, key) -> str:
        """``r[key]`` against single's in the same round, as a signed percentage."""
        b = base.get(r["round"])
        if r["target"] == SINGLE or not b or not b[key] or r[key] is None:
            return f"{'-':>9}"
        return f"{100.0 * (r[key] / b[key] - 1.0):+8.1f}%"

    for r in rows:
        print(f"{r['round']:>5} {r['target']:<15} {r['ok']:>5} {r['failed']:>6} "
              f"{_fmt(r['prompt_tokens'], '6.0f')} {_fmt(r['tok_s'], '10.1f')} "
              f"{vs_single(r, 'tok_s')} "
              f"{_fmt(r['ttft_p50'], '9.1f')} {_fmt(r['ttft_p90'], '9.1f')} "
              f"{_fmt(r['tpot_p50'], '9.2f')} {_fmt(r['tpot_p90'], '9.2f')} "
              f"{vs_single(r, 'tpot_p50')} {r['wall_s']:7.1f}")
    print("out tok/s: completion tokens of all requests (usage, else token events) over the wall "
          "time from the first send to the last response; TTFT ms; TPOT ms = (e2e - TTFT) / "
          "(tokens - 1) per request; vs single: against single's row of the same round (tok/s, "
          "TPOT p50); tokens: median prompt tokens")
    for r in rows:
        if r["failed_why"]:
            print(f"   failed, round {r['round']} {r['target']}: "
                  + ", ".join(f"{n} x {why}" for why, n in r["failed_why"].items()))
    print("\n-- load: engines' prompt tokens over the mode")
    for eng, c in counters.items():
        print(f"   {eng}: total {c['pdserve:prompt_tokens_total']:.0f}, computed "
              f"{c['pdserve:prompt_tokens_computed_total']:.0f}, cached "
              f"{c['pdserve:prompt_tokens_cached_total']:.0f}, transferred "
              f"{c['pdserve:prompt_tokens_transferred_total']:.0f}")


def run_load_mode(args, work: Path, handoff_flag: bool) -> dict:
    """Mode ``load``: a deployment as in ``first`` (no phase trace), then per round every target
    in turn (single, then the proxies in ``--handoffs`` order) under ``--streams`` concurrent
    streams."""
    import httpx

    mode_dir = work / "load"
    mode_dir.mkdir(parents=True)
    dep = Deployment(args, False, mode_dir / "logs", handoff_flag)
    targets = list(dep.targets)
    rows, samples = [], {}
    try:
        print(f"load: starting {', '.join(s.name for s in dep.specs)} (logs in "
              f"{mode_dir / 'logs'})", file=sys.stderr, flush=True)
        took = dep.start(args.startup_timeout)
        print(f"load: ready after {took:.1f} s", file=sys.stderr, flush=True)
        with httpx.Client(timeout=600) as client:
            prompts = Prompts(client, dep.targets[SINGLE], args.seed)
            bodies = load_bodies(args, prompts)
            before = {e: read_counters(u) for e, u in dep.engines.items()}

        def request(k: int) -> dict:
            msgs = [{"role": "system", "content": prompts.head()},
                    {"role": "user", "content": bodies[k]}]
            return {"messages": msgs, "stream": True, "max_tokens": args.load_output_len,
                    "ignore_eos": True, "temperature": 0, "return_token_ids": True,
                    "stream_options": {"include_usage": True}}

        async def all_rounds() -> None:
            limits = httpx.Limits(max_connections=args.streams + 8,
                                  max_keepalive_connections=args.streams + 8)
            async with httpx.AsyncClient(timeout=600, limits=limits) as aclient:
                for rnd in range(1, args.load_rounds + 1):
                    for t in targets:
                        reqs = [request(k) for k in range(args.load_requests)]
                        recs = await _load_target(aclient, dep.targets[t], reqs, args.streams)
                        row = load_row(args, rnd, t, recs)
                        rows.append(row)
                        samples[f"{rnd}.{t}"] = recs
                        print(f"  load, round {rnd}, {t}: {row['ok']} ok, {row['failed']} "
                              f"failed, {row['wall_s']:.1f} s", file=sys.stderr, flush=True)
                        await asyncio.sleep(args.gap_ms / 1e3)

        asyncio.run(all_rounds())
        after = {e: read_counters(u) for e, u in dep.engines.items()}
    finally:
        dep.stop()
    counters = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in after}
    print_load(rows, counters, args)
    return {"rows": rows, "samples": samples, "counters": counters, "dir": str(mode_dir)}
