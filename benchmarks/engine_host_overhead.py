"""Host cost of the engine's own bookkeeping per step and per generated token, without a model.

Runs :class:`~pdserve.engine.llm_engine.LLMEngine` (scheduler, block manager, overlapped-step
pipeline, output collection of ``generate``) over a model runner that samples instantly: each
sampled token is a cheap function of the request's position, no tensor is touched. Everything
the engine does on the host per step is therefore measured on its own: scheduling, block
allocation, prefix-cache registration, committing tokens, stop checks and outputs. The runner's
own (small) time is measured too and subtracted. Times are CPU time of the engine's thread
(``time.thread_time``), so that other processes on a shared machine disturb them less than
they would wall time.

The workload is shaped like ``benchmarks/offline_throughput.py``'s: ``--num-prompts`` requests
(256) whose prompt and output lengths are drawn uniformly from ``--min-len .. --max-len``
(100..1024; Python's ``random`` with seed 0, so not the same draws), random token ids,
``ignore_eos``, the engine's default limits (2048 batched tokens, 256 sequences, 16-token
blocks, prefix caching on) and enough KV blocks that nothing is preempted.

Each mode (overlapped scheduling, the engine default, and synchronous steps) runs
``--repeats`` times (3) on the same requests, alternating, and the median (and the best run)
is printed: host milliseconds per engine step and microseconds per generated token.
``--profile`` prints a cProfile top list of one more run per mode.

Usage::

    python benchmarks/engine_host_overhead.py [--num-prompts 256] [--min-len 100] \\
        [--max-len 1024] [--repeats 3] [--mode both|async|sync] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

from pdserve.types.engine_config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.outputs import ModelRunnerOutput, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams

VOCAB = 32_000
MAX_MODEL_LEN = 40_960  # Qwen3-0.6B's max_position_embeddings


class InstantRunner:
    """A model runner whose steps take no time: ``execute`` / ``execute_async`` sample, for each
    request with ``sample=True``, the token ``position % VOCAB`` of the sampled position.

    Attributes:
        seconds: CPU time spent inside the runner (subtracted from the engine's).
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.model_info = SimpleNamespace(name="instant", max_position_embeddings=MAX_MODEL_LEN,
                                          eos_token_ids=[VOCAB - 1], vocab_size=VOCAB)
        self.seconds = 0.0

    def determine_num_blocks(self) -> int:
        return self.num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        pass

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.thread_time()
        out = ModelRunnerOutput(sampled_token_ids={
            sr.request_id: (sr.num_computed_tokens + len(sr.token_ids)) % VOCAB
            for sr in sched.scheduled if sr.sample
        })
        self.seconds += time.thread_time() - t0
        return out

    def execute_async(self, sched: SchedulerOutput) -> "_Done":
        return _Done(self.execute(sched))

    def shutdown(self) -> None:
        pass


@dataclass
class _Done:
    """A launched step whose result is already there."""

    out: ModelRunnerOutput
    kv_connector_output: None = None
    kv_tier_report: None = None

    def result(self) -> ModelRunnerOutput:
        return self.out


def make_workload(num_prompts: int, min_len: int, max_len: int, seed: int = 0):
    """``(prompts, sampling params)``: lengths uniform in ``[min_len, max_len]``, random ids."""
    rng = random.Random(seed)
    in_lens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    out_lens = [rng.randint(min_len, max_len) for _ in range(num_prompts)]
    prompts = [[rng.randrange(VOCAB - 1) for _ in range(n)] for n in in_lens]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in out_lens]
    return prompts, params


class _CountingEngine(LLMEngine):
    """Counts engine steps (``core.step`` calls)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.num_steps = 0
        step = self.core.step

        def counted():
            self.num_steps += 1
            return step()

        self.core.step = counted


def run_once(prompts, params, async_scheduling: bool, profile: bool = False):
    """One ``generate`` over the workload; returns ``(host CPU s, steps, tokens, profile or
    None)``."""
    block_size = 16
    num_tokens = sum(len(p) + sp.max_tokens for p, sp in zip(prompts, params))
    num_blocks = num_tokens // block_size + 2 * len(prompts)
    num_blocks = max(num_blocks, MAX_MODEL_LEN // block_size)  # one request of max_model_len fits
    runner = InstantRunner(num_blocks, block_size)
    config = EngineConfig(model="instant", block_size=block_size, max_model_len=MAX_MODEL_LEN,
                          async_scheduling=async_scheduling)
    engine = _CountingEngine(config, runner=runner)
    prof = cProfile.Profile() if profile else None
    t0 = time.thread_time()
    if prof is not None:
        prof.enable()
    results = engine.generate(prompts, params)
    if prof is not None:
        prof.disable()
    seconds = time.thread_time() - t0 - runner.seconds
    engine.shutdown()
    tokens = sum(len(r.token_ids) for r in results)
    expected = sum(sp.max_tokens for sp in params)
    if tokens != expected:
        raise RuntimeError(f"generated {tokens} tokens, expected {expected}")
    return seconds, engine.num_steps, tokens, prof


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mode", choices=["both", "async", "sync"], default="both")
    ap.add_argument("--profile", action="store_true", help="print a cProfile top list per mode")
    ap.add_argument("--top", type=int, default=30, help="entries of the profile list")
    args = ap.parse_args()

    prompts, params = make_workload(args.num_prompts, args.min_len, args.max_len)
    modes = {"both": [True, False], "async": [True], "sync": [False]}[args.mode]
    runs: dict[bool, list[tuple[float, int, int]]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for m in modes:
            seconds, steps, tokens, _ = run_once(prompts, params, m)
            runs[m].append((seconds, steps, tokens))
    for m in modes:
        name = "overlapped" if m else "sync"
        seconds = statistics.median(s for s, _, _ in runs[m])
        best = min(s for s, _, _ in runs[m])
        _, steps, tokens = runs[m][0]
        each = ", ".join(f"{s:.3f}" for s, _, _ in runs[m])
        print(f"{name:>10}: {steps} steps, {tokens} tokens, host {seconds:.3f} s: "
              f"{1e3 * seconds / steps:.3f} ms/step, {1e6 * seconds / tokens:.2f} us/token "
              f"(best {1e6 * best / tokens:.2f} us/token; runs: {each} s)")
    if args.profile:
        for m in modes:
            _, _, _, prof = run_once(prompts, params, m, profile=True)
            print(f"\n--- cProfile, {'overlapped' if m else 'sync'} (cumulative) ---")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("cumulative").print_stats(args.top)
            print(f"--- cProfile, {'overlapped' if m else 'sync'} (own time) ---")
            pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
