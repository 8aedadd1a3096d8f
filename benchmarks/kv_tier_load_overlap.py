"""How much of a host-tier LOAD a prefill step hides when the copies go by layer range.

A prefiller that is idle when a turn arrives loads the turn's history from its host tier and
then computes the new tokens; with the LOADs by layer range
(:meth:`pdserve.runner.kv_tier_store.KVTierStore.run` with ``by_layer``) each layer waits only
for its own range. This script times, on one CUDA device, a synthetic step: the LOAD of
``--blocks`` blocks of an 8B-class cache (``[L=32, 2, 8 KV heads, 16, 128]`` bf16, 2 MiB a
block) through a real :class:`~pdserve.runner.kv_tier_store.KVTierStore`, then ``L`` layers of
8B-class projections for ``--tokens`` tokens (one layer's weights reused: the FLOPs and the
weight reads of a layer, no attention). Rows:

* ``compute only``: the layers without a LOAD;
* ``whole-step wait``: the step waits for every block, then computes (the store without
  ``by_layer``: one copy-engine copy per block);
* ``by layer, P programs``: the LOAD by layer range with ``SEGMENT_COPY_PROGRAMS = P``, each
  layer waiting for its range;
* ``by layer, copy engines``: the same through the copy engines, one copy per block and range
  (``torch._foreach_copy_``) in four growing ranges (no copy time: not through the store).

Each row: step time from the LOAD's issue on an idle GPU to the last layer's end (wall time,
host launches included; median / max over ``--repeats`` repeats, ms) and the LOAD's own copy
time (median, ms, CUDA events on the copy stream). With ``--concurrent`` a second stream runs the same layers all the
while (another engine's steps sharing the GPU).

Example::

    python benchmarks/kv_tier_load_overlap.py --blocks 150 --tokens 320
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.kernels import block_copy
from pdserve.runner.kv_tier_store import KVTierStore, block_namespace
from pdserve.types.kv_tiers import KVTierJobs, TierJob, TierJobKind

LAYERS, HIDDEN, INTER, QKV = 32, 4096, 14336, 6144


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=150, help="blocks per LOAD (2 MiB each)")
    ap.add_argument("--tokens", type=int, default=320, help="tokens the step computes")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--programs", type=int, nargs="+", default=[8, 16, 32])
    ap.add_argument("--concurrent", action="store_true",
                    help="another stream computes the same layers all the while")
    args = ap.parse_args()
    dev = torch.device("cuda")
    n = args.blocks
    kv = torch.zeros((2 * n + 8, LAYERS, 2, 8, 16, 128), dtype=torch.bfloat16, device=dev)
    store = KVTierStore(kv, host_blocks=n, namespace=block_namespace("bench"))
    store.host.normal_()
    w = [torch.randn(shape, dtype=torch.bfloat16, device=dev) * 0.01
         for shape in ((HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTER), (INTER, HIDDEN))]
    x = torch.randn(args.tokens, HIDDEN, dtype=torch.bfloat16, device=dev)

    def layer(h: torch.Tensor) -> torch.Tensor:
        qkv = h @ w[0]
        h = h + (qkv[:, :HIDDEN] @ w[1]) * 0.01
        gu = h @ w[2]
        return h + (torch.nn.functional.silu(gu[:, :INTER]) * gu[:, INTER:]) @ w[3] * 0.01

    other = torch.cuda.Stream(dev)

    def background(on: bool) -> None:
        if on:
            with torch.cuda.stream(other):
                h = x.clone()
                for _ in range(LAYERS * 6):
                    h = layer(h)

    job_id = [0]

    copy_stream = torch.cuda.Stream(dev)

    def dma_ranges(dst_ids: list[int], slots: list[int]) -> dict[int, torch.cuda.Event]:
        """The LOAD by layer range through the copy engines: one copy per block and range
        (``torch._foreach_copy_``), ranges growing so that the copies stay ahead of the layers;
        the event of each range by its first layer."""
        out = {}
        copy_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(copy_stream):
            for lo, hi in ((0, 4), (4, 10), (10, 19), (19, LAYERS)):
                torch._foreach_copy_([kv[b, lo:hi] for b in dst_ids],
                                     [store.host[s, lo:hi] for s in slots], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record()
                out[lo] = ev
        return out

    def step(mode: str) -> tuple[float, float]:
        torch.cuda.synchronize()
        background(args.concurrent)
        t0 = time.perf_counter()
        ready = None
        ranges: dict[int, torch.cuda.Event] = {}  # first layer of a range -> its event
        if mode != "compute":
            base = n + 8 if job_id[0] % 2 else 8
            if mode == "dma":
                ranges = dma_ranges([base + i for i in range(n)], list(range(n)))
            else:
                jobs = [TierJob(TierJobKind.LOAD, job_id[0] * n + i, i, block_id=base + i,
                                slot=i) for i in range(n)]
                ready = store.run(KVTierJobs(jobs), by_layer=mode == "layer")
            job_id[0] += 1
        h = x
        for i in range(LAYERS):
            if ready is not None:
                ready.wait(i)
            if i in ranges:
                torch.cuda.current_stream().wait_event(ranges[i])
            h = layer(h)
        torch.cuda.current_stream().synchronize()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        copies = store.report().copy_times_s
        return (t1 - t0) * 1e3, (copies[0] * 1e3 if copies else 0.0)

    def row(label: str, mode: str) -> None:
        for _ in range(3):
            step(mode)
        runs = [step(mode) for _ in range(args.repeats)]
        total = [r[0] for r in runs]
        copy = [r[1] for r in runs]
        print(f"{label:<24} {statistics.median(total):8.2f} {max(total):8.2f} "
              f"{statistics.median(copy):8.2f}")

    print(f"{torch.cuda.get_device_name(dev)}; LOAD of {n} blocks ({n * store.block_nbytes / 2**20:.0f}"
          f" MiB), {args.tokens} tokens x {LAYERS} layers"
          f"{', another stream computing' if args.concurrent else ''}")
    print(f"{'row':<24} {'step p50':>8} {'max':>8} {'copy p50':>8}  (ms)")
    row("compute only", "compute")
    row("whole-step wait", "whole")
    default = block_copy.SEGMENT_COPY_PROGRAMS
    for p in args.programs:
        block_copy.SEGMENT_COPY_PROGRAMS = p
        row(f"by layer, {p} programs" + (" (default)" if p == default else ""), "layer")
    block_copy.SEGMENT_COPY_PROGRAMS = default
    row("by layer, copy engines", "dma")
    store.shutdown()


if __name__ == "__main__":
    main()
