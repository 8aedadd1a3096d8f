"""KV-cache-aware routing vs round-robin, and Redis vs in-process multi-turn state, over 2P + 2D.

Starts two prefillers and two decoders (``pdserve serve``, NIXL, KV events on), and, in this
process, ``pdserve proxy`` instances in front of them; then runs the same multi-turn workload
(``--conversations`` conversations of ``--turns`` turns; each conversation starts with one of
``--system-prompts`` shared system prompts; every turn resends the whole history, streamed) in
three or four phases of the same run:

1. ``--routing round-robin``;
2. ``--routing kv-aware``;
3. ``--multi-turn`` with the in-process state store, and
4. ``--multi-turn --state-store redis://...`` (when ``redis-server`` is installed).

Each phase uses its own system prompts and questions (same lengths), so no phase finds the
caches warmed by another. Reported per phase: TTFT (client-side, first streamed content token:
mean, p50, p90), the prefill tokens the prefillers actually computed
(``pdserve:prompt_tokens_computed_total``, summed over both), and the proxy's own added latency
(mean of ``pdserve:proxy_added_latency_seconds``: proxy time before the first byte, without the
upstream waits; it includes the state store round trips and, for kv-aware, the prompt
tokenization).

Usage: ``python benchmarks/kv_routing.py [--model DIR|smollm2-135m-instruct] [--conversations 8]
[--turns 3] [--system-prompts 2] [--max-tokens 8] [--json-out FILE]``. Without ``--model`` a
tiny random Llama is written to a temporary directory (CPU-friendly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from pdserve.router.config import ProxyConfig
from pdserve.router.proxy import start_proxy

TOPICS = ["harbour", "lighthouse", "fishing fleet", "market square", "old mill", "river ferry",
          "cathedral", "salt works"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def system_prompt(phase: int, k: int) -> str:
    topic = TOPICS[(phase * 3 + k) % len(TOPICS)]
    return (f"[{phase}.{k}] You are a careful historian of the {topic} of an old coastal town. "
            "Answer every question about its people, its buildings, its trade, its weather and "
            "its records in detail, citing the year and the source of every fact you give, and "
            "say plainly when the records are silent. ") * 2


def question(phase: int, conv: int, turn: int) -> str:
    return f"Question {phase}.{conv}.{turn}: what happened in year {1700 + 13 * conv + turn}?"


class Engine:
    """One ``pdserve serve`` subprocess."""

    def __init__(self, model: str, name: str, role: str, log_dir: Path, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = name
        kv = {"kv_connector": "NixlConnector", "kv_role": role}
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", model, "--port", str(self.port),
               "--kv-transfer-config", json.dumps(kv),
               "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}",
               "--kv-events-snapshot-endpoint", f"tcp://127.0.0.1:{free_port()}", *extra]
        env = dict(os.environ, PDSERVE_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
                   PDSERVE_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        self.log = open(log_dir / f"{name}.log", "wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    async def wait_ready(self, session: aiohttp.ClientSession, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                async with session.get(self.url + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise TimeoutError(f"{self.name} not ready")

    async def counter(self, session: aiohttp.ClientSession, name: str) -> float:
        async with session.get(self.url + "/metrics") as r:
            text = await r.text()
        return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                   if line.startswith(name))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


async def chat_turn(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, str]:
    """One streamed chat turn: (TTFT in s, answer text)."""
    t0 = time.perf_counter()
    ttft = None
    parts = []
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {await r.text()}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                text = (choice.get("delta") or {}).get("content")
                if text:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    parts.append(text)
    return (ttft if ttft is not None else time.perf_counter() - t0), "".join(parts)


async def run_phase(session, engines, args, phase: int, config: ProxyConfig) -> dict:
    running = await start_proxy(config)
    try:
        if running.proxy.kv_router is not None:
            urls = config.prefillers + config.decoders
            deadline = time.monotonic() + 60
            while not running.proxy.kv_router.live(urls):
                if time.monotonic() > deadline:
                    raise TimeoutError("KV events not live")
                await asyncio.sleep(0.1)
        prefillers = [e for e in engines if e.url in config.prefillers]
        computed0 = sum([await e.counter(session, "pdserve:prompt_tokens_computed_total")
                         for e in prefillers])
        ttfts: list[float] = []

        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": system_prompt(phase, c % args.system_prompts)}]
            for t in range(args.turns):
                messages.append({"role": "user", "content": question(phase, c, t)})
                body = {"model": args.model_name, "messages": messages, "stream": True,
                        "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                        "conversation_id": f"bench-{phase}-{c}"}
                ttft, text = await chat_turn(session, running.url, body)
                ttfts.append(ttft)
                messages.append({"role": "assistant", "content": text})

        # conversations start one after another (a shared prompt is cached once before it is
        # reused) and then run side by side
        tasks = []
        for c in range(args.conversations):
            tasks.append(asyncio.ensure_future(conversation(c)))
            await asyncio.sleep(args.stagger)
        await asyncio.gather(*tasks)
        await asyncio.sleep(0.5)  # engines publish counters with their step outputs
        computed = sum([await e.counter(session, "pdserve:prompt_tokens_computed_total")
                        for e in prefillers]) - computed0
        reg = running.proxy.metrics.registry
        added = (reg.get_sample_value("pdserve:proxy_added_latency_seconds_sum")
                 / max(1.0, reg.get_sample_value("pdserve:proxy_added_latency_seconds_count")))
        # p50 bound from the histogram: the smallest bucket bound holding half the requests
        count = reg.get_sample_value("pdserve:proxy_added_latency_seconds_count") or 0.0
        p50_bound = None
        for metric in reg.collect():
            if metric.name == "pdserve:proxy_added_latency_seconds":
                for smp in metric.samples:
                    if (smp.name.endswith("_bucket") and p50_bound is None
                            and smp.value >= count / 2):
                        p50_bound = float(smp.labels["le"])
        store_errors = sum(reg.get_sample_value("pdserve:proxy_state_store_errors_total",
                                                {"op": op}) or 0.0 for op in ("load", "record"))
        decisions = {f"{s.labels['leg']}/{s.labels['reason']}": s.value
                     for metric in reg.collect() if metric.name == "pdserve:proxy_routing_decisions"
                     for s in metric.samples if s.name.endswith("_total")}
        ttfts.sort()
        return {"turns": len(ttfts), "ttft_mean_ms": 1e3 * statistics.fmean(ttfts),
                "ttft_p50_ms": 1e3 * ttfts[len(ttfts) // 2],
                "ttft_p90_ms": 1e3 * ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
                "p_computed_tokens": computed, "proxy_added_ms_mean": 1e3 * added,
                "proxy_added_ms_p50_at_most": None if p50_bound is None else 1e3 * p50_bound,
                "state_store_errors": store_errors,
                "decisions": decisions}
    finally:
        await running.close()


async def main_async(args: argparse.Namespace) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-kv-routing-"))
    model = args.model
    if model is None:
        from pdserve.testing.tiny_models import make_tiny_model

        model = str(make_tiny_model(log_dir / "tiny-llama", "llama"))
    args.model_name = model
    common = ["--block-size", "16", "--num-gpu-blocks-override", str(args.num_blocks),
              "--max-model-len", "1024"]
    engines = [Engine(model, f"p{i}", "kv_producer", log_dir, common) for i in range(2)]
    engines += [Engine(model, f"d{i}", "kv_consumer", log_dir, common) for i in range(2)]
    redis = None
    redis_url = None
    if shutil.which("redis-server"):
        redis_port = free_port()
        redis = subprocess.Popen(["redis-server", "--port", str(redis_port), "--save", "",
                                  "--appendonly", "no"], stdout=subprocess.DEVNULL)
        redis_url = f"redis://127.0.0.1:{redis_port}/0"
    results: dict = {"model": model, "logs": str(log_dir), "args": {
        k: v for k, v in vars(args).items() if k != "json_out"}}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            deadline = time.monotonic() + args.startup_timeout
            for e in engines:
                await e.wait_ready(session, deadline)
            base = dict(host="127.0.0.1", port=0, prefillers=(engines[0].url, engines[1].url),
                        decoders=(engines[2].url, engines[3].url))
            phases = [("round-robin", ProxyConfig(**base, routing="round-robin")),
                      ("kv-aware", ProxyConfig(**base, routing="kv-aware", tokenizer=model)),
                      ("multi-turn, memory state", ProxyConfig(**base, multi_turn=True))]
            if redis_url:
                phases.append(("multi-turn, redis state",
                               ProxyConfig(**base, multi_turn=True, state_store=redis_url)))
            for i, (name, config) in enumerate(phases):
                results[name] = await run_phase(session, engines, args, i, config)
                print(f"{name}: {json.dumps(results[name])}", flush=True)
    finally:
        for e in engines:
            e.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model (default: a tiny random Llama)")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system-prompts", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--stagger", type=float, default=0.2,
                    help="seconds between the starts of two conversations")
    ap.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per engine")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--json-out", help="also write the figures to this JSON file")
    args = ap.parse_args()
    results = asyncio.run(main_async(args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
