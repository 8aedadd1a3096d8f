"""Paged decode attention bandwidth on a mixed-length batch, next to the GPU's copy and read
bandwidth measured in the same run.

The batch imitates a decode step of ``benchmarks/offline_throughput.py``: every sequence has an
input length and an output length uniform in ``[--min-len, --max-len]`` (seed 0) and has generated
a uniform fraction of its output, so contexts spread over about 100-2,000 tokens. Blocks are
scattered over a KV cache with the real layer count (``[num_blocks, num_layers, 2, Hkv, 16, D]``),
so one layer's K/V rows are as far apart as in the engine.

For each batch size it times :func:`pdserve.kernels.paged_decode.paged_decode_attention` on one
layer, for the default launch (:func:`~pdserve.kernels.paged_decode.decode_kernel_config`) and
for a sweep of ``block_n`` x ``num_warps`` x ``num_stages`` x split counts, each call replayed in a
CUDA graph (``triton.testing.do_bench_cudagraph``, median). Bandwidth counts the K and V bytes the
kernel must read (context tokens x Hkv x head_dim x 2 x bytes per value: 2, or 1 with
``--kv-cache-dtype fp8``, where ``--fp8-dot`` adds the dtype of the dot products to the sweep).
Baselines, same run, same bytes:

* ``read``: ``torch.sum`` over a contiguous bf16 buffer (bytes read / time);
* ``copy``: ``Tensor.copy_`` between two contiguous buffers (bytes read + written / time);
* ``paged read``: a Triton kernel that only reads the same K and V chunks through the same block
  tables and sums them (one program per sequence and KV head, four blocks per iteration, eight
  warps, no softmax and no splits): what the scattered access pattern itself allows.

``--json`` writes all rows and the best launch found; ``--best-config-out`` writes that launch as
the JSON object ``PDSERVE_DECODE_KERNEL_CONFIG`` takes. Needs CUDA.

Example::

    python benchmarks/decode_attention.py --batch-sizes 32,136,256 --json attn.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys

import torch


def paged_read_us(kv_layer: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor, bench_us) -> float:
    """Time (µs) of the ``paged read`` baseline (module docstring) over ``kv_layer``
    ``[num_blocks, 2, Hkv, block_size, D]`` for the sequences of ``tables``/``ctx``."""
    import triton
    import triton.language as tl

    @triton.jit
    def _paged_read(kv_ptr, bt_ptr, ctx_ptr, out_ptr, stride_b, stride_kv, stride_h, stride_bt,
                    BS: tl.constexpr, D: tl.constexpr, BLOCKS: tl.constexpr):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        nblk = tl.cdiv(tl.load(ctx_ptr + seq), BS)
        offs = tl.arange(0, BS)[:, None] * D + tl.arange(0, D)[None, :]
        acc = tl.zeros([BS, D], tl.float32)
        for b0 in range(0, nblk, BLOCKS):
            for j in tl.static_range(BLOCKS):
                blk = tl.load(bt_ptr + seq * stride_bt + b0 + j, mask=b0 + j < nblk, other=0).to(tl.int64)
                base = kv_ptr + blk * stride_b + head * stride_h
                m = (tl.zeros([BS, D], tl.int32) + b0 + j) < nblk
                k = tl.load(base + offs, mask=m, other=0.0)
                v = tl.load(base + stride_kv + offs, mask=m, other=0.0)
                acc += k.to(tl.float32) + v.to(tl.float32)
        tl.store(out_ptr + seq * tl.num_programs(1) + head, tl.sum(tl.sum(acc, 1), 0))

    num_kv_heads, block_size, head_dim = kv_layer.shape[2:]
    out = torch.empty(tables.shape[0], num_kv_heads, device=kv_layer.device)
    return bench_us(lambda: _paged_read[(tables.shape[0], num_kv_heads)](
        kv_layer, tables, ctx, out, kv_layer.stride(0), kv_layer.stride(1), kv_layer.stride(2),
        tables.stride(0), BS=block_size, D=head_dim, BLOCKS=4, num_warps=8, num_stages=3))


def make_batch(batch: int, min_len: int, max_len: int, gen: torch.Generator) -> list[int]:
    """Context lengths (tokens) of one decode step of the offline-throughput workload."""
    lens = []
    for _ in range(batch):
        inp = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        out = int(torch.randint(min_len, max_len + 1, (1,), generator=gen))
        lens.append(inp + 1 + int(torch.rand(1, generator=gen) * out))
    return lens


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", default="32,136,256")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--num-layers", type=int, default=28)
    p.add_argument("--num-q-heads", type=int, default=16)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--block-n", default="16,32,64")
    p.add_argument("--num-warps", default="2,4,8")
    p.add_argument("--num-stages", default="2,3,4")
    p.add_argument("--splits", default="auto,1,2,4,8,16")
    p.add_argument("--kv-cache-dtype", choices=("bf16", "fp8"), default="bf16",
                   help="fp8: an e4m3 cache (half the bytes), as --kv-cache-dtype fp8 stores it")
    p.add_argument("--fp8-dot", default="fp16",
                   help="with an fp8 cache: the dtypes the dot products run in, swept (fp16,bf16)")
    p.add_argument("--json", default=None)
    p.add_argument("--best-config-out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_attention.py needs CUDA", file=sys.stderr)
        return 2
    import triton.testing

    from pdserve.kernels import paged_decode as ta

    dev = torch.device("cuda")
    dt = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, bs = args.num_q_heads, args.num_kv_heads, args.head_dim, args.block_size
    batches = [int(x) for x in args.batch_sizes.split(",")]
    cases = {b: make_batch(b, args.min_len, args.max_len, gen) for b in batches}
    total_blocks = max(sum(-(-n // bs) for n in lens) for lens in cases.values()) + 8
    fp8 = args.kv_cache_dtype == "fp8"
    kv = torch.empty(total_blocks, args.num_layers, 2, hkv, bs, d, device=dev,
                     dtype=torch.float8_e4m3fn if fp8 else dt)
    for lay in range(args.num_layers):  # one layer at a time: no second full-size buffer
        kv[:, lay].copy_(torch.randn(kv[:, lay].shape, device=dev, dtype=dt))
    elt = kv.element_size()
    dots = {"fp16": torch.float16, "bf16": torch.bfloat16}
    fp8_dots = [x for x in args.fp8_dot.split(",")] if fp8 else [None]
    layer = args.num_layers // 2
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | KV cache "
          f"{kv.numel() * elt / 2**30:.1f} GiB {args.kv_cache_dtype}, {args.num_layers} layers, Hq={hq} Hkv={hkv} D={d} "
          f"block {bs} | default launch {ta.decode_kernel_config()}", flush=True)

    def bench_us(fn) -> float:
        fn()
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3

    def sweep_points():
        for bn, w, st in itertools.product(
                [int(x) for x in args.block_n.split(",")], [int(x) for x in args.num_warps.split(",")],
                [int(x) for x in args.num_stages.split(",")]):
            for sp in args.splits.split(","):
                yield bn, w, st, sp

    rows: list[dict] = []
    scores: dict[tuple, list[float]] = {}
    for batch, lens in cases.items():
        gb = sum(lens) * hkv * d * 2 * elt / 1e9
        src = torch.empty(int(gb * 1e9) // 2, device=dev, dtype=dt).normal_()
        dst = torch.empty_like(src)
        read_us = bench_us(lambda: src.sum(dtype=torch.float32))
        copy_us = bench_us(lambda: dst.copy_(src))
        read_bw, copy_bw = gb / (read_us * 1e-6), 2 * gb / (copy_us * 1e-6)
        del src, dst
        perm = torch.randperm(total_blocks, generator=gen)
        nblk = [-(-n // bs) for n in lens]
        tables = torch.zeros(batch, max(nblk), dtype=torch.int32)
        used = 0
        for i, nb in enumerate(nblk):
            tables[i, :nb] = perm[used:used + nb].to(torch.int32)
            used += nb
        tables = tables.to(dev)
        ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        paged_bw = gb / (paged_read_us(kv[:, layer], tables, ctx, bench_us) * 1e-6)
        print(f"\nbatch {batch}: contexts {min(lens)}-{max(lens)} (mean {sum(lens) / batch:.0f}) "
              f"tokens, {gb * 1e3:.1f} MB of K/V per layer | read {read_bw / 1e3:.2f} TB/s, "
              f"copy {copy_bw / 1e3:.2f} TB/s, paged read {paged_bw / 1e3:.2f} TB/s", flush=True)
        ref = ta.paged_decode_attention(q, kv, layer, tables, ctx, d**-0.5, num_splits=1).float()

        def run(label: str, key: tuple | None, **kw) -> None:
            fn = lambda: ta.paged_decode_attention(q, kv, layer, tables, ctx, d**-0.5, out=out, **kw)  # noqa: E731
            us = bench_us(fn)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            if not err < 2e-2:
                raise RuntimeError(f"{label}: result differs from the 1-split launch ({err:.2e})")
            bw = gb / (us * 1e-6)
            rows.append({"batch": batch, "launch": label, "us": round(us, 2), "TB/s": round(bw / 1e3, 3),
                         "of_read": round(bw / read_bw, 3), "read_TB/s": round(read_bw / 1e3, 3),
                         "copy_TB/s": round(copy_bw / 1e3, 3)})
            if key is not None:
                scores.setdefault(key, []).append(bw / read_bw)
            print(f"  {label:<56} {us:8.1f} us  {bw / 1e3:5.2f} TB/s  {bw / read_bw:5.0%} of read",
                  flush=True)

        run(f"default (splits={ta.choose_num_splits(batch, hkv, dev)})", None)
        for (bn, w, st, sp), dot in itertools.product(sweep_points(), fp8_dots):
            splits = None if sp == "auto" else int(sp)
            label = f"block_n={bn} warps={w} stages={st} splits={sp}" + (f" dot={dot}" if dot else "")
            extra = {"fp8_dot_dtype": dots[dot]} if dot else {}
            try:
                run(label, (bn, w, st, sp, dot), block_n=bn, num_warps=w, num_stages=st,
                    num_splits=splits, **extra)
            except triton.runtime.errors.OutOfResources as e:
                print(f"  {label:<56} skipped: {e}", flush=True)

    # Best launch: highest geometric mean of (bandwidth / read bandwidth) over the batch sizes.
    full = {k: v for k, v in scores.items() if len(v) == len(batches)}
    best_key = max(full, key=lambda k: math.prod(full[k]) ** (1 / len(batches)))
    bn, w, st, sp, dot = best_key
    gmean = math.prod(full[best_key]) ** (1 / len(batches))
    print(f"\nbest launch over batch sizes {batches} ({args.kv_cache_dtype} cache): block_n={bn} "
          f"warps={w} stages={st} splits={sp}{f' dot={dot}' if dot else ''} ({gmean:.0%} of read "
          "bandwidth, geometric mean)", flush=True)
    best = {"block_n": bn, "num_warps": w, "num_stages": st}
    if fp8:  # the config keys of an fp8 cache (pdserve.kernels.paged_decode.DecodeKernelConfig)
        best = {f"fp8_{key}": value for key, value in best.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "best": best | {"splits": sp, "fp8_dot": dot},
                       "kv_cache_dtype": args.kv_cache_dtype, "best_of_read": gmean}, f, indent=1)
    if args.best_config_out:
        with open(args.best_config_out, "w") as f:
            json.dump(best, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
