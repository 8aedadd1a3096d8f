"""Fault matrix of a disaggregated deployment: each fault injected once under a bounded multi-turn
load with known greedy answers, one table of what the clients saw.

The deployment is real processes on loopback: ``pdserve up`` with 2 prefillers and 2 decoders
(``--multi-turn``; it restarts a dead engine instance, docs/deployment.md) and two ``pdserve proxy``
replicas in front of its engines, sharing their conversation table in a ``redis-server`` of this
script's own (``--state-store``) when one is installed (else each keeps its own). The model is a
tiny random Llama (:func:`pdserve.testing.tiny_models.make_tiny_model`, ``--dtype float32``) or
``--model``.

1. Known answers: every turn of every conversation is first answered by one plain ``pdserve
   serve`` (no KV transfer), greedy. A conversation's next prompt appends the *known* answer, so
   every prompt of the load is fixed in advance.
2. Per fault: the conversations run concurrently (each request streamed, with a timeout), the
   client alternating between the replicas per turn and resending a request once to the other
   replica when it fails before its answer is complete (connection error, HTTP error, an error
   event, no ``[DONE]``, a timeout). The fault is injected once a quarter of the load's requests
   are answered, at a moment when at least two requests are streaming their answers (waited
   for up to 5 s), so that it can cut a stream; the number streaming then is printed. After
   the load the deployment is brought back (the launcher restarts the engine itself; this
   script restarts a proxy replica or ``redis-server``) before the next fault.
3. Each answer is compared with the known one as text and as its number of completion tokens
   (``usage.completion_tokens`` of the stream, ``stream_options.include_usage``).

Columns: ``requests`` (turns sent), ``ok`` (answered, right or wrong), ``retried`` (resent to the
other replica by the client), ``migrated`` (the replicas' ``pdserve:proxy_migrations_total``
increase, ``-`` where the proxy has no such metric), ``failed`` (no answer after the resend),
``answers wrong`` (an answer whose text differs from the known one), ``tokens lost or duplicated``
(sum over answered requests of ``|completion tokens - known completion tokens|``, at least 1 for
an answer whose text differs), ``recovery s`` (from the
fault until the first request sent after it is answered right; probed after the load when none
in it was).

Usage::

    python benchmarks/fault_matrix.py            # every fault
    python benchmarks/fault_matrix.py --quick    # SIGKILL of a decoder and of a prefiller

Needs no GPU (``--device cpu`` by default). The link rows (P's side channel unreachable from D
for 10 s, P's link limited to 2 Mbit/s) run on a second deployment, a prefiller and a decoder in network
namespaces of their own (``benchmarks/fault_deployments.py``; the load is in
``benchmarks/fault_load.py``); they need root, ``ip netns`` and
``tc``, and print as skipped, with the reason, where those are missing (as the redis row does
without ``redis-server``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support.netns

from fault_deployments import NetnsPair, UpDeployment
from fault_load import Answer, Streaming, Turn, known_answers, stream_completion

MID_STREAM_WAIT_S = 5.0


# ------------------------------------------------------------------------------------ faults
@dataclass
class Fault:
    """One row: its name, the deployment it needs (``up`` or ``netns``), how to inject it and,
    for a fault that lasts, how to end it ``undo_after_s`` seconds later (None: it lasts until
    the deployment is restored after the load). ``inject`` None: skipped, ``skip`` says why."""

    name: str
    deployment: str = "up"
    inject: Callable | None = None
    undo: Callable | None = None
    undo_after_s: float = 0.0
    skip: str = ""


def busiest_decoder(dep: UpDeployment) -> str:
    """The decoder with the most running requests (``pdserve:num_requests_running`` on its
    ``/metrics``), so that a kill cuts streams in flight; ``decode-1`` on a tie."""
    def running(child: dict) -> float:
        try:
            text = httpx.get(f"http://127.0.0.1:{child['port']}/metrics", timeout=2.0).text
        except httpx.HTTPError:
            return -1.0
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("pdserve:num_requests_running"))
    decoders = [c for c in dep.read_status()["children"] if c["role"] == "decode"]
    return max(sorted(decoders, key=lambda c: c["name"] != "decode-1"), key=running)["name"]


def signal_engine(name: str, sig: int) -> Callable:
    """Send ``sig`` to engine ``name``, or to the busiest decoder for ``name == "decode"``."""
    def inject(dep: UpDeployment) -> None:
        if name == "decode":
            victim = busiest_decoder(dep)
            print(f"  (the busiest decoder: {victim})", flush=True)
        else:
            victim = name
        pid = dep.engine(victim)["pid"]
        dep.replaced[victim] = pid  # restore() waits for a new PID that serves
        os.kill(pid, sig)
    return inject


def signal_replica(sig: int) -> Callable:
    def inject(dep) -> None:
        dep.replicas[1].send_signal(sig)
    return inject


def stop_redis(dep) -> None:
    dep.redis.kill()
    dep.redis.wait()


def faults(quick: bool, redis: bool, netns_error: str | None) -> list[Fault]:
    """The rows of the matrix (``quick``: SIGKILL of a decoder and of a prefiller);
    ``netns_error``: why the namespace rows cannot run (None: they can)."""
    rows = [Fault("SIGKILL the busiest decoder", inject=signal_engine("decode", signal.SIGKILL)),
            Fault("SIGKILL prefill-1", inject=signal_engine("prefill-1", signal.SIGKILL))]
    if quick:
        return rows
    netns_skip = "" if netns_error is None else f"network namespaces unavailable: {netns_error}"
    rows += [
        Fault("SIGTERM the busiest decoder", inject=signal_engine("decode", signal.SIGTERM)),
        Fault("SIGTERM prefill-1", inject=signal_engine("prefill-1", signal.SIGTERM)),
        Fault("SIGKILL proxy replica 1", inject=signal_replica(signal.SIGKILL)),
        Fault("SIGTERM proxy replica 1", inject=signal_replica(signal.SIGTERM)),
        Fault("redis stopped", inject=stop_redis if redis else None,
              skip="" if redis else "redis-server is not installed"),
        Fault("P side channel unreachable (10 s)", "netns",
              inject=None if netns_skip else NetnsPair.block_side_channel,
              undo=NetnsPair.clear_link, undo_after_s=10.0, skip=netns_skip),
        Fault("slow link P-D (2 Mbit/s)", "netns",
              inject=None if netns_skip else (lambda dep: dep.slow_link("2mbit")),
              skip=netns_skip),
    ]
    return rows


@dataclass
class Row:
    """The counts of one fault."""

    fault: str
    requests: int = 0
    ok: int = 0
    retried: int = 0
    migrated: int | None = None
    failed: int = 0
    wrong: int = 0
    lost_or_duplicated: int = 0
    recovery_s: float | None = None
    skip: str = ""
    streams_at_fault: int = 0  # requests streaming their answers when the fault came
    not_injected: str = ""  # why the fault could not be injected (the row then means nothing)
    errors: list[str] = field(default_factory=list)


def _lost_or_duplicated(got: Answer, turn: Turn) -> int:
    count = abs((got.tokens if got.tokens is not None else turn.tokens) - turn.tokens)
    if got.text != turn.answer:
        count = max(count, 1)
    return count


def run_fault(dep: UpDeployment | NetnsPair, conversations: list[list[Turn]], fault: Fault,
              args: argparse.Namespace) -> Row:
    """Runs the load once with ``fault`` injected once a quarter of its requests are answered."""
    row = Row(fault.name, skip=fault.skip)
    if fault.inject is None:
        return row
    migrations_before = dep.migrations()
    lock = threading.Lock()
    fault_at: list[float] = []
    recovered: list[float] = []

    def send(turn: Turn, replica: int) -> Answer:
        extra = {"conversation_id": f"{fault.name}-{turn.conversation}"}
        return stream_completion(dep.replica_urls[replica], dep.model, turn.prompt,
                                 args.max_tokens, args.request_timeout, extra, streaming)

    def converse(turns: list[Turn]) -> None:
        for turn in turns:
            started = time.monotonic()
            replica = (turn.conversation + turn.index) % 2
            got = send(turn, replica)
            retried = got.error is not None
            if retried:
                first_error = got.error
                got = send(turn, 1 - replica)
            with lock:
                row.requests += 1
                row.retried += retried
                if got.error is not None:
                    row.failed += 1
                    row.errors.append(f"turn {turn.conversation}.{turn.index}: {first_error}; "
                                      f"resent: {got.error}")
                    continue
                row.ok += 1
                lost = _lost_or_duplicated(got, turn)
                row.lost_or_duplicated += lost
                if got.text != turn.answer:
                    row.wrong += 1
                    row.errors.append(f"turn {turn.conversation}.{turn.index}: wrong answer "
                                      f"{got.text!r}, known {turn.answer!r}")
                elif fault_at and started >= fault_at[0]:
                    recovered.append(time.monotonic())

    total = sum(len(turns) for turns in conversations)

    streaming = Streaming()

    def inject_later() -> None:
        # Once a quarter of the requests are answered and, where that comes within
        # MID_STREAM_WAIT_S, while at least two others are streaming their answers, so that the
        # fault can cut a stream.
        waited_since = None
        while True:
            with lock:
                if row.requests >= max(1, total // 4):
                    waited_since = waited_since or time.monotonic()
                    if streaming.count >= 2 or time.monotonic() - waited_since > MID_STREAM_WAIT_S:
                        fault_at.append(time.monotonic())
                        row.streams_at_fault = streaming.count
                        break
            time.sleep(0.005)
        try:
            fault.inject(dep)
        except Exception as exc:  # noqa: BLE001 - reported in the table, not a crash
            row.not_injected = f"{type(exc).__name__}: {exc}"
            return
        if fault.undo is not None:
            time.sleep(fault.undo_after_s)
            fault.undo(dep)

    injector = threading.Thread(target=inject_later, daemon=True)
    injector.start()
    with ThreadPoolExecutor(len(conversations)) as pool:
        list(pool.map(converse, conversations))
    injector.join()
    if not recovered:  # nothing sent after the fault was answered right: probe until one is
        turn = conversations[0][0]
        deadline = time.monotonic() + args.recovery_timeout
        while time.monotonic() < deadline:
            got = send(turn, 0)
            if got.error is None and got.text == turn.answer:
                recovered.append(time.monotonic())
                break
            time.sleep(0.5)
    if recovered:
        row.recovery_s = min(recovered) - fault_at[0]
    dep.restore(args.recovery_timeout)
    after = dep.migrations()
    if after is not None:
        row.migrated = after - (migrations_before or 0)
    return row


def table(rows: list[Row]) -> str:
    """The matrix as a Markdown table."""
    head = ("| fault | requests | ok | retried | migrated | failed | answers wrong | "
            "tokens lost or duplicated | recovery s |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.skip or r.not_injected:
            why = f"skipped: {r.skip}" if r.skip else f"NOT INJECTED: {r.not_injected}"
            lines.append(f"| {r.fault} | {why} | | | | | | | |")
            continue
        mig = "-" if r.migrated is None else str(r.migrated)
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        lines.append(f"| {r.fault} | {r.requests} | {r.ok} | {r.retried} | {mig} | {r.failed} "
                     f"| {r.wrong} | {r.lost_or_duplicated} | {rec} |")
    return "\n".join(lines)


def netns_unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can)."""
    from tests.support.netns import Hosts, NetnsUnavailable

    if os.geteuid() != 0:
        return "needs root"
    if shutil.which("tc") is None:
        return "the 'tc' command is not installed"  # the slow link's rate limit
    try:
        Hosts(["probe"]).close()
    except NetnsUnavailable as exc:
        return str(exc)
    return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="only SIGKILL of a decoder and of a prefiller, a small load (for CI)")
    p.add_argument("--only", action="append", default=[], metavar="TEXT",
                   help="only the rows whose fault names contain TEXT (repeatable)")
    p.add_argument("--model", default=None, help="model (default: a tiny random Llama)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--conversations", type=int, default=None, help="default 4 (quick: 2)")
    p.add_argument("--turns", type=int, default=None, help="turns each, default 4 (quick: 3)")
    p.add_argument("--max-tokens", type=int, default=32,
                   help="tokens per answer (default 32: long enough that faults hit streams)")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--recovery-timeout", type=float, default=180.0)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--work-dir", type=Path, default=None, help="logs (default: a temp dir)")
    p.add_argument("--json", type=Path, default=None, help="also write the rows here")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the matrix and prints the table; returns 1 if an answer was wrong, tokens were lost
    or duplicated or a fault could not be injected, else 0."""
    args = build_parser().parse_args(argv)
    args.conversations = args.conversations or (2 if args.quick else 4)
    args.turns = args.turns or (3 if args.quick else 4)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="pdserve-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        from pdserve.testing.tiny_models import make_tiny_model

        model = str(make_tiny_model(work / "tiny-llama", "llama"))
    print(f"fault matrix: model {model}, logs in {work}", flush=True)
    up_dep = UpDeployment(model, args.device, work, args.startup_timeout)
    up_dep.launch()  # it starts while the reference engine answers
    try:
        conversations = known_answers(model, args, work)
    except BaseException:
        up_dep.close()
        raise
    rows: list[Row] = []
    redis = shutil.which("redis-server") is not None
    netns_error = None if args.quick else netns_unavailable()
    plan = [f for f in faults(args.quick, redis, netns_error)
            if not args.only or any(word in f.name for word in args.only)]
    for kind in ("up", "netns"):
        todo = [f for f in plan if f.deployment == kind]
        if all(f.inject is None for f in todo):
            rows += [Row(f.name, skip=f.skip) for f in todo]
            if kind == "up":
                up_dep.close()
            continue
        hosts = None
        if kind == "up":
            dep = up_dep
        else:
            from tests.support.netns import Hosts

            hosts = Hosts(["p", "d"])
            dep = NetnsPair(model, work, hosts, args.startup_timeout)
        try:
            dep.start()
            print(f"{kind} deployment ready; state store "
                  f"{dep.state_store or 'memory (no redis-server)'}", flush=True)
            for fault in todo:
                row = run_fault(dep, conversations, fault, args)
                rows.append(row)
                print(f"  {fault.name}: " + (
                    f"not injected ({row.not_injected})" if row.not_injected else
                    f"{row.ok}/{row.requests} ok, {row.failed} failed, {row.wrong} wrong, "
                    f"{row.streams_at_fault} streaming when it came"),
                    flush=True)
                for error in row.errors:
                    print(f"    {error}", flush=True)
        finally:
            dep.close()
            if hosts is not None:
                hosts.close()
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    bad = any(r.wrong or r.lost_or_duplicated or r.not_injected for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
