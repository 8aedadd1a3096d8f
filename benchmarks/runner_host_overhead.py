"""Host cost of the model runner's pure-decode step, without a GPU: input preparation of a
replayed decode graph, the sampler's per-step plan, and launching and reading an overlapped step.

The model runner of a CUDA machine replays a captured graph for a pure-decode batch
(:meth:`DecodeGraphReplay.replay <pdserve.runner.decode_graphs.DecodeGraphReplay.replay>`): it
builds the token ids, positions, slots, context lengths and block tables of the batch on the host
and copies them into the graph's static buffers, then the sampler plans the draw
(:meth:`Sampler.plan <pdserve.runner.sampler.Sampler.plan>`, per-row temperatures, seeds and output
positions) and :class:`~pdserve.runner.step_launch.StepLauncher` keeps the tokens on the device
until :meth:`PendingRunnerStep.result <pdserve.runner.step_launch.PendingRunnerStep.result>` reads
them. This script runs that same code on the CPU with stand-ins for the device parts:

- the graph's static buffers live on the ``meta`` device, so copying into them and padding them
  costs the dispatcher's time (as a launch does on CUDA) but no memory traffic (which a GPU does
  on its own time); the replay returns a ``meta`` logits view;
- the sampler takes its fused (CUDA) planning path, and its draw returns a token per row without
  computing on the logits.

What remains is the host's own work per step: Python loops over the requests, numpy and torch
tensor construction, the dispatcher's calls. Pinned-memory allocation, CUDA events and the
driver's launch and copy costs of a real GPU are not in it.

The batch: ``--rows`` (256) decoding requests whose contexts start uniformly in
``--min-blocks .. --max-blocks`` (30..130) blocks of 16 tokens, each fed the previous step's
token on the device (async scheduling) and sampled at temperature 1 (top-p 1), as
``benchmarks/offline_throughput.py`` samples. Each timed step advances every request by one
token (a request gets a new block when its last one is full; after ``--max-blocks`` blocks it
finishes and a new request with a fresh block table takes its row), so per-request state the
runner might keep sees the usual turnover. Times are CPU time of the thread
(``time.thread_time``), medians over ``--repeats`` (5) runs of ``--steps`` (400) steps:

- ``replay``: ``DecodeGraphReplay.replay`` (host inputs plus the static-buffer copies);
- ``plan``: ``Sampler.sample_on_device`` (the ``min_tokens`` check and the fused plan);
- ``step``: ``StepLauncher.launch`` plus ``PendingRunnerStep.result``: the whole runner step
  (``forward_logits``, sampling, reading the tokens), which includes the two above.

``--profile PART`` prints a cProfile top list of one more run of ``PART``.

Usage::

    python benchmarks/runner_host_overhead.py [--rows 256] [--min-blocks 30] [--max-blocks 130]
        [--steps 400] [--repeats 5] [--profile replay|plan|step]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import sys
import time
from types import SimpleNamespace

import torch

from pdserve.types.outputs import PLACEHOLDER_TOKEN, SchedulerOutput, ScheduledRequest
from pdserve.types.sampling_params import SamplingParams
from pdserve.runner.block_tables import DecodeBlockTables
from pdserve.runner.cuda_graphs import CUDAGraphRunner, StaticInputSpec, default_capture_sizes
from pdserve.runner.decode_graphs import DecodeGraphReplay
from pdserve.runner.device_tokens import DeviceTokens
from pdserve.runner.model_runner import ModelRunner
from pdserve.runner.sampler import Sampler
from pdserve.runner.step_launch import StepLauncher

BLOCK_SIZE = 16
MAX_MODEL_LEN = 40_960  # Qwen3-0.6B's max_position_embeddings
VOCAB = 151_936


class _Graph:
    """A captured graph whose replay does nothing."""

    def replay(self) -> None:
        pass


def meta_graphs(max_batch_size: int, max_blocks_per_seq: int) -> CUDAGraphRunner:
    """A :class:`CUDAGraphRunner` of the decode graph's inputs (as ``capture_decode_graphs``
    declares them) whose static buffers and ``[batch, VOCAB]`` output live on the ``meta``
    device, "captured" for every default size up to ``max_batch_size``."""
    specs = {
        "input_ids": StaticInputSpec((), torch.int64, 0),
        "positions": StaticInputSpec((), torch.int64, 0),
        "slot_mapping": StaticInputSpec((), torch.int64, -1),
        "block_tables": StaticInputSpec((max_blocks_per_seq,), torch.int32, 0),
        "context_lens": StaticInputSpec((), torch.int32, 0),
    }
    graphs = CUDAGraphRunner.__new__(CUDAGraphRunner)
    graphs.specs = specs
    graphs.capture_sizes = default_capture_sizes(max_batch_size)
    graphs.max_batch_size = max_batch_size
    graphs.device = torch.device("meta")
    graphs.buffers = {name: torch.full((max_batch_size, *s.shape), s.pad_value, dtype=s.dtype,
                                       device="meta") for name, s in specs.items()}
    graphs._graphs = {bs: _Graph() for bs in graphs.capture_sizes}
    graphs._outputs = {bs: torch.empty((bs, VOCAB), dtype=torch.bfloat16, device="meta")
                       for bs in graphs.capture_sizes}
    return graphs


def _draw(logits, temperatures, seeds, positions, step):
    """The fused draw's stand-in: one int64 token per row (the row's output position)."""
    return positions.clone()


def stand_in_runner(rows: int) -> SimpleNamespace:
    """The attributes of a :class:`ModelRunner` that a decode step reads, on the CPU, with
    :meth:`ModelRunner.forward_logits` bound to it."""
    sampler = Sampler(torch.device("cpu"), seed=0, fused=False)
    sampler._draw_tokens = _draw  # the fused planning path, as on CUDA
    runner = SimpleNamespace(
        block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN,
        max_blocks_per_seq=-(-MAX_MODEL_LEN // BLOCK_SIZE), device=torch.device("cpu"),
        kv_cache=torch.empty(0), sampler=sampler, piecewise_graphs=None)
    runner.decode_graphs = meta_graphs(rows, runner.max_blocks_per_seq)
    runner._decode_replay = DecodeGraphReplay(DecodeBlockTables(runner.max_blocks_per_seq),
                                              BLOCK_SIZE, MAX_MODEL_LEN, runner.device)
    runner.forward_logits = ModelRunner.forward_logits.__get__(runner)
    return runner


class DecodeBatch:
    """``rows`` decoding requests that each advance one token per step (module docstring)."""

    def __init__(self, rows: int, min_blocks: int, max_blocks: int, seed: int = 0):
        self.rng = random.Random(seed)
        self.min_blocks, self.max_blocks = min_blocks, max_blocks
        self.next_id = 0
        self.next_block = 0
        self.params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=1 << 20,
                                     ignore_eos=True)
        self.reqs = [self._new() for _ in range(rows)]

    def _new(self) -> ScheduledRequest:
        n = self.rng.randint((self.min_blocks - 1) * BLOCK_SIZE, self.max_blocks * BLOCK_SIZE - 1)
        blocks = [self._block() for _ in range(n // BLOCK_SIZE + 1)]
        self.next_id += 1
        return ScheduledRequest(
            request_id=f"r{self.next_id}", token_ids=[PLACEHOLDER_TOKEN], num_computed_tokens=n,
            block_ids=blocks, sample=True, sampling_params=self.params, prompt_token_ids=[],
            output_token_ids=[], input_from_previous_step=True, num_output_tokens=n % 997)

    def _block(self) -> int:
        self.next_block = (self.next_block + 7919) % 1_000_003
        return self.next_block

    def advance(self) -> list[str]:
        """Advance every request by a token; returns the ids of the requests that finished."""
        finished = []
        for i, r in enumerate(self.reqs):
            n = r.num_computed_tokens + 1
            if n >= self.max_blocks * BLOCK_SIZE:
                finished.append(r.request_id)
                self.reqs[i] = self._new()
                continue
            if n // BLOCK_SIZE >= len(r.block_ids):
                r.block_ids.append(self._block())
            self.reqs[i] = ScheduledRequest(
                request_id=r.request_id, token_ids=[PLACEHOLDER_TOKEN], num_computed_tokens=n,
                block_ids=r.block_ids, sample=True, sampling_params=r.sampling_params,
                prompt_token_ids=[], output_token_ids=[], input_from_previous_step=True,
                num_output_tokens=r.num_output_tokens + 1)
        return finished


def time_steps(what: str, args, profile: cProfile.Profile | None = None) -> float:
    """CPU seconds per step of ``what`` (``replay``, ``plan`` or ``step``) over ``args.steps``
    steps of a fresh batch."""
    runner = stand_in_runner(args.rows)
    batch = DecodeBatch(args.rows, args.min_blocks, args.max_blocks)
    launcher = StepLauncher(runner.forward_logits, runner.sampler, runner.device)
    graphs = runner.decode_graphs
    logits = graphs._outputs[graphs.padded_size(args.rows)][:args.rows]
    previous = DeviceTokens({r.request_id: i for i, r in enumerate(batch.reqs)},
                            torch.zeros(args.rows, dtype=torch.int64))
    launcher.previous = previous
    finished: list[str] = []
    total = 0.0
    for _ in range(args.steps):
        reqs = batch.reqs
        sched = SchedulerOutput(scheduled=reqs, finished_request_ids=set(finished),
                                total_num_scheduled_tokens=len(reqs))
        if profile is not None:
            profile.enable()
        t0 = time.thread_time()
        if what == "replay":
            runner._decode_replay.replay(reqs, graphs, previous)
        elif what == "plan":
            runner.sampler.sample_on_device(logits, reqs)
        else:
            launcher.launch(sched, runner.kv_cache, None).result()
        total += time.thread_time() - t0
        if profile is not None:
            profile.disable()
        finished = batch.advance()
        # every request of the batch was sampled by the step before (new ones too, in effect)
        previous = DeviceTokens({r.request_id: i for i, r in enumerate(batch.reqs)},
                                previous.tokens)
        launcher.previous = previous
    return total / args.steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--min-blocks", type=int, default=30)
    ap.add_argument("--max-blocks", type=int, default=130)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--profile", choices=["replay", "plan", "step"],
                    help="print a cProfile top list of one more run of this part")
    ap.add_argument("--top", type=int, default=30, help="entries of the profile list")
    args = ap.parse_args()
    torch.set_num_threads(1)

    names = ["replay", "plan", "step"]
    runs: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.repeats):
        for n in names:
            runs[n].append(time_steps(n, args))
    for n in names:
        each = ", ".join(f"{1e6 * s:.0f}" for s in runs[n])
        print(f"{n:>7}: {1e6 * statistics.median(runs[n]):8.1f} us/step at {args.rows} rows "
              f"(best {1e6 * min(runs[n]):.1f}; runs: {each} us)")
    if args.profile:
        prof = cProfile.Profile()
        time_steps(args.profile, args, prof)
        print(f"\n--- cProfile, {args.profile} (own time) ---")
        pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
