"""Where the time of one multi-turn chat turn goes: a per-phase timeline across all processes.

Starts one deployment with the phase trace on (``PDSERVE_PHASE_TRACE``, pdserve/utils/phase_trace.py):

* ``bidi``: ``pdserve up --multi-turn`` (P pulls the history's KV back from D every turn);
* ``recompute``: ``pdserve up`` (P prefills the whole history);
* ``single``: one ``pdserve serve`` (its prefix cache holds the history).

One client then runs ``--convs`` conversations of ``--turns`` turns (streamed chat, the first
conversation only warms up), shaped as benchmarks/pd_multi_turn_long_spec.json: a system message
and a first user message of about 3,500 tokens, then per turn ``--output-tokens`` answer tokens
and a user message of about 200 tokens. Since one request runs at a time, each trace mark belongs
to the turn whose send it follows. For turns 2+ it prints, per phase (process and mark, in order
of the median), the median offset from the client's send and the step from the phase before,
ending with the client's first token; then the turns' median TTFT.

Example::

    python benchmarks/pd_phases.py --model /tmp/tiny --device cpu --mode bidi \\
        --engine-args "--dtype float32 --max-model-len 8192 --no-enable-prefix-caching"
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from pd_multi_turn import _stop  # noqa: E402  (stops a launcher as Ctrl-C would)


def read_traces(directory: Path) -> list[tuple[float, str, str]]:
    """All marks of ``directory``'s ``*.trace`` files as ``(time_s, role, phase)``, sorted."""
    events = []
    for path in directory.glob("*.trace"):
        role = "?"
        for line in path.read_text().splitlines():
            if line.startswith("# role "):
                role = line[len("# role "):]
                continue
            t, _, phase = line.partition(" ")
            events.append((float(t), role, phase))
    events.sort()
    return events


def print_timeline(rows: list[tuple[str, float, int]]) -> None:
    """Print :func:`timeline`'s rows, each with its step from the row before, down to the
    client's first token (``client cl.first``)."""
    prev = 0.0
    for name, ms, n in rows:
        print(f"{ms:9.2f} {ms - prev:+8.2f}  {name}  (n={n})")
        prev = ms
        if name == "client cl.first":
            break


def timeline(events: list[tuple[float, str, str]], turns: int, skip: int = 1,
             send: str = "cl.send", end: str = "cl.end") -> list[tuple[str, float, int]]:
    """Median offset (ms) of each ``(role, phase, occurrence)`` from the client's send.

    Args:
        events: :func:`read_traces` output; the client's marks are ``send`` / ``end``.
        turns: turns per conversation (the first turn of each is left out: it has no history).
        skip: leading conversations left out (warm-up).

    Returns:
        ``(name, median_ms, count)`` in order of the median; ``name`` is
        ``"role phase"`` plus ``#k`` for the k-th repeat (k >= 1) within a turn; only names
        seen in at least half of the turns.
    """
    per_turn: list[list[tuple[float, str]]] = []
    t0 = None
    for t, role, phase in events:
        if role == "client" and phase == send:
            t0 = t
            per_turn.append([])
        elif t0 is not None and per_turn:
            if role == "client" and phase == end:
                t0 = None
                continue
            per_turn[-1].append((1e3 * (t - t0), f"{role} {phase}"))
    chosen = [tr for i, tr in enumerate(per_turn) if i >= skip * turns and i % turns != 0]
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for tr in chosen:
        seen: collections.Counter = collections.Counter()
        for ms, name in tr:
            k = seen[name]
            seen[name] += 1
            offsets[name if k == 0 else f"{name}#{k}"].append(ms)
    rows = [(name, statistics.median(v), len(v)) for name, v in offsets.items()
            if len(v) >= max(1, len(chosen) // 2)]
    rows.sort(key=lambda r: r[1])
    return rows


def _words(rng: random.Random, vocab: list[str], n: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(n))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(args: argparse.Namespace, work: Path) -> tuple[subprocess.Popen, str]:
    """Start the deployment; returns its process and the URL the client talks to."""
    import httpx

    if args.mode != "single":
        sys.path.insert(0, str(HERE))
        from pd_multi_turn import _start_up

        ns = argparse.Namespace(model=args.model, device=args.device,
                                engine_args=args.engine_args,
                                startup_timeout=args.startup_timeout)
        proc, status = _start_up(ns, args.mode == "bidi", work, work / "up.log")
        return proc, next(p["url"] for p in status["children"] if p["role"] == "proxy")
    port = _free_port()
    engine_args = [a for a in shlex.split(args.engine_args) if a != "--no-enable-prefix-caching"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "serve", args.model, "--device", args.device,
         "--port", str(port), *engine_args],
        stdout=open(work / "serve.log", "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"pdserve serve exited with {proc.returncode}; log {work}/serve.log")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"pdserve serve not ready after {args.startup_timeout} s")


def _converse(args: argparse.Namespace, url: str, mark) -> list[dict]:
    """Run the conversations; returns one record per counted turn."""
    import httpx

    rng = random.Random(args.seed)
    syllables = ["ka", "lo", "mi", "ten", "ra", "so", "vu", "pel", "dor", "an", "ex", "tri",
                 "qua", "ne", "bi"]
    vocab = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3)))
             for _ in range(3000)]
    records = []
    with httpx.Client(timeout=300) as client:
        for conv in range(args.convs + 1):  # conversation 0 warms up
            cid = f"phases-{conv}-{rng.getrandbits(32):08x}"
            messages = [{"role": "system", "content": _words(rng, vocab, args.system_words)},
                        {"role": "user", "content": _words(rng, vocab, args.first_words)}]
            for turn in range(args.turns):
                body = {"messages": messages, "stream": True, "max_tokens": args.output_tokens,
                        "ignore_eos": True, "temperature": 0, "conversation_id": cid,
                        "stream_options": {"include_usage": True}}
                text, usage, ttft = [], None, None
                mark("cl.send")
                t0 = time.perf_counter()
                with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    if r.status_code != 200:
                        raise SystemExit(f"HTTP {r.status_code}: {r.read()[:300]!r}")
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        usage = chunk.get("usage") or usage
                        for choice in chunk.get("choices", []):
                            if choice.get("delta", {}).get("content"):
                                if ttft is None:
                                    ttft = time.perf_counter() - t0
                                    mark("cl.first")
                                text.append(choice["delta"]["content"])
                mark("cl.end")
                if conv > 0:
                    records.append({"conv": conv, "turn": turn,
                                    "ttft_ms": None if ttft is None else 1e3 * ttft,
                                    "prompt_tokens": (usage or {}).get("prompt_tokens")})
                messages = messages + [
                    {"role": "assistant", "content": "".join(text)},
                    {"role": "user", "content": _words(rng, vocab, args.turn_words)}]
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["bidi", "recompute", "single"], default="bidi")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--engine-args",
                    default="--dtype float32 --max-model-len 8192 --no-enable-prefix-caching",
                    help="'pdserve serve' options ('single' drops --no-enable-prefix-caching)")
    ap.add_argument("--convs", type=int, default=3, help="counted conversations")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-words", type=int, default=250)
    ap.add_argument("--first-words", type=int, default=1600,
                    help="words of the first user message (about 2 tokens each)")
    ap.add_argument("--turn-words", type=int, default=100)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=600.0)
    ap.add_argument("--json", default=None, help="also write the timeline and turns here")
    ap.add_argument("--work-dir", default=None,
                    help="where the traces and the deployment's logs go (default: a new "
                         "temporary directory, kept)")
    args = ap.parse_args(argv)

    import os

    from pdserve.utils import phase_trace

    if args.work_dir:
        trace_dir = Path(args.work_dir)
        trace_dir.mkdir(parents=True, exist_ok=True)
    else:
        trace_dir = Path(tempfile.mkdtemp(prefix="pd_phases_"))
    os.environ[phase_trace.ENV] = str(trace_dir)  # the deployment's processes inherit it
    phase_trace.configure(str(trace_dir))
    phase_trace.set_role("client")
    proc, url = _start(args, trace_dir)
    try:
        records = _converse(args, url, phase_trace.mark)
    finally:
        _stop(proc)
    phase_trace.configure(None)
    rows = timeline(read_traces(trace_dir), args.turns)
    print(f"mode {args.mode}, model {args.model}, device {args.device}; traces and logs in "
          f"{trace_dir}; turns 2+, medians (ms from the client's send)")
    print_timeline(rows)
    ttfts = [r["ttft_ms"] for r in records if r["turn"] > 0 and r["ttft_ms"] is not None]
    lens = [r["prompt_tokens"] for r in records if r["conv"] == 1]
    if ttfts:
        print(f"turns 2+ TTFT: median {statistics.median(ttfts):.1f} ms, mean "
              f"{statistics.fmean(ttfts):.1f} ms (n={len(ttfts)}); prompt tokens per turn "
              f"{lens}")
    if args.json:
        Path(args.json).write_text(json.dumps({"timeline": rows, "turns": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
