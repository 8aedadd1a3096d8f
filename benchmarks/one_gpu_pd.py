"""P/D on one GPU, end to end in one run of at most about 8.5 minutes: the KV transfer
bandwidth of two processes on one GPU by each path, ``pdserve up`` with both engines on one GPU
(Qwen3-0.6B-shaped and 8B Llama-class dummy weights), and the same-GPU tests.

Stages, most important first (each bounded in time; one that would not fit in what is left is
skipped and said so):

1. ``preflight``: the GPU, and the packages pdserve needs (a missing one is named).
2. ``kv_transfer``: benchmarks/kv_transfer.py with owner and reader on cuda:0, 4,096 tokens,
   Qwen3-0.6B and 8B Llama geometry, on the default path (``auto``) and with NIXL forced
   (``UCX_PROTO_INFO=y``, so UCX prints the protocol it picked), then in host-buffer mode
   (``kv_buffer_device: cpu``); the table gives GB/s next to a device copy of the same bytes in
   the same run, and the path.
3. ``pdserve_up``: ``pdserve up`` with ``--gpu-memory-utilization 0.8`` (so 0.4 per engine)
   for each dummy model, a 4,096-token request through the proxy (twice: the first pays the
   handshake), then the decoder's transfer metrics and the engines' memory lines.
4. ``tests``: tests/kv_transfer/test_same_host_path.py (its GPU test: P and D as two processes
   on cuda:0, CUDA IPC and forced NIXL, contiguous and fragmented blocks),
   tests/kv_transfer/test_host_buffer.py (its GPU test: host-buffer mode on cuda:0),
   tests/test_memory_budget.py, the VRAM test of tests/kv_transfer/test_nixl_worker_processes.py
   and tests/runner/test_cuda_runner.py; then, as a diagnosis, NIXL forced with
   ``UCX_TLS=cuda_ipc,cuda_copy,tcp`` (is cuda_ipc in this UCX build, and does UCX pick it for
   GPU memory when shared memory is out of the way?).
5. ``multi_turn`` (only when enough time is left): benchmarks/pd_multi_turn.py on one GPU with
   the 8B dummy model, ~4k-token histories, 1 client.

Everything goes under ``--out`` (default ``$OUT``): ``summary.txt`` (the numbers, also printed at
the end) and one log per stage, at most six files.

Usage (on the GPU machine, from the repository root, pdserve's dependencies and NIXL
importable)::

    PYTHONUNBUFFERED=1 python3 benchmarks/one_gpu_pd.py --out "$OUT"
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
PY = sys.executable
PACKAGES = ("torch", "nixl_cu13", "msgspec", "zmq", "fastapi", "uvicorn", "httpx", "pydantic",
            "prometheus_client", "transformers", "triton")


class Run:
    """The time budget, the output folder and the summary."""

    def __init__(self, out: Path, budget_s: float, device: str = "cuda", prompt_len: int = 4096,
                 engine_args: str = ""):
        self.out = out
        self.device = device
        self.prompt_len = prompt_len
        self.engine_args = engine_args
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget_s
        self.summary: list[str] = []
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        self.env["PYTHONUNBUFFERED"] = "1"

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def note(self, line: str) -> None:
        stamp = f"[{time.monotonic() - self.t0:6.1f}s] "
        print(stamp + line, flush=True)
        self.summary.append(line)
        (self.out / "summary.txt").write_text("\n".join(self.summary) + "\n")

    def sh(self, cmd: list[str], log: str, limit_s: float, env: dict | None = None,
           title: str | None = None) -> tuple[int, str]:
        """Run ``cmd`` with at most ``limit_s`` (and what is left), appending its output to
        ``out/log``; returns (exit code, output). 124 = stopped at its limit."""
        limit = max(1.0, min(limit_s, self.left() - 5))
        header = f"\n===== {title or ' '.join(cmd)} (limit {limit:.0f} s)\n"
        t = time.monotonic()
        # its own process group, so that a command stopped at its limit takes its children
        # (the benchmark's owner and reader processes) with it
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            with open(self.out / log, "a") as fh:
                fh.write(header + f"cannot start: {e}\n")
            return 127, str(e)
        try:
            raw, _ = proc.communicate(timeout=limit)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raw, _ = proc.communicate()
            rc = 124
        text = raw.decode(errors="replace")
        with open(self.out / log, "a") as fh:
            fh.write(header + text + f"\n===== exit {rc} after {time.monotonic() - t:.1f} s\n")
        return rc, text


def stage_preflight(run: Run) -> None:
    rc, text = run.sh(["nvidia-smi", "--query-gpu=name,memory.total,memory.used",
                       "--format=csv,noheader"], "preflight.log", 20)
    run.note(f"GPU: {text.strip() if rc == 0 else 'nvidia-smi failed'}")
    code = ("import importlib, json\nmissing = []\nfor n in %r:\n    try:\n"
            "        importlib.import_module(n)\n    except Exception as e:\n"
            "        missing.append(f'{n} ({type(e).__name__}: {e})')\n"
            "import torch\nprint(json.dumps({'missing': missing, 'torch': torch.__version__, "
            "'cuda': torch.cuda.is_available()}))" % (PACKAGES,))
    rc, text = run.sh([PY, "-c", code], "preflight.log", 60)
    try:
        info = json.loads(text.strip().splitlines()[-1])
        run.note(f"torch {info['torch']}, CUDA {info['cuda']}; missing packages: "
                 f"{info['missing'] or 'none'}")
    except (ValueError, IndexError, KeyError):
        run.note(f"preflight failed: {text[-500:]}")


def stage_tests(run: Run) -> None:
    cases = [
        (["tests/kv_transfer/test_same_host_path.py", "tests/kv_transfer/test_host_buffer.py",
          "tests/test_memory_budget.py"], 150),
        (["tests/kv_transfer/test_nixl_worker_processes.py", "-k", "vram"], 60),
        (["tests/runner/test_cuda_runner.py"], 120),
    ]
    for args, limit in cases:
        if run.left() < 45:
            run.note(f"tests {args[0]}: skipped (time)")
            continue
        rc, text = run.sh([PY, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *args],
                          "tests.log", limit)
        tail = [l for l in text.strip().splitlines() if l.strip()][-1:] or ["(no output)"]
        run.note(f"tests {' '.join(args)}: exit {rc}: {tail[0]}")


_ROW = re.compile(r"^\s*\d+\s+\d")


def stage_kv_transfer(run: Run) -> None:
    runs = [(g, t) for g in ("qwen3-0.6b", "llama-8b") for t in ("auto", "nixl")]
    runs += [("qwen3-0.6b", "host"), ("llama-8b", "host")]
    for geometry, transport in runs:
        if run.left() < 300:  # keep time for pdserve up
            run.note(f"kv_transfer {geometry} {transport}: skipped (time)")
            continue
        env = dict(run.env)
        if transport == "nixl":
            env["UCX_PROTO_INFO"] = "y"
        cmd = [PY, "benchmarks/kv_transfer.py", "--device", run.device, "--same-gpu",
               "--geometry", geometry, "--lengths", str(run.prompt_len), "--repeats", "3"]
        cmd += (["--kv-buffer-device", "cpu"] if transport == "host"
                else ["--same-host-transport", transport])
        rc, text = run.sh(cmd, "kv_transfer.log", 75, env=env,
                          title=f"kv_transfer {geometry} {transport}")
        rows = [l for l in text.splitlines() if _ROW.match(l)]
        run.note(f"kv_transfer {geometry} "
                 + ("kv_buffer_device=cpu (host buffer)" if transport == "host"
                    else f"same_host_transport={transport}") + f": exit {rc}")
        for line in text.splitlines():
            if line.startswith((" tokens", "# KV geometry", "# owner")):
                run.note("  " + line.strip())
        for row in rows:
            run.note("  " + row.strip())
        if transport == "nixl":
            for line in _ucx_lines(text):
                run.note("  UCX: " + line)


def _ucx_lines(text: str, limit: int = 30) -> list[str]:
    """UCX's warnings and its ``UCX_PROTO_INFO`` protocol tables (the lines that name GPU
    memory, a transport or TCP emulation), without timestamps, each once."""
    seen: list[str] = []
    for line in text.splitlines():
        if not (("|" in line and re.search(r"cuda|tcp|emulat|ipc|rndv|rdma|copy", line, re.I))
                or "UCX  WARN" in line or "UCX  ERROR" in line):
            continue
        line = re.sub(r"^\s*\[[0-9.]+\]\s*\[[^\]]*\]\s*", "", line).strip()[:220]
        if line not in seen:
            seen.append(line)
        if len(seen) >= limit:
            break
    return seen


def stage_ucx_diagnosis(run: Run) -> None:
    if run.left() >= 60:
        env = dict(run.env, UCX_PROTO_INFO="y", UCX_TLS="cuda_ipc,cuda_copy,tcp")
        cmd = [PY, "benchmarks/kv_transfer.py", "--device", run.device, "--same-gpu",
               "--geometry", "qwen3-0.6b", "--lengths", str(run.prompt_len), "--repeats", "1",
               "--same-host-transport", "nixl"]
        rc, text = run.sh(cmd, "kv_transfer.log", 45, env=env,
                          title="kv_transfer qwen3-0.6b nixl UCX_TLS=cuda_ipc,cuda_copy,tcp")
        run.note(f"diagnosis: NIXL with UCX_TLS=cuda_ipc,cuda_copy,tcp: exit {rc}")
        for row in [l for l in text.splitlines() if _ROW.match(l)]:
            run.note("  " + row.strip())
        for line in _ucx_lines(text, 16):
            run.note("  UCX: " + line)
        for line in [l.strip() for l in text.splitlines()
                     if re.search(r"unreachable|Error:|NIXL_ERR", l)][:6]:
            run.note("  " + line[:200])
    else:
        run.note("diagnosis UCX_TLS=cuda_ipc,cuda_copy,tcp: skipped (time)")


def _metric_lines(url: str, names: tuple[str, ...]) -> list[str]:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    return [l for l in text.splitlines() if l.startswith(names)]


def _up_case(run: Run, name: str, model_dir: Path, work: Path) -> None:
    sys.path.insert(0, str(HERE))
    import httpx
    from pd_multi_turn import _start_up, _stop

    log_dir = work / f"up-{name}"
    log_dir.mkdir()
    up_out = work / f"up-{name}.out"
    args = argparse.Namespace(
        model=str(model_dir), device=run.device, startup_timeout=min(150.0, run.left() - 40),
        engine_args=run.engine_args)
    t = time.monotonic()
    old_env = dict(os.environ)
    os.environ.update(run.env)
    proc = None
    try:
        proc, status = _start_up(args, False, log_dir, output=up_out)
        run.note(f"pdserve up {name}: ready after {time.monotonic() - t:.0f} s")
        for line in up_out.read_text(errors="replace").splitlines():
            if "started" in line or "shared" in line:
                run.note("  " + line.strip())
        parts = status["children"]
        proxy = next(p["url"] for p in parts if p["role"] == "proxy")
        decode = next(p["url"] for p in parts if p["role"] == "decode")
        rng = random.Random(0)
        prompt = [rng.randrange(3, 49152) for _ in range(run.prompt_len)]
        for i in range(2):  # the first pays the handshake
            t1 = time.monotonic()
            r = httpx.post(f"{proxy}/v1/completions", timeout=120, json={
                "model": str(model_dir), "prompt": prompt[i:], "max_tokens": 16,
                "ignore_eos": True, "temperature": 0})
            run.note(f"  request {i + 1} ({len(prompt) - i} prompt tokens): HTTP "
                     f"{r.status_code} in {1e3 * (time.monotonic() - t1):.0f} ms"
                     + ("" if r.status_code == 200 else f": {r.text[:300]}"))
        for line in _metric_lines(decode, ("pdserve:nixl_bytes_transferred_sum",
                                           "pdserve:nixl_bytes_transferred_count",
                                           "pdserve:nixl_xfer_time_seconds_sum",
                                           "pdserve:nixl_num_failed_transfers",
                                           "pdserve:kv_transfer_path_info",
                                           "pdserve:kv_transfer_read_gbps",
                                           "pdserve:prompt_tokens_transferred_total")):
            run.note("  decoder /metrics: " + line)
    except BaseException as e:  # SystemExit from _start_up included
        run.note(f"pdserve up {name}: failed: {e}")
    finally:
        if proc is not None:
            _stop(proc)
        os.environ.clear()
        os.environ.update(old_env)
        with open(run.out / "pdserve_up.log", "a") as fh:
            fh.write(f"\n===== pdserve up {name}: launcher output\n")
            if up_out.exists():
                fh.write(up_out.read_text(errors="replace"))
            for log in sorted(log_dir.glob("*.log")):
                text = log.read_text(errors="replace")
                fh.write(f"\n===== {log.name} (last 150 lines)\n")
                fh.write("\n".join(text.splitlines()[-150:]) + "\n")
                for line in text.splitlines():
                    if re.search(r"GPU memory:|KV reads from engine|TCP|KV cache: \d+ blocks x|"
                                 r"GpuMemoryBudgetError|Traceback", line):
                        run.note(f"  {log.stem}: {line.strip()[:240]}")


def _model(run: Run, work: Path, name: str) -> Path | None:
    """A dummy preset's directory (made once under ``work``), or a model name/path as is."""
    if name not in ("qwen3-0.6b", "llama-8b"):
        return Path(name)
    d = work / f"{name}-dummy"
    if (d / "config.json").exists():
        return d
    rc, text = run.sh([PY, "benchmarks/make_llama8b_dummy.py", "--preset", name, str(d)],
                      "pdserve_up.log", 60)
    if rc != 0:
        run.note(f"dummy model {name}: failed ({text[-300:]})")
        return None
    return d


def stage_pdserve_up(run: Run, work: Path, names: list[str]) -> None:
    models = {name: _model(run, work, name) for name in names}
    for name, d in models.items():
        if d is None:
            continue
        if run.left() < 110:
            run.note(f"pdserve up {name}: skipped (time)")
            continue
        _up_case(run, name, d, work)


def stage_multi_turn(run: Run, work: Path, clients: list[int]) -> None:
    """benchmarks/pd_multi_turn.py with the 8B dummy model on one GPU, for each client count
    that still fits (about 200 s each)."""
    model = _model(run, work, "llama-8b")
    for n in clients:
        if model is None or run.left() < 200:
            run.note(f"multi_turn {n} client(s): skipped (time)")
            continue
        cmd = [PY, "benchmarks/pd_multi_turn.py", "--model", str(model), "--device", run.device,
               # without prefix caching: P's own cache would otherwise hold each history, and
               # neither case would transfer anything (docs/benchmarks.md, issue 19)
               "--engine-args", "--load-format dummy --dtype bfloat16 --max-model-len 16384 "
               "--max-num-seqs 32 --no-enable-prefix-caching",
               "--spec", "benchmarks/pd_multi_turn_long_spec.json", "--num-clients", str(n),
               "--startup-timeout", "150"]
        rc, text = run.sh(cmd, "multi_turn.log", run.left() - 10)
        run.note(f"multi_turn (8B dummy, one GPU, {n} client(s)): exit {rc}")
        for line in text.splitlines():
            if re.match(r"^(case|recompute|bidirectional|turns 2\+|model )", line):
                run.note("  " + line)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT") or "one_gpu_pd_out")
    ap.add_argument("--budget-s", type=float, default=510.0, help="total time budget")
    ap.add_argument("--device", default="cuda", help="engines' --device (cpu: a smoke run)")
    ap.add_argument("--up-models", default="qwen3-0.6b,llama-8b",
                    help="pdserve up models: the dummy presets, or model names/directories")
    ap.add_argument("--prompt-len", type=int, default=4096,
                    help="tokens of the up requests and of the kv_transfer reads")
    ap.add_argument("--up-engine-args",
                    default="--load-format dummy --gpu-memory-utilization 0.8 "
                            "--max-model-len 16384 --max-num-seqs 32",
                    help="engine options given to pdserve up (0.8 is split: 0.4 per engine)")
    ap.add_argument("--multi-turn-clients", default="1,4",
                    help="client counts of the multi_turn stage, while time is left")
    ap.add_argument("--work-dir", default=None,
                    help="where the dummy model directories are made, or found already made "
                         "(by benchmarks/make_llama8b_dummy.py; default: a temporary directory)")
    ap.add_argument("--stages",
                    default="preflight,kv_transfer,pdserve_up,tests,ucx_diagnosis,multi_turn")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(out, args.budget_s, args.device, args.prompt_len, args.up_engine_args)
    stages = set(args.stages.split(","))
    run.note(f"one_gpu_pd: stages {sorted(stages)}, budget {args.budget_s:.0f} s")
    with tempfile.TemporaryDirectory(prefix="one-gpu-pd-") as tmp:
        work = Path(args.work_dir or tmp)
        for name, fn in (("preflight", lambda: stage_preflight(run)),
                         ("kv_transfer", lambda: stage_kv_transfer(run)),
                         ("pdserve_up",
                          lambda: stage_pdserve_up(run, work, args.up_models.split(","))),
                         ("tests", lambda: stage_tests(run)),
                         ("ucx_diagnosis", lambda: stage_ucx_diagnosis(run)),
                         ("multi_turn", lambda: stage_multi_turn(
                             run, work, [int(n) for n in args.multi_turn_clients.split(",")]))):
            if name not in stages:
                continue
            try:
                fn()
            except Exception as e:  # one stage's failure must not lose the others' numbers
                run.note(f"stage {name} failed: {type(e).__name__}: {e}")
    run.note(f"done in {time.monotonic() - run.t0:.0f} s")
    print("\n".join(["", "===== summary"] + run.summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
