"""Serving throughput: N concurrent requests through ``pdserve serve`` vs ``transformers.generate``.

Both sides get the same model (default: the built-in SmolLM2-135M-Instruct), the same dtype,
the same fixed prompts and the same output length per request (``ignore_eos`` on the server,
``min_new_tokens = max_new_tokens`` for ``transformers``), greedy decoding. The server is started
as a subprocess on a free port, warmed up with one request, then sent all N requests at once
through ``POST /v1/completions``; its throughput is total completion tokens (from ``usage``) over
the wall time from the first request sent to the last response received. Then the server is
stopped and ``transformers`` runs the same prompts as one left-padded batch (or batches of
``--hf-batch-size``), timed after a warm-up. The two never run at the same time.

Prints output tokens/s of both and their ratio; ``--json`` also writes the figures to a file.

Examples::

    python benchmarks/throughput.py                       # 32 requests x 128 tokens, SmolLM2
    python benchmarks/throughput.py --num-requests 8 --output-len 32 --model /path/to/hf-dir
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# Fixed prompts (cycled; the request index is appended so that every prompt is distinct and the
# prefix cache cannot serve one request from another's full prompt).
PROMPTS = [
    "Explain in simple words how a refrigerator keeps food cold, and why it needs electricity.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List some practical tips for learning a new language as an adult with a busy schedule.",
    "Describe the water cycle, from evaporation over the ocean to rain falling on a mountain.",
    "What are the main differences between a bicycle and a motorcycle? Answer in detail.",
    "Summarise the rules of chess for someone who has never played a board game before.",
    "Give a recipe for a simple vegetable soup and explain each step of the preparation.",
    "Why is the sky blue during the day and red or orange at sunset? Explain the physics.",
]


def make_prompts(n: int) -> list[str]:
    """``n`` distinct prompts: the fixed texts, cycled, each tagged with its index."""
    return [f"{PROMPTS[i % len(PROMPTS)]} (Question {i + 1}.)" for i in range(n)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------ server
def start_server(args: argparse.Namespace, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve.cli", "serve", args.model, "--port", str(port),
           "--dtype", args.dtype, "--device", args.device, "--log-level", "warning",
           *shlex.split(args.serve_args)]
    print(f"[server] {' '.join(shlex.quote(c) for c in cmd)}  (log: {log_path})", flush=True)
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def wait_healthy(proc: subprocess.Popen, base: str, timeout_s: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            sys.exit(f"server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            sys.exit(f"server not healthy after {timeout_s:.0f} s")
        time.sleep(0.25)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


async def run_requests(base: str, model: str, prompts: list[str], output_len: int
                       ) -> tuple[float, int]:
    """Sends all prompts at once; returns (wall seconds, total completion tokens)."""
    limits = httpx.Limits(max_connections=len(prompts) + 1)
    async with httpx.AsyncClient(base_url=base, timeout=3600, limits=limits) as client:
        async def one(prompt: str) -> int:
            r = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": output_len,
                "temperature": 0, "ignore_eos": True})
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        await one(prompts[0])  # warm-up (first-request costs are not throughput)
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return time.perf_counter() - t0, sum(counts)


def bench_server(args: argparse.Namespace, prompts: list[str]) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    log_path = Path(args.log_dir) / "throughput-server.log"
    proc = start_server(args, port, log_path)
    try:
        wait_healthy(proc, base, args.startup_timeout, log_path)
        model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
        seconds, tokens = asyncio.run(run_requests(base, model, prompts, args.output_len))
    finally:
        stop_server(proc)
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


# ------------------------------------------------------------------------------ transformers
def bench_transformers(args: argparse.Namespace, prompts: list[str]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.model_files.builtin_models import resolve_model_path

    path = resolve_model_path(args.model)
    dtype = {"auto": torch.float32 if args.device != "cuda" else torch.bfloat16,
             "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    device = "cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu"
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    batch_size = args.hf_batch_size or len(prompts)

    def generate(batch: list[str], new_tokens: int) -> int:
        enc = tok(batch, return_tensors="pt", padding=True).to(device)
        with torch.inference_mode():
            out = model.generate(**enc, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=tok.pad_token_id)
        generated = out.shape[1] - enc["input_ids"].shape[1]
        assert generated == new_tokens, (generated, new_tokens)
        return generated * len(batch)

    generate(prompts[:1], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(generate(prompts[i:i + batch_size], args.output_len)
                 for i in range(0, len(prompts), batch_size))
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
            "batch_size": batch_size, "dtype": str(dtype).removeprefix("torch."),
            "device": device}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per request")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--hf-batch-size", type=int, default=0,
                   help="transformers batch size (default: all requests in one batch)")
    p.add_argument("--serve-args", default="",
                   help="extra 'pdserve serve' options, e.g. \"--kv-cache-memory 1GiB\"")
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp"))
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    prompts = make_prompts(args.num_requests)
    print(f"{args.num_requests} requests x {args.output_len} output tokens, model {args.model}, "
          f"dtype {args.dtype}, device {args.device}", flush=True)
    results: dict = {"num_requests": args.num_requests, "output_len": args.output_len,
                     "model": args.model}
    results["pdserve"] = srv = bench_server(args, prompts)
    print(f"pdserve serve : {srv['output_tokens']} tokens in {srv['seconds']:.2f} s = "
          f"{srv['tokens_per_s']:.1f} output tokens/s", flush=True)
    if not args.skip_transformers:
        results["transformers"] = hf = bench_transformers(args, prompts)
        print(f"transformers  : {hf['output_tokens']} tokens in {hf['seconds']:.2f} s = "
              f"{hf['tokens_per_s']:.1f} output tokens/s (batch {hf['batch_size']}, "
              f"{hf['dtype']}, {hf['device']})", flush=True)
        results["ratio"] = srv["tokens_per_s"] / hf["tokens_per_s"]
        print(f"ratio pdserve / transformers: {results['ratio']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
