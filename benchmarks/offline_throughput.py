"""Offline generation throughput: pdserve's in-process engine against ``transformers.generate``.

The workload follows issue #8 (and vLLM's ``benchmark_throughput`` with random data): 256
requests whose prompt and output lengths are drawn uniformly from 100..1024 tokens (seed 0),
random prompt token ids, ``ignore_eos`` so every request produces exactly its output length, and
the Qwen3-0.6B architecture with dummy (random) weights in bf16. Speed does not depend on weight
values, so no checkpoint is downloaded: the script writes the model's ``config.json`` into a
temporary directory and both engines initialise random weights from it.

Both engines run in the same process, one after the other, on the same requests; the script
prints output tokens/s of each and their ratio (the target on one H200 is >= 20,000 tokens/s and
>= 10x ``transformers``). pdserve runs with ``--num-scheduler-steps 16`` by default (multi-step
scheduling, after vLLM's option of that name): an offline batch does not stream, so bursts
of 16 tokens cost nothing, and the host schedules once per 16 decode steps. The engine's own
default is 1; ``--num-scheduler-steps 1`` measures that.

``--async-scheduling both`` runs pdserve twice on the same requests, with overlapped scheduling
(the engine default: step n+1 is launched before step n's tokens are read) and with synchronous
steps, and prints both lines (``pdserve`` and ``pdserve-sync``) and their ratio: the issue #15
before/after figure in one call, e.g. ``--skip-hf --num-scheduler-steps 1 --async-scheduling both``.

``transformers`` cannot give each sequence of a batch its own output length, so it runs the
requests in batches of ``--hf-batch-size`` (sorted by output length, which favours it: less
padding) with ``max_new_tokens`` = the longest output of the batch, and only the requested
tokens are counted. Sampling is the same on both sides: ``--temperature`` (1.0 by default, as in
vLLM's benchmark; 0 = greedy) with top-p 1 and no top-k.

Examples::

    # the issue's benchmark (GPU)
    python benchmarks/offline_throughput.py
    # the same with pdserve's fp8 KV cache
    python benchmarks/offline_throughput.py --kv-cache-dtype fp8 --skip-hf
    # a quick check on a CPU (tiny random Qwen3, a few short requests)
    python benchmarks/offline_throughput.py --model-preset tiny-qwen3 --num-prompts 8 \\
        --min-len 4 --max-len 16 --dtype float32
    # the engine default (token-by-token steps), overlapped scheduling on and off
    python benchmarks/offline_throughput.py --skip-hf --num-scheduler-steps 1 --async-scheduling both
    # issue #17's families (one GPU): Qwen3-30B-A3B (MoE, about 61 GB of bf16 weights; each
    # engine loads its own copy, one after the other) and Qwen2.5-7B shaped, dummy weights;
    # transformers on the longest-output requests only (--hf-max-prompts) keeps its part short
    python benchmarks/offline_throughput.py --model-preset qwen3-30b-a3b --hf-max-prompts 64
    python benchmarks/offline_throughput.py --model-preset qwen2.5-7b
    # the same families on a CPU: tiny-qwen3-moe, tiny-qwen2
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from model_configs import qwen2_5_7b_config, qwen3_30b_a3b_config, tiny_config

# Qwen3-0.6B's config.json (Qwen/Qwen3-0.6B on the Hugging Face Hub), written out so that no
# download is needed.
QWEN3_0_6B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 1024,
    "initializer_range": 0.02,
    "intermediate_size": 3072,
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "num_attention_heads": 16,
    "num_hidden_layers": 28,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# A few-layer Qwen3 with the same structure, for runs on a CPU.
TINY_QWEN3_CONFIG = {
    **QWEN3_0_6B_CONFIG,
    "head_dim": 32,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

MODEL_PRESETS = {"qwen3-0.6b": QWEN3_0_6B_CONFIG, "tiny-qwen3": TINY_QWEN3_CONFIG,
                 "qwen3-30b-a3b": qwen3_30b_a3b_config(), "qwen2.5-7b": qwen2_5_7b_config(),
                 "tiny-qwen3-moe": tiny_config(qwen3_30b_a3b_config()),
                 "tiny-qwen2": tiny_config(qwen2_5_7b_config())}


def write_model_config(directory: Path, preset: str) -> Path:
    """Write ``config.json`` of a model preset into ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "config.json", "w") as fh:
        json.dump(MODEL_PRESETS[preset], fh, indent=2)
    return directory


@dataclass
class Workload:
    """The requests: prompt token ids and output lengths (tokens)."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_workload(num_prompts: int, min_len: int, max_len: int, vocab_size: int, seed: int,
                  min_out: int | None = None, max_out: int | None = None) -> Workload:
    """Uniform prompt lengths in ``[min_len, max_len]`` and output lengths in
    ``[min_out, max_out]`` (default: the same range), random token ids, from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    min_out = min_len if min_out is None else min_out
    max_out = max_len if max_out is None else max_out
    in_lens = torch.randint(min_len, max_len + 1, (num_prompts,), generator=gen).tolist()
    out_lens = torch.randint(min_out, max_out + 1, (num_prompts,), generator=gen).tolist()
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in in_lens]
    return Workload(prompts, out_lens)


@dataclass
class Result:
    """One engine's run: wall time (s), tokens, and output tokens per second."""

    engine: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("nan")


def _on_cuda(device: str) -> bool:
    """Whether ``--device`` (``auto``, ``cuda[:N]`` or ``cpu``) runs the engine on CUDA."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def _sync(device: str) -> None:
    if _on_cuda(device):
        torch.cuda.synchronize()


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class StepTimer:
    """Wraps ``runner.execute`` (and ``execute_async``) to split the engine's wall time into
    model-runner steps with a prefill (or chunk), pure-decode steps, and the rest (scheduler,
    detokenising, bookkeeping). ``execute`` returns host lists, so each call's time includes its
    GPU work; ``execute_async`` (overlapped scheduling) only launches a step, so its time is the
    host's part and the GPU work shows up where the engine waits for the tokens, outside the
    runner. A multi-step round counts as ``num_steps`` steps of equal length."""

    def __init__(self, runner, label: str = "pdserve", cuda: bool = False):
        self.runner = runner
        self.label = label
        self.inner = runner.execute
        self.inner_async = runner.execute_async
        self.times = {"prefill": [], "decode": []}
        self.decode_batch: list[int] = []
        # CUDA: an event before and after each runner call, on the compute stream; per step
        # (kind, decode rows, prefill tokens, host seconds, start event, end event)
        self.cuda = cuda
        self.steps: list[tuple] = []
        # (inside a runner call, since when): read by PauseWatch
        self.state: tuple[bool, float] | None = None
        runner.execute = lambda sched: self._execute(self.inner, sched)
        runner.execute_async = lambda sched: self._execute(self.inner_async, sched)

    def _execute(self, inner, sched):
        start = end = None
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        self.state = (True, t)
        out = inner(sched)
        elapsed = time.perf_counter() - t
        self.state = (False, time.perf_counter())
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
        kind = "prefill" if any(len(r.token_ids) > 1 for r in sched.scheduled) else "decode"
        decode_rows = sum(1 for r in sched.scheduled if len(r.token_ids) == 1)
        prefill_tokens = sum(len(r.token_ids) for r in sched.scheduled if len(r.token_ids) > 1)
        self.steps.append((kind, decode_rows, prefill_tokens, elapsed, start, end,
                           sched.num_steps))
        if kind == "decode":  # a multi-step round counts as its num_steps steps
            self.times[kind].extend([elapsed / sched.num_steps] * sched.num_steps)
            self.decode_batch.extend([len(sched.scheduled)] * sched.num_steps)
        else:
            self.times[kind].append(elapsed)
        return out

    def report(self, total_s: float) -> None:
        """Print the split (seconds, steps, mean step time)."""
        self.runner.execute = self.inner
        self.runner.execute_async = self.inner_async
        inside = 0.0
        for kind, ts in self.times.items():
            inside += sum(ts)
            mean = sum(ts) / len(ts) * 1e3 if ts else 0.0
            median = sorted(ts)[len(ts) // 2] * 1e3 if ts else 0.0
            longest = max(ts) * 1e3 if ts else 0.0
            extra = (f", mean batch {sum(self.decode_batch) / len(self.decode_batch):.0f}"
                     if kind == "decode" and self.decode_batch else "")
            print(f"[{self.label}] {kind} steps: {len(ts)}, {sum(ts):.2f} s in the runner, "
                  f"{mean:.2f} ms/step (median {median:.2f}, max {longest:.2f}){extra}",
                  flush=True)
        print(f"[{self.label}] outside the runner (scheduler, engine): {total_s - inside:.2f} s",
              flush=True)
        if self.cuda:
            self.report_gpu(total_s)

    def report_gpu(self, total_s: float) -> None:
        """GPU time line of the run from the per-step CUDA events (call after a synchronize).

        A step's interval is the stream's time from the previous runner call's end event to
        this call's end event: its kernels plus any time the GPU waited for the host to launch
        them (compare with the kernel time per step of ``--profile-decode`` at the same batch:
        the excess is idle). "Idle before" sums the part of that wait before the host even
        began the call (end of the previous step -> this call's start event). Prints totals by
        kind and by decode rows, and the longest intervals."""
        rows = []
        prev_end = None
        for kind, drows, ptoks, host_s, start, end, nsteps in self.steps:
            interval = prev_end.elapsed_time(end) if prev_end is not None else start.elapsed_time(end)
            gap = max(0.0, prev_end.elapsed_time(start)) if prev_end is not None else 0.0
            prev_end = end
            rows.append((kind, drows, ptoks, host_s * 1e3, interval / nsteps, gap, nsteps))
        span_ms = self.steps[0][4].elapsed_time(self.steps[-1][5]) if self.steps else 0.0
        print(f"[{self.label}] GPU time line: first call's start -> last call's end "
              f"{span_ms / 1e3:.2f} s of {total_s:.2f} s wall; GPU idle before calls began "
              f"{sum(r[5] for r in rows) / 1e3:.3f} s", flush=True)
        for kind in ("prefill", "decode"):
            sel = [r for r in rows if r[0] == kind]
            if sel:
                print(f"[{self.label}]   {kind}: {sum(r[6] for r in sel)} steps, intervals "
                      f"{sum(r[4] * r[6] for r in sel) / 1e3:.2f} s, host in the runner "
                      f"{sum(r[3] for r in sel) / 1e3:.2f} s, idle before "
                      f"{sum(r[5] for r in sel) / 1e3:.3f} s", flush=True)
        bins = [(1, 1), (2, 8), (9, 32), (33, 64), (65, 128), (129, 192), (193, 256), (257, 1 << 30)]
        print(f"[{self.label}]   decode rows | steps | interval ms/step | host ms/call | "
              "idle before (s)", flush=True)
        for lo, hi in bins:
            sel = [r for r in rows if r[0] == "decode" and lo <= r[1] <= hi]
            if sel:
                n = sum(r[6] for r in sel)
                print(f"[{self.label}]   {lo:>4}-{min(hi, 9999):<4} | {n:5d} | "
                      f"{sum(r[4] * r[6] for r in sel) / n:8.2f} | "
                      f"{sum(r[3] for r in sel) / len(sel):8.2f} | {sum(r[5] for r in sel) / 1e3:7.3f}",
                      flush=True)
        top = sorted(rows, key=lambda r: -r[4])[:6]
        print(f"[{self.label}]   longest intervals (kind, decode rows, prefill tokens, host ms, "
              "interval ms, idle-before ms): "
              + "; ".join(f"{r[0]} {r[1]} {r[2]} {r[3]:.1f} {r[4]:.1f} {r[5]:.1f}" for r in top),
              flush=True)


class PauseWatch:
    """Finds where the host stalls during the timed run: a watcher thread samples the engine
    thread's Python stack whenever one runner call, or the time between two runner calls, has
    lasted ``threshold_ms``; garbage-collector passes of ``threshold_ms / 4`` or more and Triton
    compilations (with their duration) are recorded too. :meth:`report` prints them."""

    def __init__(self, timer: "StepTimer", threshold_ms: float = 40.0):
        import gc
        import threading

        self.timer = timer
        self.threshold = threshold_ms / 1e3
        self.t0 = time.perf_counter()
        self.main = threading.get_ident()
        self.samples: list[tuple[float, str, str]] = []  # (seconds into run, where, stack)
        self.gc_passes: list[tuple[float, int, float]] = []  # (t, generation, ms)
        self.compiles: list[tuple[float, str, float]] = []  # (t, kernel, ms)
        self._gc_start = 0.0
        self._stop = threading.Event()
        self._gc = gc
        gc.callbacks.append(self._on_gc)
        self._patched = None
        try:
            from triton.runtime.jit import JITFunction

            inner = JITFunction._do_compile
            watch = self

            def timed(fn_self, *a, **kw):
                t = time.perf_counter()
                try:
                    return inner(fn_self, *a, **kw)
                finally:
                    watch.compiles.append((t - watch.t0, getattr(fn_self, "__name__", "?"),
                                           (time.perf_counter() - t) * 1e3))

            JITFunction._do_compile = timed
            self._patched = (JITFunction, inner)
        except (ImportError, AttributeError):
            print("[pauses] Triton compilations not watched (no JITFunction._do_compile)", flush=True)
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
            return
        ms = (time.perf_counter() - self._gc_start) * 1e3
        if ms >= self.threshold * 250:
            self.gc_passes.append((self._gc_start - self.t0, info.get("generation", -1), ms))

    def _watch(self) -> None:
        import traceback

        seen = None
        while not self._stop.wait(0.005):
            state = self.timer.state  # (in_call, since)
            if state is None:
                continue
            in_call, since = state
            if time.perf_counter() - since < self.threshold or seen == (in_call, since):
                continue
            seen = (in_call, since)
            frame = sys._current_frames().get(self.main)
            if frame is None:
                continue
            stack = traceback.extract_stack(frame)[-12:]
            text = " <- ".join(f"{Path(f.filename).name}:{f.lineno}:{f.name}" for f in reversed(stack))
            self.samples.append((since - self.t0, "in a runner call" if in_call else
                                 "between runner calls", text))

    def report(self) -> None:
        self._stop.set()
        self._thread.join()
        self._gc.callbacks.remove(self._on_gc)
        if self._patched:
            self._patched[0]._do_compile = self._patched[1]
        print(f"[pauses] host stalls over {self.threshold * 1e3:.0f} ms: {len(self.samples)}; "
              f"GC passes over {self.threshold * 250:.0f} ms: {len(self.gc_passes)}; "
              f"Triton compilations: {len(self.compiles)}", flush=True)
        for t, gen, ms in self.gc_passes:
            print(f"[pauses]   GC generation {gen} at {t:.3f} s: {ms:.1f} ms", flush=True)
        for t, name, ms in self.compiles:
            print(f"[pauses]   compiled {name} at {t:.3f} s: {ms:.1f} ms", flush=True)
        for t, where, text in self.samples:
            print(f"[pauses]   {where} from {t:.3f} s: {text}", flush=True)


def profile_decode_steps(engine, work: Workload, args: argparse.Namespace, batch: int) -> None:
    """Untimed extra run: ``torch.profiler`` over ``--profile-decode`` decode runner calls (from
    the 100th, fewer on short workloads; a multi-step round is one call) of a batch of the
    workload's first ``batch`` requests.

    Prints the wall time per step, the device (kernel) time per step, their ratio (how busy the
    GPU was), and a per-kernel table: device time per step (µs), launches per step and share of
    the step's kernel time, kernels with the most device time first."""
    from torch.profiler import ProfilerActivity, profile

    from pdserve.engine.sampling_params import SamplingParams

    runner = engine.core.runner
    inner, inner_async = runner.execute, runner.execute_async
    longest = max(work.output_lens)  # max_model_len leaves room for this many after any prompt
    calls = longest // args.num_scheduler_steps  # decode runner calls of the longest request
    count = min(args.profile_decode, max(1, calls // 2))
    first = max(1, min(100 // args.num_scheduler_steps, calls - count - 1))
    state = {"n": 0, "prof": None, "t0": 0.0, "wall": 0.0, "batch": 0, "steps": 0}

    def execute(sched, run=inner):
        decode = all(len(r.token_ids) == 1 for r in sched.scheduled) and sched.scheduled
        if decode:
            state["n"] += 1
            if state["n"] == first:
                _sync(args.device)
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()
            if first <= state["n"] < first + count:
                state["batch"] += len(sched.scheduled) * sched.num_steps
                state["steps"] += sched.num_steps
        out = run(sched)
        if decode and state["n"] == first + count - 1:
            _sync(args.device)
            state["wall"] = time.perf_counter() - state["t0"]
            state["prof"].__exit__(None, None, None)
        return out

    runner.execute = execute
    runner.execute_async = lambda sched: execute(sched, inner_async)
    try:
        n = min(batch, len(work.prompts))
        max_tokens = min(longest, (first + count + 2) * args.num_scheduler_steps + 20)
        engine.generate(work.prompts[:n], SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                         temperature=1.0))
    finally:
        runner.execute, runner.execute_async = inner, inner_async
    prof = state["prof"]
    if prof is None or not state["wall"]:
        print("[profile] too few decode steps to profile", flush=True)
        return
    events = prof.key_averages()
    device_us = sum(getattr(e, "self_device_time_total", 0) or 0 for e in events)
    steps = state["steps"]
    wall_ms = state["wall"] / steps * 1e3
    print(f"\n[profile] {steps} decode steps in {count} runner calls, mean batch "
          f"{state['batch'] / steps:.0f}: wall {wall_ms:.2f} ms/step, GPU kernels "
          f"{device_us / 1e3 / steps:.2f} ms/step ({device_us / 1e3 / steps / wall_ms:.0%} busy; "
          "the profiler itself adds host time)", flush=True)
    kernels = sorted((e for e in events if (getattr(e, "self_device_time_total", 0) or 0) > 0
                      and e.device_type.name == "CUDA"),
                     key=lambda e: -e.self_device_time_total)
    print(f"[profile] batch {batch}: kernel | us/step | launches/step | share", flush=True)
    for e in kernels[:14]:
        print(f"[profile]   {e.key[:70]:<70} | {e.self_device_time_total / steps:8.1f} | "
              f"{e.count / steps:5.1f} | {e.self_device_time_total / device_us:5.1%}", flush=True)


def profile_host(engine, work: Workload, params: list, rows: int) -> None:
    """Untimed extra run of the whole workload under ``cProfile``: the engine's host functions
    with the most own time and the most cumulative time (``rows`` each). Waits for the GPU show
    up as the synchronising calls (``Event.synchronize``, ``tolist``)."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine.generate(work.prompts, params)
    prof.disable()
    print(f"\n[host profile] the workload again under cProfile: {time.perf_counter() - t0:.2f} s",
          flush=True)
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
        print(out.getvalue(), flush=True)


def run_pdserve(model_dir: Path, work: Workload, args: argparse.Namespace,
                async_scheduling: bool = True) -> Result:
    """Generate the workload with :class:`pdserve.engine.llm_engine.LLMEngine`, with overlapped
    scheduling (result ``pdserve``) or synchronous steps (``pdserve-sync``)."""
    label = "pdserve" if async_scheduling else "pdserve-sync"
    from pdserve.config import EngineConfig, KVCacheDtype
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        seed=args.seed,
        block_size=args.block_size,
        max_model_len=max(len(p) for p in work.prompts) + max(work.output_lens),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=args.enforce_eager,
        num_scheduler_steps=args.num_scheduler_steps,
        kv_cache_dtype=KVCacheDtype.parse(args.kv_cache_dtype),
        async_scheduling=async_scheduling,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    print(f"[{label}] engine ready in {time.perf_counter() - t0:.1f} s (async_scheduling "
          f"{async_scheduling})", flush=True)
    try:
        params = [
            SamplingParams(max_tokens=n, ignore_eos=True, temperature=args.temperature, top_p=1.0)
            for n in work.output_lens
        ]
        # Warm-up: compiles Triton kernels and fills allocator caches outside the timed run.
        # Prompts of the workload's own spread of lengths and enough steps that prefills, mixed
        # prefill + decode steps and decodes meet the shapes the run will (four short requests
        # left compilations inside the timed run on a fresh machine: a 0.39 s decode step).
        engine.generate(work.prompts[: min(32, len(work.prompts))],
                        SamplingParams(max_tokens=32, ignore_eos=True))
        _sync(args.device)
        stats = StepTimer(engine.core.runner, label, cuda=_on_cuda(args.device))
        pauses = PauseWatch(stats) if args.watch_pauses else None
        t0 = time.perf_counter()
        outputs = engine.generate(work.prompts, params)
        _sync(args.device)
        seconds = time.perf_counter() - t0
        stats.report(seconds)
        if pauses is not None:
            pauses.report()
        attn = engine.core.runner.model.attn_backend
        print(f"[{label}] prefill attention: {attn.last_prefill_impl}", flush=True)
        if args.host_profile:
            profile_host(engine, work, params, args.host_profile)
        if args.profile_decode:
            for batch in ([int(b) for b in args.profile_batches.split(",")] if args.profile_batches
                          else [args.max_num_seqs]):
                profile_decode_steps(engine, work, args, batch)
    finally:
        engine.shutdown()
        del engine
        _free_device_memory()
    errors = [o for o in outputs if o.finish_reason not in ("length", "stop")]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. "
                           f"{errors[0].finish_reason}: {errors[0].error}")
    produced = sum(len(o.token_ids) for o in outputs)
    if produced != work.num_output_tokens:
        raise RuntimeError(f"pdserve produced {produced} tokens, {work.num_output_tokens} were asked for")
    return Result(label, seconds, len(outputs), work.num_prompt_tokens, produced)


def run_transformers(model_dir: Path, work: Workload, args: argparse.Namespace) -> Result:
    """Generate the workload with ``transformers`` ``generate`` in left-padded batches."""
    from transformers import AutoConfig, AutoModelForCausalLM

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = "cpu" if device == "auto" else device
    dtype = {"auto": torch.bfloat16 if device.startswith("cuda") else torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    hf_config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation="sdpa")
    model.eval()
    pad_id = 0
    order = sorted(range(len(work.prompts)), key=lambda i: work.output_lens[i], reverse=True)
    if args.hf_max_prompts:
        order = order[: args.hf_max_prompts]
    batches = [order[i : i + args.hf_batch_size] for i in range(0, len(order), args.hf_batch_size)]
    sample_kw = ({"do_sample": True, "temperature": args.temperature, "top_p": 1.0, "top_k": 0}
                 if args.temperature > 0 else {"do_sample": False})

    def generate(ids: list[int], max_new: int) -> torch.Tensor:
        width = max(len(work.prompts[i]) for i in ids)
        input_ids = torch.full((len(ids), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, i in enumerate(ids):
            p = work.prompts[i]
            input_ids[row, width - len(p):] = torch.tensor(p)
            mask[row, width - len(p):] = 1
        with torch.inference_mode():
            return model.generate(
                input_ids=input_ids.to(device), attention_mask=mask.to(device),
                max_new_tokens=max_new, min_new_tokens=max_new, eos_token_id=None,
                pad_token_id=pad_id, **sample_kw,
            )

    try:
        generate(batches[0][:2], 4)  # warm-up
        _sync(device)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            max_new = max(work.output_lens[j] for j in batch)
            out = generate(batch, max_new)
            if out.shape[1] - max(len(work.prompts[j]) for j in batch) != max_new:
                raise RuntimeError("transformers stopped early despite min_new_tokens")
            print(f"[transformers] batch {i + 1}/{len(batches)}: {len(batch)} requests, "
                  f"{max_new} steps, {time.perf_counter() - t0:.1f} s so far", flush=True)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        del model
        _free_device_memory()
    counted = [work.output_lens[i] for i in order]
    return Result("transformers", seconds, len(order),
                  sum(len(work.prompts[i]) for i in order), sum(counted))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="qwen3-0.6b")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100, help="shortest prompt (tokens)")
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt (tokens)")
    p.add_argument("--min-out", type=int, default=None, help="shortest output (default --min-len)")
    p.add_argument("--max-out", type=int, default=None, help="longest output (default --max-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU)")
    p.add_argument("--enforce-eager", action="store_true", help="pdserve without CUDA graphs")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="pdserve's KV cache: 'auto' = --dtype, 'fp8' = float8 e4m3 (half the "
                        "bytes of bf16); transformers always uses --dtype")
    p.add_argument("--num-scheduler-steps", type=int, default=16,
                   help="pdserve decode steps per scheduling round (multi-step scheduling; "
                        "offline batches do not stream, so the default is 16; 1 = every step)")
    p.add_argument("--async-scheduling", choices=["on", "off", "both"], default="on",
                   help="pdserve with overlapped scheduling (on, the engine default), with "
                        "synchronous steps (off), or both one after the other on the same "
                        "requests (results 'pdserve' and 'pdserve-sync')")
    p.add_argument("--hf-batch-size", type=int, default=128)
    p.add_argument("--hf-max-prompts", type=int, default=0,
                   help="run transformers on only the N longest-output requests (0 = all)")
    p.add_argument("--profile-decode", type=int, default=0, metavar="N",
                   help="after the timed run, profile N decode steps of an extra untimed run")
    p.add_argument("--profile-batches", default="", metavar="B1,B2",
                   help="batch sizes of the --profile-decode runs (default: --max-num-seqs)")
    p.add_argument("--host-profile", type=int, default=0, metavar="ROWS",
                   help="after the timed run, run the workload again under cProfile and print "
                        "the ROWS host functions with the most own and cumulative time")
    p.add_argument("--watch-pauses", action="store_true",
                   help="during the timed run, record host stalls over 40 ms (the engine "
                        "thread's stack), long garbage-collector passes and Triton compilations")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-pdserve", action="store_true")
    p.add_argument("--output-json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.min_len < 1 or args.max_len < args.min_len:
        p.error("need 1 <= --min-len <= --max-len")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    preset = MODEL_PRESETS[args.model_preset]
    work = make_workload(args.num_prompts, args.min_len, args.max_len, preset["vocab_size"],
                         args.seed, args.min_out, args.max_out)
    print(f"workload: {args.num_prompts} requests, {work.num_prompt_tokens} prompt tokens, "
          f"{work.num_output_tokens} output tokens, model {args.model_preset} (dummy weights), "
          f"dtype {args.dtype}, pdserve kv_cache_dtype {args.kv_cache_dtype}, "
          f"num_scheduler_steps {args.num_scheduler_steps}, "
          f"async_scheduling {args.async_scheduling}, "
          f"torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ", CPU"),
          flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bench-"))
    results: list[Result] = []
    failures: list[str] = []
    try:
        model_dir = write_model_config(tmp / args.model_preset, args.model_preset)
        modes = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
        runs = ([] if args.skip_pdserve else
                [(f"run_pdserve(async_scheduling={m})",
                  functools.partial(run_pdserve, async_scheduling=m)) for m in modes])
        runs += [] if args.skip_hf else [("run_transformers", run_transformers)]
        for name, run in runs:
            try:
                r = run(model_dir, work, args)
            except Exception as exc:  # report and still run the other engine
                failures.append(f"{name}: {type(exc).__name__}: {exc}")
                print(f"[{name}] FAILED: {exc!r}", file=sys.stderr, flush=True)
                continue
            results.append(r)
            print(f"[{r.engine}] {r.output_tokens} output tokens in {r.seconds:.2f} s = "
                  f"{r.output_tokens_per_s:,.0f} tokens/s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print("\nengine         requests  output tokens  seconds   output tokens/s")
    for r in results:
        print(f"{r.engine:<14} {r.num_requests:>8}  {r.output_tokens:>13}  {r.seconds:>7.2f}  "
              f"{r.output_tokens_per_s:>16,.0f}")
    by = {r.engine: r for r in results}
    ratio = None
    ours = by.get("pdserve") or by.get("pdserve-sync")
    if ours is not None and "transformers" in by:
        ratio = ours.output_tokens_per_s / by["transformers"].output_tokens_per_s
        print(f"{ours.engine} / transformers = {ratio:.1f}x")
    if "pdserve" in by and "pdserve-sync" in by:
        print(f"overlapped / synchronous steps = "
              f"{by['pdserve'].output_tokens_per_s / by['pdserve-sync'].output_tokens_per_s:.2f}x")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"args": vars(args),
                       "results": [{**asdict(r), "output_tokens_per_s": r.output_tokens_per_s}
                                   for r in results],
                       "ratio": ratio, "failures": failures}, fh, indent=2)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
