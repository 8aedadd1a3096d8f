"""MLA decode attention over the paged latent cache: the split-K Triton kernel against the torch
path and a paged-read ceiling, in the same run.

One decode step of DeepSeek-V2-Lite's attention (by default: 16 heads at TP 1, latent 512 +
rotary 64, block size 16) over batches of equal contexts, on one layer of a cache with the real
layer count (``[num_blocks, 27, 2, 1, 16, 288]``, blocks scattered at random), so one layer's
entries are as far apart as in the engine. For each batch size and context length it prints:

* ``kernel``: :func:`pdserve.kernels.mla_decode.mla_decode_attention` (absorbed queries in,
  attention-weighted latents out; split count its default for the batch size);
* ``torch``: :func:`pdserve.attention.mla.decode_absorbed`, the same computation with torch ops
  (gather of the blocks, SDPA with a device-built mask): the CPU path, and the CUDA fallback;
* ``gather``: ``torch.index_select`` of exactly the blocks the step reads into a buffer: the
  bytes of the paged access pattern, read and written once, nothing computed (the ceiling a
  memory-bound kernel approaches).

Each time is the median of CUDA-graph replays (``triton.testing.do_bench_cudagraph``); bandwidth
is the latent bytes the step must read (context tokens x 576 values x bytes per value: 2, or 1
with ``--kv-cache-dtype fp8``) per second for all three columns (the gather also writes them).
``of gather`` is the gather's time over the kernel's (100%: the kernel reads at the paged-read
ceiling). ``rel err`` compares the kernel's output with the torch path's in float32.
``--sweep`` also times the kernel for ``block_n`` 16/32 x 4/8 warps x 8/16/32 context pieces and
prints the best launch of each row. Without CUDA the kernel runs in Triton's interpreter on
tiny shapes, to check this script, not to time it.

Examples::

    python benchmarks/mla_decode.py                          # H200: batches 1..128, 1k and 4k
    python benchmarks/mla_decode.py --kv-cache-dtype fp8 --batch-sizes 1,32
    python benchmarks/mla_decode.py --sweep --batch-sizes 1,32,128 --context-lens 4096
    python benchmarks/mla_decode.py --device cpu             # interpreter, tiny shapes
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time

import torch

FP8 = torch.float8_e4m3fn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--batch-sizes", default="1,8,32,128")
    p.add_argument("--context-lens", default="1024,4096", help="tokens per sequence")
    p.add_argument("--num-heads", type=int, default=16, help="query heads of one rank")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--rope-dim", type=int, default=64)
    p.add_argument("--num-layers", type=int, default=27)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    p.add_argument("--sweep", action="store_true",
                   help="also time other launches (block_n, warps, pieces) of the kernel")
    p.add_argument("--json", default=None, help="also write the rows here")
    return p.parse_args(argv)


def make_step(batch: int, ctx: int, args: argparse.Namespace, device: torch.device,
              gen: torch.Generator) -> dict:
    """A decode step: absorbed queries ``[B, H, W]``, the latent cache with every sequence's
    blocks scattered, block tables ``[B, M]`` and context lengths ``[B]``."""
    width = args.kv_lora_rank + args.rope_dim
    bs = args.block_size
    per_seq = -(-ctx // bs)
    num_blocks = batch * per_seq + 1
    cache = torch.randn(num_blocks, args.num_layers, 2, 1, bs, width // 2, generator=gen,
                        dtype=torch.bfloat16, device=device)
    if args.kv_cache_dtype == "fp8":
        cache = cache.to(FP8)
    tables = torch.randperm(num_blocks, generator=gen, device=device)[:batch * per_seq]
    q = torch.randn(batch, args.num_heads, width, generator=gen, device=device) * 0.1
    step = {"q": q.to(torch.bfloat16), "cache": cache,
            "tables": tables.view(batch, per_seq).to(torch.int32),
            "ctx": torch.full((batch,), ctx, dtype=torch.int32, device=device)}
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # filled before any other stream reads them
    return step


def check_step(step: dict, block_size: int) -> None:
    """Raise ValueError unless every block id of the step is a block of its cache, each
    sequence's table covers its context and no two sequences share a block (what the kernel's
    reads rely on; checked on the host, outside the timings)."""
    tables, ctx = step["tables"].cpu(), step["ctx"].cpu()
    num_blocks = step["cache"].shape[0]
    if tables.numel() and not 0 <= int(tables.min()) <= int(tables.max()) < num_blocks:
        raise ValueError(f"block ids outside [0, {num_blocks})")
    if int(ctx.max()) > tables.shape[1] * block_size:
        raise ValueError(f"a context of {int(ctx.max())} tokens needs more than the table's "
                         f"{tables.shape[1]} blocks of {block_size}")
    if tables.flatten().unique().numel() != tables.numel():
        raise ValueError("two table entries name the same block")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if not on_gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        args.batch_sizes, args.context_lens = "1,3", "20,40"
        args.num_heads, args.kv_lora_rank, args.rope_dim, args.num_layers = 4, 32, 8, 2
    import triton

    from pdserve.attention.mla import decode_absorbed
    from pdserve.kernels.mla_decode import mla_decode_attention

    device = torch.device("cuda" if on_gpu else "cpu")
    r, layer, scale = args.kv_lora_rank, args.num_layers // 2, 0.1
    k_scale = v_scale = 0.05 if args.kv_cache_dtype == "fp8" else 1.0
    elem = 1 if args.kv_cache_dtype == "fp8" else 2
    width = r + args.rope_dim

    def bench_us(fn) -> float:
        if on_gpu:
            # do_bench_cudagraph runs fn on a new stream, not ordered after the default stream's
            # queued work: the step's tensors (cache, block tables, context lengths) must be
            # written first, or the kernel reads block ids and lengths from memory not yet
            # filled (stale values of the last configuration's freed tensors: out-of-range
            # block ids, an illegal memory access)
            torch.cuda.synchronize(device)
            return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    name = torch.cuda.get_device_name(device) if on_gpu else "CPU (Triton interpreter)"
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}; {args.num_heads} "
          f"heads, latent {r} + rotary {args.rope_dim}, block size {args.block_size}, "
          f"{args.num_layers} layers, cache {args.kv_cache_dtype}")
    print(f"{'batch':>5} {'ctx':>6} {'MiB':>8} {'kernel us':>10} {'GB/s':>7} {'torch us':>9} "
          f"{'GB/s':>7} {'gather us':>9} {'GB/s':>7} {'of gather':>9} {'rel err':>8}")
    rows = []
    gen = torch.Generator(device=device).manual_seed(0)
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        for ctx in [int(c) for c in args.context_lens.split(",")]:
            s = make_step(batch, ctx, args, device, gen)
            check_step(s, args.block_size)
            kv_layer = s["cache"][:, layer]
            flat = s["tables"].flatten().long()
            gathered = torch.empty((flat.numel(), *kv_layer.shape[1:]), dtype=kv_layer.dtype,
                                   device=device)
            out = torch.empty(batch, args.num_heads, r, dtype=torch.bfloat16, device=device)

            def kernel():
                mla_decode_attention(s["q"], s["cache"], layer, s["tables"], s["ctx"], scale,
                                     r, k_scale, v_scale, out=out)

            def torch_path():
                return decode_absorbed(s["q"], kv_layer, s["tables"], s["ctx"], scale, r,
                                       k_scale, v_scale)

            def gather():
                torch.index_select(kv_layer, 0, flat, out=gathered)

            t_kernel, t_gather = bench_us(kernel), bench_us(gather)
            try:  # the torch path materializes the gathered blocks: large steps may not fit
                t_torch = bench_us(torch_path)
            except torch.OutOfMemoryError:
                t_torch = math.nan
                torch.cuda.empty_cache()
            sweep = {}
            if args.sweep:
                for bn, warps, pieces in itertools.product((16, 32), (4, 8), (8, 16, 32)):
                    sweep[f"block_n={bn} warps={warps} pieces={pieces}"] = bench_us(
                        lambda bn=bn, warps=warps, pieces=pieces: mla_decode_attention(
                            s["q"], s["cache"], layer, s["tables"], s["ctx"], scale, r, k_scale,
                            v_scale, out=out, num_splits=pieces, block_n=bn, num_warps=warps))
            kernel()
            try:
                ref = decode_absorbed(s["q"].float(), kv_layer.float() if elem == 2 else kv_layer,
                                      s["tables"], s["ctx"], scale, r, k_scale, v_scale)
                err = ((out.float() - ref).norm() / ref.norm()).item()
                del ref
            except torch.OutOfMemoryError:  # no reference for this step: its error is not known
                err = math.nan
                torch.cuda.empty_cache()
            nbytes = batch * ctx * width * elem
            row = {"batch": batch, "ctx": ctx, "bytes": nbytes, "kernel_us": t_kernel,
                   "torch_us": t_torch, "gather_us": t_gather, "rel_err": err, "sweep": sweep}
            rows.append(row)
            gbs = [nbytes / t / 1e3 for t in (t_kernel, t_torch, t_gather)]
            print(f"{batch:>5} {ctx:>6} {nbytes / 2**20:>8.2f} {t_kernel:>10.1f} {gbs[0]:>7.0f} "
                  f"{t_torch:>9.1f} {gbs[1]:>7.0f} {t_gather:>9.1f} {gbs[2]:>7.0f} "
                  f"{t_gather / t_kernel:>9.0%} {err:>8.1e}", flush=True)
            if sweep:
                best = min(sweep, key=sweep.get)
                print(f"      best launch: {best}: {sweep[best]:.1f} us "
                      f"({nbytes / sweep[best] / 1e3:.0f} GB/s)", flush=True)
            del s, gathered
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": name, "args": vars(args), "rows": rows}, fh, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
