"""Diagnostics of an offline run (``benchmarks/offline_throughput.py``): where the engine's time
goes.

- :class:`StepTimer`: the wall time split into prefill steps, decode steps and the rest, and on
  CUDA the GPU's time line from events around every runner call (intervals by kind and by decode
  rows, the GPU's idle time before a call began).
- :class:`PauseWatch` (``--watch-pauses``): host stalls over 40 ms with the engine thread's stack,
  garbage-collector passes and Triton compilations inside the timed run.
- :func:`profile_decode_steps` (``--profile-decode``): a per-kernel table of decode steps.
- :func:`profile_host` (``--host-profile``): cProfile of the whole workload.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from workload import Workload


def on_cuda(device: str) -> bool:
    """Whether ``--device`` (``auto``, ``cuda[:N]`` or ``cpu``) runs the engine on CUDA."""
    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def sync_device(device: str) -> None:
    """Wait for the GPU's queued work when ``device`` (as :func:`on_cuda` reads it) is CUDA."""
    if on_cuda(device):
        torch.cuda.synchronize()


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
    lasted ``threshold_ms``; garbage-collector passes of ``threshold_ms / 4`` or more (for a
    full pass also how many objects, of which types, it left in the oldest generation: what the
    next full pass walks again) and Triton compilations (with their duration) are recorded too.
    :meth:`report` prints them."""

    def __init__(self, timer: "StepTimer", threshold_ms: float = 40.0):
        import gc
        import threading

        self.timer = timer
        self.threshold = threshold_ms / 1e3
        self.t0 = time.perf_counter()
        self.main = threading.get_ident()
        self.samples: list[tuple[float, str, str]] = []  # (seconds into run, where, stack)
        # (t, generation, ms, for a full pass: what is left in generation 2)
        self.gc_passes: list[tuple[float, int, float, str]] = []
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
            gen = info.get("generation", -1)
            what = ""
            if gen == 2:  # what the next full pass walks again: the survivors, by type
                from collections import Counter

                objs = self._gc.get_objects(2)
                top = Counter(type(o).__qualname__ for o in objs).most_common(6)
                what = (f"; {len(objs)} objects left in generation 2 "
                        f"({self._gc.get_freeze_count()} frozen), most: "
                        + ", ".join(f"{name} {n}" for name, n in top))
                del objs
            self.gc_passes.append((self._gc_start - self.t0, gen, ms, what))

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
        for t, gen, ms, what in self.gc_passes:
            print(f"[pauses]   GC generation {gen} at {t:.3f} s: {ms:.1f} ms{what}", flush=True)
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

    from pdserve.types.sampling_params import SamplingParams

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
                sync_device(args.device)
                state["prof"] = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                state["prof"].__enter__()
                state["t0"] = time.perf_counter()
            if first <= state["n"] < first + count:
                state["batch"] += len(sched.scheduled) * sched.num_steps
                state["steps"] += sched.num_steps
        out = run(sched)
        if decode and state["n"] == first + count - 1:
            sync_device(args.device)
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
    print_device_gaps(prof, steps)


def print_device_gaps(prof, steps: int, short_ns: int = 20_000) -> None:
    """The GPU's own time line of a profiled window: per step, the time between the end of one
    device activity (kernel, copy, memset) and the start of the next, split into short gaps (under
    ``short_ns``: the launch-to-launch gaps inside a CUDA graph replay or a burst of launches)
    and longer ones (the GPU waiting for the host). Device timestamps, so the profiler's own host
    cost shows only in the longer gaps."""
    try:
        spans = sorted((e.start_ns(), e.end_ns()) for e in prof.profiler.kineto_results.events()
                       if e.device_type().name == "CUDA")
    except (AttributeError, RuntimeError):  # a torch without kineto's event list
        return
    if not spans:
        return
    short = long = 0
    reach = spans[0][1]
    for start, end in spans[1:]:
        gap = start - reach
        if gap > 0:
            if gap < short_ns:
                short += gap
            else:
                long += gap
        reach = max(reach, end)
    busy = (spans[-1][1] - spans[0][0] - short - long) / steps / 1e6
    print(f"[profile] device time line per step: {busy:.3f} ms busy, {short / steps / 1e6:.3f} ms in "
          f"gaps under {short_ns / 1000:.0f} us between device activities, {long / steps / 1e6:.3f} ms "
          "in longer gaps", flush=True)


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
