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
   are answered (the others are in flight or still to come). After the load the deployment is brought back (the launcher restarts the engine
   itself; this script restarts a proxy replica or ``redis-server``) before the next fault.
3. Each answer is compared with the known one as text and as its number of completion tokens
   (``usage.completion_tokens`` of the stream, ``stream_options.include_usage``).

Columns: ``requests`` (turns sent), ``ok`` (answered, right or wrong), ``retried`` (resent to the
other replica by the client), ``migrated`` (the replicas' ``pdserve:proxy_migrations_total``
increase, ``-`` where the proxy has no such metric), ``failed`` (no answer after the resend),
``answers wrong`` (an answer whose text differs from the known one), ``tokens lost or duplicated``
(sum over answered requests of ``|completion tokens - known completion tokens|``, and, where the
texts differ, the characters of the known answer missing or repeated), ``recovery s`` (from the
fault until the first request sent after it is answered right; probed after the load when none
in it was).

Usage::

    python benchmarks/fault_matrix.py            # every fault
    python benchmarks/fault_matrix.py --quick    # SIGKILL of a decoder and of a prefiller

Needs no GPU (``--device cpu`` by default); the slow-link and side-channel rows need root and
network namespaces and are not run by this version (they print as skipped, with the reason).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

QUESTIONS = ["Tell me about rivers.", "And the mountains?", "What about the sea?",
             "Name a city.", "Why is the sky blue?"]
ENGINE_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--block-size", "16",
               "--num-gpu-blocks-override", "1024"]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen | None, timeout_s: float, what: str) -> None:
    """Waits until ``url`` answers 200.

    Raises:
        SystemExit: ``proc`` exited or ``timeout_s`` passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{what} not ready after {timeout_s:.0f} s ({url})")


def stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """Stops ``proc`` with ``sig`` (SIGKILL after ``timeout_s``) and reaps it."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---------------------------------------------------------------------------- conversations
@dataclass(frozen=True)
class Turn:
    """One request of the load: its prompt and the known greedy answer."""

    conversation: int
    index: int
    prompt: str
    answer: str = ""
    tokens: int = 0


def prompt_of(history: list[tuple[str, str]], question: str) -> str:
    """The completion prompt of a turn after ``history`` (question, answer pairs)."""
    text = "A conversation.\n"
    for q, a in history:
        text += f"User: {q}\nAssistant:{a}\n"
    return text + f"User: {question}\nAssistant:"


@dataclass
class Answer:
    """What a streamed completion returned: its text, completion tokens and whether it ended."""

    text: str = ""
    tokens: int | None = None
    done: bool = False
    error: str | None = None


def stream_completion(url: str, model: str, prompt: str, max_tokens: int, timeout_s: float,
                      extra: dict | None = None) -> Answer:
    """One greedy streamed ``/v1/completions`` request; never raises (errors go in
    :attr:`Answer.error`)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, **(extra or {})}
    out = Answer()
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body,
                          timeout=httpx.Timeout(timeout_s)) as resp:
            if resp.status_code != 200:
                resp.read()
                out.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
                return out
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    out.done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    out.error = f"error event: {event['error']}"
                    return out
                for choice in event.get("choices") or []:
                    out.text += choice.get("text") or ""
                if event.get("usage"):
                    out.tokens = event["usage"].get("completion_tokens")
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        out.error = f"{type(exc).__name__}: {exc}"
    if out.error is None and not out.done:
        out.error = "stream ended without [DONE]"
    return out


def known_answers(model: str, args: argparse.Namespace, work: Path) -> list[list[Turn]]:
    """Every turn of every conversation, answered by one plain engine (greedy)."""
    port = free_port()
    log = open(work / "reference.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "serve", model, "--port",
                             str(port), "--device", args.device, *ENGINE_ARGS],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc, args.startup_timeout, "the reference engine")
        conversations = []
        for c in range(args.conversations):
            history: list[tuple[str, str]] = []
            turns = []
            for t in range(args.turns):
                question = QUESTIONS[(c + t) % len(QUESTIONS)] + f" (#{c})"
                prompt = prompt_of(history, question)
                ans = stream_completion(url, model, prompt, args.max_tokens, 120)
                if ans.error:
                    raise SystemExit(f"reference engine: {ans.error}")
                turns.append(Turn(c, t, prompt, ans.text, ans.tokens or 0))
                history.append((question, ans.text))
            conversations.append(turns)
        return conversations
    finally:
        stop(proc)
        log.close()


# ----------------------------------------------------------------------------- deployment
class Deployment:
    """``pdserve up`` (2 P, 2 D), two proxy replicas and, when installed, ``redis-server``.

    Args:
        model: model path; args: the command line; work: directory for logs.
    """

    def __init__(self, model: str, args: argparse.Namespace, work: Path):
        self.model, self.args, self.work = model, args, work
        self.up: subprocess.Popen | None = None
        self.redis: subprocess.Popen | None = None
        self.redis_port = free_port()
        self.replicas: list[subprocess.Popen | None] = [None, None]
        self.replica_ports = [free_port(), free_port()]
        self.status: dict = {}
        self.replaced: dict[str, int] = {}  # engine name -> the PID a fault ended

    @property
    def replica_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.replica_ports]

    @property
    def state_store(self) -> str | None:
        return None if self.redis is None else f"redis://127.0.0.1:{self.redis_port}/0"

    def start(self) -> None:
        """Starts everything and waits until it serves.

        Raises:
            SystemExit: a part did not come up.
        """
        if shutil.which("redis-server"):
            self.start_redis()
        log_dir = self.work / "up"
        self.up = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", "up", self.model, "--num-prefillers", "2",
             "--num-decoders", "2", "--multi-turn", "--device", self.args.device, "--port", "0",
             "--log-dir", str(log_dir), "--restart-window", "600", "--", *ENGINE_ARGS],
            stdout=open(self.work / "up.out", "wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.args.startup_timeout
        while self.read_status().get("state") != "ready":
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"pdserve up did not become ready; see {self.work / 'up.out'}")
            time.sleep(0.5)
        for i in range(2):
            self.start_replica(i)

    def read_status(self) -> dict:
        try:
            self.status = json.loads((self.work / "up" / "pdserve-up.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            pass
        return self.status

    def engine(self, name: str) -> dict:
        """The status entry of engine ``name`` (``prefill-1``, ``decode-1``)."""
        return next(c for c in self.read_status()["children"] if c["name"] == name)

    def engines_serving(self) -> bool:
        status = self.read_status()
        return status.get("state") == "ready" and all(
            c.get("state", "serving") == "serving" and self.replaced.get(c["name"]) != c["pid"]
            for c in status["children"])

    def start_redis(self) -> None:
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no"], stdout=open(self.work / "redis.log", "ab"),
            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.redis_port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("redis-server did not start")

    def start_replica(self, i: int) -> None:
        status = self.read_status()
        prefill = [c for c in status["children"] if c["role"] == "prefill"]
        decode = [c for c in status["children"] if c["role"] == "decode"]
        argv = [sys.executable, "-m", "pdserve.cli", "proxy", "--port",
                str(self.replica_ports[i]), "--multi-turn",
                "--prefiller-ports", *[str(c["port"]) for c in prefill],
                "--decoder-ports", *[str(c["port"]) for c in decode]]
        if self.state_store:
            argv += ["--state-store", self.state_store]
        self.replicas[i] = subprocess.Popen(
            argv, stdout=open(self.work / f"replica-{i}.log", "ab"), stderr=subprocess.STDOUT)
        wait_http(self.replica_urls[i] + "/health", self.replicas[i], 120, f"proxy replica {i}")

    def restore(self, timeout_s: float) -> None:
        """Brings back what a fault took down: a replica, redis; waits for the engines."""
        if self.redis is not None and self.redis.poll() is not None:
            self.start_redis()
        for i, proc in enumerate(self.replicas):
            if proc is None or proc.poll() is not None:
                self.start_replica(i)
        deadline = time.monotonic() + timeout_s
        while not self.engines_serving():
            if self.up.poll() is not None:
                raise SystemExit(f"pdserve up stopped (exit {self.up.returncode}); see "
                                 f"{self.work / 'up.out'}")
            if time.monotonic() > deadline:
                raise SystemExit("the engines did not come back")
            time.sleep(0.3)

    def migrations(self) -> int | None:
        """Sum of ``pdserve:proxy_migrations_total`` over the live replicas (None: no metric)."""
        total, seen = 0.0, False
        for url in self.replica_urls:
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            for line in text.splitlines():
                m = re.match(r"^pdserve:proxy_migrations_total(?:\{[^}]*\})? ([0-9.eE+-]+)$",
                             line)
                if m:
                    total += float(m.group(1))
                    seen = True
        return int(total) if seen else None

    def close(self) -> None:
        for proc in self.replicas:
            stop(proc)
        stop(self.up, signal.SIGINT, 90)
        stop(self.redis)


# ------------------------------------------------------------------------------------ faults
@dataclass
class Fault:
    """One row: a name, how to inject it (None: skipped, with ``skip`` saying why)."""

    name: str
    inject: object = None
    skip: str = ""


def signal_engine(name: str, sig: int):
    def inject(dep: Deployment) -> None:
        pid = dep.engine(name)["pid"]
        dep.replaced[name] = pid  # restore() waits for a new PID that serves
        os.kill(pid, sig)
    return inject


def signal_replica(sig: int):
    def inject(dep: Deployment) -> None:
        dep.replicas[1].send_signal(sig)
    return inject


def stop_redis(dep: Deployment) -> None:
    dep.redis.kill()
    dep.redis.wait()


def faults(dep: Deployment, quick: bool) -> list[Fault]:
    """The rows of the matrix (``quick``: SIGKILL of a decoder and of a prefiller)."""
    rows = [Fault("SIGKILL decode-1", signal_engine("decode-1", signal.SIGKILL)),
            Fault("SIGKILL prefill-1", signal_engine("prefill-1", signal.SIGKILL))]
    if quick:
        return rows
    no_root = "" if os.geteuid() == 0 else "needs root; "
    rows += [
        Fault("SIGTERM decode-1", signal_engine("decode-1", signal.SIGTERM)),
        Fault("SIGTERM prefill-1", signal_engine("prefill-1", signal.SIGTERM)),
        Fault("SIGKILL proxy replica 1", signal_replica(signal.SIGKILL)),
        Fault("SIGTERM proxy replica 1", signal_replica(signal.SIGTERM)),
        Fault("redis stopped", stop_redis if dep.redis is not None else None,
              "" if dep.redis is not None else "redis-server is not installed"),
        Fault("side channel unreachable", None,
              no_root + "not built yet (a peer's side channel blocked in a network namespace)"),
        Fault("slow link P-D", None,
              no_root + "not built yet (P and D in network namespaces with a netem delay)"),
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
    errors: list[str] = field(default_factory=list)


def _lost_or_duplicated(got: Answer, turn: Turn) -> int:
    count = abs((got.tokens if got.tokens is not None else turn.tokens) - turn.tokens)
    if got.text != turn.answer:
        count = max(count, 1)
    return count


def run_fault(dep: Deployment, conversations: list[list[Turn]], fault: Fault,
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
                                 args.max_tokens, args.request_timeout, extra)

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

    def inject_later() -> None:  # once a quarter of the requests are answered
        while True:
            with lock:
                if row.requests >= max(1, total // 4):
                    fault_at.append(time.monotonic())
                    break
            time.sleep(0.02)
        fault.inject(dep)

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
        if r.skip:
            lines.append(f"| {r.fault} | skipped: {r.skip} | | | | | | | |")
            continue
        mig = "-" if r.migrated is None else str(r.migrated)
        rec = "-" if r.recovery_s is None else f"{r.recovery_s:.1f}"
        lines.append(f"| {r.fault} | {r.requests} | {r.ok} | {r.retried} | {mig} | {r.failed} "
                     f"| {r.wrong} | {r.lost_or_duplicated} | {rec} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="only SIGKILL of a decoder and of a prefiller, a small load (for CI)")
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
    """Runs the matrix and prints the table; returns 1 if an answer was wrong or tokens were
    lost or duplicated, else 0."""
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
    conversations = known_answers(model, args, work)
    dep = Deployment(model, args, work)
    rows: list[Row] = []
    try:
        dep.start()
        print(f"deployment ready; state store {dep.state_store or 'memory (no redis-server)'}",
              flush=True)
        for fault in faults(dep, args.quick):
            row = run_fault(dep, conversations, fault, args)
            rows.append(row)
            print(f"  {fault.name}: {row.ok}/{row.requests} ok, {row.failed} failed, "
                  f"{row.wrong} wrong" if not row.skip else f"  {fault.name}: skipped",
                  flush=True)
            for error in row.errors:
                print(f"    {error}", flush=True)
    finally:
        dep.close()
    print()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    bad = any(r.wrong or r.lost_or_duplicated for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
