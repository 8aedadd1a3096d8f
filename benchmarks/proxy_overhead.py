"""How much latency and throughput cost the disaggregation proxy adds, against instant upstreams.

Starts, each in its own process: a fake prefill instance and a fake decode instance that answer
at once (aiohttp; P returns ``kv_transfer_params``, D a completion or an SSE stream), and
``pdserve proxy`` in front of them. This process is the client and measures, in the same run:

* **direct**: the client itself makes the two calls the proxy makes (P with the prefill-leg body,
  then D with P's params), so "added" is what the proxy costs beyond the legs it must make;
* **proxy**: the same request through the proxy.

Latency is measured one request at a time (blocks of direct and proxy requests alternate, so
machine noise hits both alike); throughput with ``--concurrency`` requests in flight for
``--duration`` seconds. Targets (issue #4): p50 added latency < 1 ms and >= 1,000 requests/s from
one proxy process on the 2-core development machine.

Usage: ``python benchmarks/proxy_overhead.py [--requests 2000] [--concurrency 32]
[--duration 5] [--stream] [--migration-limit N] [--json-out FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time

import aiohttp

try:
    import uvloop
except ImportError:  # the stdlib loop works, only slower
    uvloop = None

PROMPT = {"model": "bench", "prompt": "The quick brown fox jumps over the lazy dog. " * 8,
          "max_tokens": 16, "temperature": 0.0}
P_PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "bench-p",
            "remote_block_ids": list(range(8)), "remote_host": "127.0.0.1", "remote_port": 5600,
            "remote_request_id": "r", "tp_size": 1}


# --------------------------------------------------------------------------- fake upstream
def serve_fake(role: str, stream_events: int) -> None:
    """Run an instant fake instance on a free port; prints ``PORT <n>`` when ready."""
    from aiohttp import web

    p_body = json.dumps({"id": "cmpl-p", "object": "text_completion",
                         "choices": [{"index": 0, "text": "T", "finish_reason": "length"}],
                         "kv_transfer_params": P_PARAMS}).encode()
    d_body = json.dumps({"id": "cmpl-d", "object": "text_completion",
                         "choices": [{"index": 0, "text": " tok" * 16, "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 80, "completion_tokens": 16,
                                   "total_tokens": 96}}).encode()
    event = b'data: {"id":"cmpl-d","object":"text_completion","choices":[{"index":0,"text":" tok"}]}\n\n'
    d_stream = event * stream_events + b"data: [DONE]\n\n"

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if role == "prefill":
            return web.Response(body=p_body, content_type="application/json")
        if not body.get("stream"):
            return web.Response(body=d_body, content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(d_stream)
        await resp.write_eof()
        return resp

    async def main() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", generate)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0, backlog=1024)
        await site.start()
        print(f"PORT {runner.addresses[0][1]}", flush=True)
        await asyncio.Event().wait()

    (uvloop.run if uvloop else asyncio.run)(main())


def start_process(args: list[str], pattern: str) -> tuple[subprocess.Popen, str]:
    """Start a child and wait (up to 60 s) for a stdout line matching ``pattern`` (1 group)."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        m = re.search(pattern, line)
        if m:
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError(f"{args} did not start")


# --------------------------------------------------------------------------- client side
class Client:
    """The two ways of getting one answer: the legs by hand (direct) or through the proxy."""

    def __init__(self, session: aiohttp.ClientSession, p_url: str, d_url: str, proxy_url: str,
                 stream: bool):
        self.session = session
        self.p_url, self.d_url, self.proxy_url = p_url, d_url, proxy_url
        body = dict(PROMPT, stream=stream)
        self.client_body = json.dumps(body).encode()
        p_leg = dict(body, max_tokens=1, stream=False, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None})
        self.p_body = json.dumps(p_leg).encode()
        self.headers = {"Content-Type": "application/json"}

    async def _post(self, url: str, data: bytes) -> bytes:
        async with self.session.post(url, data=data, headers=self.headers) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: HTTP {r.status}: {raw[:200]!r}")
            return raw

    async def direct(self) -> None:
        p = json.loads(await self._post(self.p_url, self.p_body))
        d_body = json.loads(self.client_body)
        d_body["kv_transfer_params"] = p["kv_transfer_params"]
        await self._post(self.d_url, json.dumps(d_body).encode())

    async def proxied(self) -> None:
        await self._post(self.proxy_url, self.client_body)


async def latencies(client: Client, n: int, block: int = 100) -> tuple[list[float], list[float]]:
    """Sequential latencies (s) of ``n`` direct and ``n`` proxied requests, in alternating blocks."""
    direct, proxied = [], []
    for _ in range(max(1, n // block)):
        for fn, out in ((client.direct, direct), (client.proxied, proxied)):
            for _ in range(block):
                t = time.perf_counter()
                await fn()
                out.append(time.perf_counter() - t)
    return direct, proxied


async def throughput(fn, concurrency: int, duration: float) -> float:
    """Requests per second with ``concurrency`` requests in flight for ``duration`` seconds."""
    done = 0
    stop = time.perf_counter() + duration

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await fn()
            done += 1

    t = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return done / (time.perf_counter() - t)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds used so far by process ``pid`` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def proxy_histogram_mean(session: aiohttp.ClientSession, base: str) -> float:
    """Mean of the proxy's own ``pdserve:proxy_added_latency_seconds`` (s)."""
    async with session.get(base + "/metrics") as r:
        text = await r.text()
    total = float(re.search(r"^pdserve:proxy_added_latency_seconds_sum (\S+)", text, re.M).group(1))
    count = float(re.search(r"^pdserve:proxy_added_latency_seconds_count (\S+)", text, re.M).group(1))
    return total / count if count else float("nan")


async def run(args: argparse.Namespace, p_port: str, d_port: str, proxy_url: str,
              proxy_pid: int) -> dict:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        client = Client(session, f"http://127.0.0.1:{p_port}/v1/completions",
                        f"http://127.0.0.1:{d_port}/v1/completions",
                        proxy_url + "/v1/completions", args.stream)
        for _ in range(200):  # warm up connections and code paths
            await client.direct()
            await client.proxied()
        direct, proxied = await latencies(client, args.requests)
        rps_direct = await throughput(client.direct, args.concurrency, args.duration)
        cpu0, t0 = cpu_seconds(proxy_pid), time.perf_counter()
        rps_proxy = await throughput(client.proxied, args.concurrency, args.duration)
        cpu_per_request = (cpu_seconds(proxy_pid) - cpu0) / (rps_proxy * (time.perf_counter() - t0))
        own_mean = await proxy_histogram_mean(session, proxy_url)
    res = {
        "stream": args.stream, "requests": len(proxied), "concurrency": args.concurrency,
        "direct_p50_ms": pct(direct, 50) * 1e3, "direct_p99_ms": pct(direct, 99) * 1e3,
        "proxy_p50_ms": pct(proxied, 50) * 1e3, "proxy_p99_ms": pct(proxied, 99) * 1e3,
        "direct_mean_ms": statistics.fmean(direct) * 1e3, "proxy_mean_ms": statistics.fmean(proxied) * 1e3,
        "direct_rps": rps_direct, "proxy_rps": rps_proxy,
        "proxy_own_added_mean_ms": own_mean * 1e3,
        "proxy_cpu_us_per_request": cpu_per_request * 1e6,
        "load_average_1min": os.getloadavg()[0],
    }
    res["added_p50_ms"] = res["proxy_p50_ms"] - res["direct_p50_ms"]
    res["added_p99_ms"] = res["proxy_p99_ms"] - res["direct_p99_ms"]
    return res


def report(res: dict) -> None:
    mode = "streaming (SSE)" if res["stream"] else "non-streaming"
    print(f"\nproxy overhead, {mode}, {res['requests']} sequential requests per side, "
          f"throughput at concurrency {res['concurrency']}, {os.cpu_count()} CPUs")
    print(f"{'':24}{'direct (P then D)':>19}{'via proxy':>12}{'added':>10}")
    for label, key in (("latency p50 (ms)", "p50_ms"), ("latency p99 (ms)", "p99_ms"),
                       ("latency mean (ms)", "mean_ms")):
        d, p = res[f"direct_{key}"], res[f"proxy_{key}"]
        print(f"{label:24}{d:19.3f}{p:12.3f}{p - d:10.3f}")
    print(f"{'requests/s':24}{res['direct_rps']:19.0f}{res['proxy_rps']:12.0f}")
    print(f"proxy's own added-latency histogram: mean {res['proxy_own_added_mean_ms']:.3f} ms")
    print(f"proxy CPU per request: {res['proxy_cpu_us_per_request']:.0f} us "
          f"(one free core would serve about {1e6 / res['proxy_cpu_us_per_request']:.0f} req/s); "
          f"machine load average during the run: {res['load_average_1min']:.2f}")
    ok_lat = res["added_p50_ms"] < 1.0
    ok_rps = res["proxy_rps"] >= 1000
    print(f"targets: p50 added < 1 ms: {'met' if ok_lat else 'MISSED'} ({res['added_p50_ms']:.3f} ms); "
          f">= 1000 req/s: {'met' if ok_rps else 'MISSED'} ({res['proxy_rps']:.0f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="sequential requests per side")
    ap.add_argument("--concurrency", type=int, default=32, help="requests in flight for throughput")
    ap.add_argument("--duration", type=float, default=5.0, help="seconds per throughput run")
    ap.add_argument("--stream", action="store_true", help="streaming requests (D sends 16 SSE events)")
    ap.add_argument("--migration-limit", type=int, default=0,
                    help="the proxy's --migration-limit (streams are then relayed event by event)")
    ap.add_argument("--json-out", help="also write the figures to this JSON file")
    ap.add_argument("--serve-fake", choices=("prefill", "decode"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake:
        serve_fake(args.serve_fake, stream_events=16)
        return 0
    procs = []
    try:
        fake = [sys.executable, os.path.abspath(__file__), "--serve-fake"]
        p_proc, p_port = start_process(fake + ["prefill"], r"PORT (\d+)")
        procs.append(p_proc)
        d_proc, d_port = start_process(fake + ["decode"], r"PORT (\d+)")
        procs.append(d_proc)
        x_proc, proxy_url = start_process(
            [sys.executable, "-m", "pdserve.cli", "proxy", "--port", "0", "--prefiller-port", p_port,
             "--decoder-port", d_port, "--migration-limit", str(args.migration_limit)],
            r"listening on (\S+)")
        procs.append(x_proc)
        res = (uvloop.run if uvloop else asyncio.run)(run(args, p_port, d_port, proxy_url, x_proc.pid))
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report(res)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
