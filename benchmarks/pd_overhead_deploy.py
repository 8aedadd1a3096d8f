"""The deployments and requests of benchmarks/pd_overhead.py: one engine, a P/D pair and one
``pdserve proxy`` per hand-off mode started together, word prompts fitted to token counts, and
one streamed chat request with its time to first token.

Imported by ``pd_overhead.py`` and ``pd_overhead_load.py`` (same folder); not a script.
"""

from __future__ import annotations

import argparse
import io
import json
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

SINGLE = "single"
HANDOFFS = ("sequential", "concurrent")
ENGINE_HOST = "127.0.0.1"
PREFIX_WORDS = 16  # random words per request and target at the head of the prompt
SYLLABLES = ["ka", "lo", "mi", "ten", "ra", "so", "vu", "pel", "dor", "an", "ex", "tri", "qua",
             "ne", "bi"]


# --------------------------------------------------------------------------- deployment
def _given(args: list[str], name: str) -> bool:
    return any(a == name or a.startswith(name + "=") for a in args)


def proxy_has_handoff_flag() -> bool:
    """Whether this checkout's ``pdserve proxy`` knows ``--handoff``."""
    res = subprocess.run([sys.executable, "-m", "pdserve.cli", "proxy", "--help"],
                         capture_output=True, text=True)
    return "--handoff" in res.stdout


class Deployment:
    """``single``, P, D and one proxy per hand-off mode, started together by pdserve.launcher's
    :class:`~pdserve.launcher.supervisor.Launcher` (own sessions, ``PR_SET_PDEATHSIG``;
    :meth:`stop` stops every process group)."""

    def __init__(self, args: argparse.Namespace, bidi: bool, log_dir: Path, handoff_flag: bool):
        from pdserve.launcher.plan import (ChildCommands, ChildSpec, kv_transfer_config,
                                           option_value)
        from pdserve.launcher.ports import allocate_free_ports
        from pdserve.utils.host_devices import detect_gpus, nixl_progress_thread_default

        self.log_dir = log_dir
        base = shlex.split(args.engine_args)
        if not _given(base, "--max-model-len"):
            base += ["--max-model-len", str(args.max_model_len)]
        gpu = None
        if args.device == "cuda":
            gpus = detect_gpus()
            if not gpus:
                raise SystemExit("--device cuda: no GPU visible")
            gpu = gpus[0]
            if not _given(base, "--kv-cache-memory"):
                util = float(option_value(base, "--gpu-memory-utilization") or 0.9)
                base += ["--gpu-memory-utilization", f"{util / 3:.3f}"]  # the last one wins
        single_args, d_args, p_args = list(base), list(base), list(base)
        if bidi:  # single hits the history in its prefix cache, P pulls it from D
            single_args = [a for a in single_args if a != "--no-enable-prefix-caching"]
            if "--enable-prefix-caching" not in base:
                p_args.append("--no-enable-prefix-caching")
        n_proxies = len(args.handoffs)
        ports = allocate_free_ports(5 + n_proxies, ENGINE_HOST)
        s_port, p_port, d_port, p_side, d_side = ports[:5]
        proxy_ports = ports[5:]
        cmds = ChildCommands()
        progress = nixl_progress_thread_default(args.device, [gpu] if gpu else [])
        engine_env = {"PYTHONUNBUFFERED": "1"}
        if gpu is not None:
            engine_env["CUDA_VISIBLE_DEVICES"] = gpu
        specs = [ChildSpec(
            name=SINGLE, role="single",
            argv=[sys.executable, "-m", "pdserve.cli", "serve", args.model, "--host", ENGINE_HOST,
                  "--port", str(s_port), "--device", args.device, *single_args],
            env=dict(engine_env), port=s_port, gpu=gpu)]
        for name, kv_role, port, side in (("prefill", "kv_producer", p_port, p_side),
                                          ("decode", "kv_consumer", d_port, d_side)):
            specs.append(ChildSpec(
                name=name, role=name,
                argv=cmds.engine(model=args.model, role=name, host=ENGINE_HOST, port=port,
                                 kv_config=kv_transfer_config(kv_role, bidi, progress),
                                 device=args.device,
                                 engine_args=p_args if name == "prefill" else d_args),
                env={**engine_env, "PDSERVE_NIXL_SIDE_CHANNEL_HOST": ENGINE_HOST,
                     "PDSERVE_NIXL_SIDE_CHANNEL_PORT": str(side)},
                port=port, side_channel_port=side, gpu=gpu))
        for handoff, port in zip(args.handoffs, proxy_ports):
            argv = cmds.proxy(host=ENGINE_HOST, port=port, prefillers=[(ENGINE_HOST, p_port)],
                              decoders=[(ENGINE_HOST, d_port)], multi_turn=bidi)
            if handoff_flag:
                argv += ["--handoff", handoff]
            specs.append(ChildSpec(name=f"pd-{handoff}", role="proxy", argv=argv, port=port,
                                   env={"PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}))
        self.specs = specs
        self.targets = {s.name: s.url for s in specs if s.role in ("single", "proxy")}
        self.engines = {"S": specs[0].url, "P": specs[1].url, "D": specs[2].url}
        self.launcher = None

    def start(self, timeout: float) -> float:
        """Starts everything and waits until every part answers ``/health``; returns the
        seconds it took. Raises SystemExit (with the launcher's report) if a part fails."""
        from pdserve.launcher.supervisor import Launcher

        self._out = io.StringIO()
        self.launcher = Launcher(self.specs, self.log_dir, startup_timeout=timeout,
                                 out=self._out)
        t = time.monotonic()
        self.launcher.start_all()
        if not self.launcher.wait_until_ready():
            raise SystemExit(f"deployment did not start; logs in {self.log_dir}\n"
                             + self._out.getvalue())
        return time.monotonic() - t

    def stop(self) -> None:
        if self.launcher is None:
            return
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut it
        try:
            self.launcher.stop_all(signal.SIGTERM)
        finally:
            signal.signal(signal.SIGINT, old)
            self.launcher = None


# --------------------------------------------------------------------------- requests
class Prompts:
    """Word prompts fitted to token counts with the engine's ``/tokenize``."""

    def __init__(self, client, url: str, seed: int):
        self.client, self.url = client, url
        self.rng = random.Random(seed)
        self.vocab = sorted({"".join(self.rng.choice(SYLLABLES)
                                     for _ in range(self.rng.randint(1, 3)))
                             for _ in range(4000)})
        self.per_word = 2.0  # tokens per word, refined by every count

    def head(self) -> str:
        """A random head for one request and target: one-syllable words (one token each with
        the SmolLM2 tokenizer, so every head renders to the same length)."""
        return " ".join(self.rng.choice(SYLLABLES) for _ in range(PREFIX_WORDS))

    def words(self, n: int, rng: random.Random | None = None) -> str:
        rng = rng or self.rng
        return " ".join(rng.choice(self.vocab) for _ in range(n))

    def count(self, messages: list[dict]) -> int:
        r = self.client.post(self.url + "/tokenize", json={"messages": messages})
        r.raise_for_status()
        return r.json()["count"]

    def fit(self, head: str, tokens: int, rng: random.Random) -> tuple[list[dict], int]:
        """A system message ``head`` and a user message of words from ``rng``, as many as make
        the rendered prompt about ``tokens`` tokens long (within 2, or the closest of 10
        tries); returns the messages and their token count."""
        pool = [rng.choice(self.vocab) for _ in range(2 * tokens + 64)]

        def build(n: int) -> list[dict]:
            return [{"role": "system", "content": head},
                    {"role": "user", "content": " ".join(pool[:n])}]

        best = None
        k = max(1, min(len(pool), round(tokens / self.per_word)))
        for _ in range(10):
            msgs = build(k)
            c = self.count(msgs)
            if best is None or abs(c - tokens) < abs(best[1] - tokens):
                best = (msgs, c)
            if abs(c - tokens) <= 2:
                break
            if k > 20:
                self.per_word = max(0.5, c / k)
            step = round((tokens - c) / self.per_word) or (1 if tokens > c else -1)
            k = max(1, min(len(pool), k + step))
        return best


def stream_chat(client, url: str, body: dict, group: str | None, mark) -> dict:
    """One streamed chat request; ``group`` names the client's trace marks around a counted
    request (``cl.send.G`` / ``cl.first`` / ``cl.end.G``). Returns its record."""
    text, usage, ttft = [], None, None
    if group:
        mark(f"cl.send.{group}")
    t0 = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:500]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if ttft is None and (delta.get("content") or choice.get("token_ids")):
                    ttft = time.perf_counter() - t0
                    if group:
                        mark("cl.first")
                text.append(delta.get("content") or "")
    total = time.perf_counter() - t0
    if group:
        mark(f"cl.end.{group}")
    usage = usage or {}
    return {"ttft_ms": None if ttft is None else 1e3 * ttft, "total_ms": 1e3 * total,
            "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "text": "".join(text)}


def _body(args: argparse.Namespace, messages: list[dict], cid: str | None = None) -> dict:
    body = {"messages": messages, "stream": True, "max_tokens": args.output_len,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    if cid is not None:
        body["conversation_id"] = cid
    return body


def _rotated(targets: list[str], k: int) -> list[str]:
    k %= len(targets)
    return targets[k:] + targets[:k]


def _fmt(v, spec: str = "8.1f", sign: bool = False) -> str:
    if v is None:
        return f"{'-':>{spec.split('.')[0]}}"
    return format(v, ("+" if sign else "") + spec)
