"""Prefill-step profile of the model runner: wall time per step and the heaviest operators.

Builds a :class:`pdserve.runner.model_runner.ModelRunner` for the Qwen3-0.6B architecture with dummy
weights (bf16, CUDA) -- or a tiny Qwen3 on the CPU with ``--tiny`` -- and runs steps shaped like
the prefill steps of ``benchmarks/offline_throughput.py``: about ``--tokens`` prompt tokens in
requests of ``--min-len``..``--max-len`` tokens (fresh random lengths every step, as in the
benchmark), plus ``--decodes`` decode requests riding along. Every other step also carries one
chunked prefill (a chunk whose earlier tokens are already in the KV cache), which takes the
cached-context path of the attention.

For each prefill attention mode (``PDSERVE_PREFILL_ATTENTION``: ``auto`` = FlashAttention varlen
on CUDA, ``sdpa`` = per-request SDPA without cuDNN, ``sdpa-default`` = per-request SDPA with
torch's own backend choice, the behaviour before the varlen path) it prints the wall time of
each step (``execute`` returns host lists, so a step's time includes its GPU work), then a
``torch.profiler`` table of the top operators of one step (sorted by device time on CUDA, CPU
time on the CPU; on CUDA also a short table by host time, where cuDNN plan builds show) and the
number of operator calls in that step.

Examples::

    python benchmarks/profile_prefill.py                    # H200: Qwen3-0.6B dummy, bf16
    python benchmarks/profile_prefill.py --tiny             # CPU: tiny Qwen3, float32
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import write_model_config  # noqa: E402

from pdserve.types.engine_config import EngineConfig  # noqa: E402
from pdserve.types.outputs import ScheduledRequest, SchedulerOutput  # noqa: E402
from pdserve.types.sampling_params import SamplingParams  # noqa: E402
from pdserve.runner.model_runner import ModelRunner  # noqa: E402
from pdserve.runner.piecewise_graphs import PiecewiseGraphs, piecewise_capture_sizes  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny Qwen3 on the CPU in float32")
    p.add_argument("--tokens", type=int, default=8192, help="prompt tokens per step (about)")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1000)
    p.add_argument("--decodes", type=int, default=64, help="decode requests in every step")
    p.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    p.add_argument("--modes", default=None,
                   help="comma-separated prefill modes (default: auto,sdpa,sdpa-default on CUDA, "
                        "auto on the CPU)")
    p.add_argument("--rows", type=int, default=20, help="rows of the profiler table")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None,
                   help="a model directory (config.json; dummy weights) instead of Qwen3-0.6B, "
                        "e.g. one made by benchmarks/make_llama8b_dummy.py")
    p.add_argument("--cached", type=int, default=0, metavar="N",
                   help="every step is one prefill of --tokens new tokens after N tokens "
                        "already in the cache (a later turn of a multi-turn chat), plus the "
                        "decodes")
    p.add_argument("--piecewise", action="store_true",
                   help="time every mode twice: eagerly and with the stages between attentions "
                        "replayed from CUDA graphs (pdserve/runner/piecewise_graphs.py; the "
                        "engine's default), shown as MODE+graphs")
    return p.parse_args(argv)


class StepMaker:
    """Builds :class:`SchedulerOutput` objects of prefill steps on disjoint KV blocks."""

    def __init__(self, args: argparse.Namespace, vocab: int, block_size: int):
        self.args = args
        self.vocab = vocab
        self.bs = block_size
        self.rng = random.Random(args.seed)
        self.next_block = 0
        self.count = 0

    def _blocks(self, num_tokens: int) -> list[int]:
        n = -(-num_tokens // self.bs)
        ids = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return ids

    def _req(self, tokens: int, num_computed: int, params: SamplingParams) -> ScheduledRequest:
        self.count += 1
        prompt = [self.rng.randrange(self.vocab) for _ in range(num_computed + tokens)]
        return ScheduledRequest(
            request_id=f"r{self.count}", token_ids=prompt[num_computed:],
            num_computed_tokens=num_computed, block_ids=self._blocks(num_computed + tokens),
            sample=True, sampling_params=params, prompt_token_ids=prompt, output_token_ids=[])

    def step(self, chunked: bool) -> SchedulerOutput:
        """One step: fresh prompts (new random lengths), optionally one chunk with cached
        context, then the decodes. Block ids restart from 0 (cache contents do not matter)."""
        a = self.args
        self.next_block = 0
        params = SamplingParams(max_tokens=16, temperature=1.0, top_p=1.0, ignore_eos=True)
        reqs, budget = [], a.tokens
        if a.cached:
            reqs.append(self._req(a.tokens, a.cached, params))
            budget = 0
        elif chunked:
            chunk = min(budget, self.rng.randint(a.min_len, a.max_len))
            reqs.append(self._req(chunk, self.rng.randint(a.min_len, a.max_len), params))
            budget -= chunk
        while budget > 1:
            n = min(budget, self.rng.randint(a.min_len, a.max_len))
            reqs.append(self._req(n, 0, params))
            budget -= n
        for _ in range(a.decodes):
            ctx = self.rng.randint(a.min_len, a.max_len)
            r = self._req(1, ctx, params)
            reqs.append(r)
        return SchedulerOutput(scheduled=reqs,
                               total_num_scheduled_tokens=sum(len(r.token_ids) for r in reqs))

    def blocks_needed(self) -> int:
        a, bs = self.args, self.bs
        fresh = -(-a.tokens // bs) + a.tokens // a.min_len + 2
        chunked = -(-(2 * a.max_len + a.cached + a.tokens) // bs)
        decodes = a.decodes * -(-(a.max_len + 1) // bs)
        return fresh + chunked + decodes


def describe(sched: SchedulerOutput) -> str:
    pre = [r for r in sched.scheduled if len(r.token_ids) > 1]
    cached = sum(1 for r in pre if r.num_computed_tokens > 0)
    dec = len(sched.scheduled) - len(pre)
    toks = sum(len(r.token_ids) for r in pre)
    return f"{len(pre):2d} prefills ({cached} chunked), {toks:5d} prefill tokens, {dec} decodes"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.tiny:
        preset, device, dtype = "tiny-qwen3", "cpu", "float32"
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --tiny for the CPU", file=sys.stderr)
            return 2
        preset, device, dtype = "qwen3-0.6b", "cuda", "bfloat16"
    on_cuda = device == "cuda"
    modes = (args.modes.split(",") if args.modes
             else ["auto", "sdpa", "sdpa-default"] if on_cuda else ["auto"])
    print(f"torch {torch.__version__}, "
          + (f"{torch.cuda.get_device_name()}, cuDNN {torch.backends.cudnn.version()}"
             if on_cuda else "CPU")
          + f"; model {args.model_dir or preset} (dummy weights), {dtype}", flush=True)

    with tempfile.TemporaryDirectory(prefix="pdserve-prefill-") as tmp:
        if args.model_dir:
            model_dir = Path(args.model_dir)
            vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        else:
            model_dir = write_model_config(Path(tmp) / preset, preset)
            vocab = 1024 if args.tiny else 151936
        maker = StepMaker(args, vocab, args.block_size)
        num_blocks = maker.blocks_needed()
        t0 = time.perf_counter()
        runner = ModelRunner(EngineConfig(
            model=str(model_dir), load_format="dummy", dtype=dtype, device=device,
            seed=args.seed, block_size=args.block_size, max_model_len=max(4 * args.max_len, args.cached + args.tokens + 16),
            max_num_seqs=256, max_num_batched_tokens=args.tokens + args.decodes,
            num_gpu_blocks_override=num_blocks, enforce_eager=True))
        runner.allocate_kv_cache(num_blocks)
        print(f"runner ready in {time.perf_counter() - t0:.1f} s ({num_blocks} KV blocks)",
              flush=True)
        attn = runner.model.attn_backend
        pieces = None
        if args.piecewise:
            pieces = PiecewiseGraphs(runner.model, piecewise_capture_sizes(
                args.tokens + args.decodes), capture=on_cuda)
            pieces.capture()
        variants = [(mode, False) for mode in modes]
        if pieces is not None:
            variants = [(mode, graphs) for mode in modes for graphs in (False, True)]

        def label(mode: str, graphs: bool) -> str:
            return mode + ("+graphs" if graphs else "")

        def run(sched: SchedulerOutput) -> float:
            t = time.perf_counter()
            runner.execute(sched)
            return time.perf_counter() - t

        summary = {}
        for mode, graphs in variants:
            attn.prefill_mode = mode
            runner.piecewise_graphs = pieces if graphs else None
            run(maker.step(chunked=True))  # warm-up: Triton compiles, allocator caches
            run(maker.step(chunked=False))
            times = []
            for i in range(args.steps):
                sched = maker.step(chunked=i % 2 == 1)
                dt = run(sched)
                times.append(dt)
                print(f"[{label(mode, graphs):>15}] step {i}: {dt * 1e3:8.1f} ms  "
                      f"{describe(sched)}  (prefill attention: {attn.last_prefill_impl})",
                      flush=True)
            summary[label(mode, graphs)] = times

        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        sort_by = "self_device_time_total" if on_cuda else "self_cpu_time_total"
        for mode, graphs in variants:
            attn.prefill_mode = mode
            runner.piecewise_graphs = pieces if graphs else None
            sched = maker.step(chunked=True)
            with torch.profiler.profile(activities=activities) as prof:
                dt = run(sched)
            events = prof.key_averages()
            calls = sum(e.count for e in events)
            print(f"\n=== profile, prefill mode {label(mode, graphs)}: one step, {dt * 1e3:.1f} ms under the "
                  f"profiler, {describe(sched)}, {calls} operator calls ===")
            print(events.table(sort_by=sort_by, row_limit=args.rows, max_name_column_width=60))
            if on_cuda:  # host-side costs (e.g. cuDNN plan builds) hide from the device table
                print(f"--- the same step, top {args.rows // 2} by CPU time (host) ---")
                print(events.table(sort_by="cpu_time_total", row_limit=args.rows // 2,
                                   max_name_column_width=60))

        print("\nsummary (ms per step over the timed steps):")
        for mode, times in summary.items():
            ts = sorted(times)
            print(f"  {mode:>15}: mean {sum(ts) / len(ts) * 1e3:8.1f}, "
                  f"median {ts[len(ts) // 2] * 1e3:8.1f}, max {ts[-1] * 1e3:8.1f}")
        runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
