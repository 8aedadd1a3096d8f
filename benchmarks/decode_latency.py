"""Batch-1 decode latency (TPOT) of pdserve, with and without CUDA graphs, plus kernel timings.

TPOT (time per output token) is measured end to end through
:class:`pdserve.engine.llm_engine.LLMEngine`: one request with a ``--input-len`` prompt is run to
1 output token and to ``--output-len`` tokens (``ignore_eos``), ``--repeats`` times each, and

    TPOT = (median time to N tokens - median time to 1 token) / (N - 1)

so prefill, start-up and the first token cancel out. Each repeat uses a fresh random prompt. The
model is Qwen3-0.6B with dummy weights (issue #8's target: TPOT <= 2 ms on one H200), another
preset of ``benchmarks/offline_throughput.py`` (e.g. ``deepseek-v2-lite``: multi-head latent
attention, 64 experts; 15.7B parameters, so at least ``--gpu-memory-utilization 0.5`` on an
80 GB card), or a tiny model for CPU checks. Modes: ``graphs`` (the default engine) and ``eager`` (``enforce_eager``).

``--kernels`` (CUDA; on a CPU with ``TRITON_INTERPRET=1`` it only checks the code on tiny
shapes) also times pdserve's Triton kernels against the torch code they
replace, on Qwen3-0.6B shapes, each captured in a CUDA graph (``triton.testing.do_bench_cudagraph``,
median), so the numbers are GPU time as a graph replay sees it, without launch overhead. The paged
decode attention is also swept over ``block_n`` and ``num_warps`` and reported in GB/s of KV read.

Examples::

    python benchmarks/decode_latency.py --kernels
    python benchmarks/decode_latency.py --model-preset deepseek-v2-lite --gpu-memory-utilization 0.6
    python benchmarks/decode_latency.py --model-preset tiny-qwen3 --input-len 8 --output-len 8 \\
        --modes eager --dtype float32 --kv-cache-memory 50000000
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline_throughput import MODEL_PRESETS, write_model_config  # noqa: E402


def measure_tpot(model_dir: Path, eager: bool, args: argparse.Namespace,
                 async_scheduling: bool = True) -> dict:
    """TPOT and TTFT-ish time of one engine mode (seconds), with overlapped scheduling on or
    off."""
    from pdserve.types.engine_config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.types.sampling_params import SamplingParams

    vocab = MODEL_PRESETS[args.model_preset]["vocab_size"]
    config = EngineConfig(
        model=str(model_dir),
        load_format="dummy",
        dtype=args.dtype,
        device=args.device,
        seed=0,
        max_model_len=args.input_len + args.output_len + 16,
        max_num_seqs=args.max_num_seqs,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_memory=args.kv_cache_memory,
        enforce_eager=eager,
        async_scheduling=async_scheduling,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    startup = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(1)

    def prompt() -> list[int]:
        return torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()

    def timed(max_tokens: int) -> float:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
        p = prompt()
        t = time.perf_counter()
        out = engine.generate([p], sp)[0]
        elapsed = time.perf_counter() - t
        if len(out.token_ids) != max_tokens:
            raise RuntimeError(f"asked for {max_tokens} tokens, got {len(out.token_ids)} "
                               f"({out.finish_reason}: {out.error})")
        return elapsed

    try:
        timed(min(8, args.output_len))  # warm-up (Triton compilation, allocator)
        one = [timed(1) for _ in range(args.repeats)]
        full = [timed(args.output_len) for _ in range(args.repeats)]
    finally:
        engine.shutdown()
        del engine
        # the engine's objects hold one another (reference cycles): without a collection its
        # weights outlive it and the next mode's engine starts beside them (twice the weights
        # in memory, and counted in its budget)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    t1, tn = statistics.median(one), statistics.median(full)
    return {
        "mode": ("eager" if eager else "graphs") + ("" if async_scheduling else "-sync"),
        "async_scheduling": async_scheduling,
        "startup_s": startup,
        "time_to_1_token_s": t1,
        f"time_to_{args.output_len}_tokens_s": tn,
        "tpot_ms": (tn - t1) / (args.output_len - 1) * 1e3,
        "raw_1": one,
        "raw_n": full,
    }


# ------------------------------------------------------------------------------------ kernels
def kernel_benchmarks(args: argparse.Namespace) -> list[dict]:
    """GPU time of the Triton kernels against their torch counterparts (CUDA only)."""
    import triton.testing

    from pdserve import attention as torch_attn
    from pdserve.kernels import kv_cache as kvk
    from pdserve.kernels import paged_decode as pd
    from pdserve.kernels import rms_norm as rn
    from pdserve.kernels import rotary as rot
    from pdserve.layers import norm as norm_layer
    from pdserve.layers import rotary as rotary_layer

    on_gpu = torch.cuda.is_available()
    dev = torch.device("cuda" if on_gpu else "cpu")
    dt = torch.bfloat16
    cfg = MODEL_PRESETS["qwen3-0.6b"]
    hq, hkv, d, hidden = (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"],
                          cfg["hidden_size"])
    bs = 16
    rows: list[dict] = []
    # Without CUDA (Triton interpreter) only tiny shapes run, to check this code, not to time it.
    attn_cases = [(1, 1024), (1, 8192), (32, 1024), (256, 600)] if on_gpu else [(1, 40), (3, 20)]
    token_counts = (1, 256, 8192) if on_gpu else (1, 3)
    cache_blocks = 4096 if on_gpu else 8
    sweep = ((16, 32, 64), (2, 4, 8), (1, 2)) if on_gpu else ((16,), (4,), (2,))

    def bench(fn) -> float:
        fn()
        if not on_gpu:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        torch.cuda.synchronize()
        return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3  # us

    def add(op, shape, variant, us, gbytes=None):
        row = {"op": op, "shape": shape, "variant": variant, "us": round(us, 2)}
        if gbytes is not None:
            row["GB/s"] = round(gbytes / (us * 1e-6), 1)
        rows.append(row)
        print(f"  {op:<16} {shape:<26} {variant:<26} {us:9.2f} us"
              + (f"  {row['GB/s']:8.1f} GB/s" if gbytes is not None else ""), flush=True)

    print("\nkernel timings " + ("(CUDA graph replay, median):" if on_gpu else
                                "(Triton interpreter on CPU: a code check, times are meaningless):"),
          flush=True)
    # --- paged decode attention
    for batch, ctx in attn_cases:
        nblk = -(-ctx // bs)
        num_blocks = batch * nblk + 8
        kv = torch.randn(num_blocks, 2, 2, hkv, bs, d, device=dev, dtype=dt)
        tables = torch.randperm(num_blocks, device=dev)[: batch * nblk].view(batch, nblk).int()
        lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
        q = torch.randn(batch, hq, d, device=dev, dtype=dt)
        out = torch.empty_like(q)
        kv_bytes = batch * ctx * hkv * d * 2 * 2 / 1e9
        shape = f"b={batch} ctx={ctx}"
        us = bench(lambda: pd.paged_decode_attention(q, kv, 1, tables, lens, d**-0.5, out=out))
        add("paged_decode", shape, f"default splits={pd.choose_num_splits(batch, hkv, dev)}", us, kv_bytes)
        for block_n in sweep[0]:
            for warps in sweep[1]:
                for stages in sweep[2]:
                    us = bench(lambda: pd.paged_decode_attention(
                        q, kv, 1, tables, lens, d**-0.5, out=out, block_n=block_n,
                        num_warps=warps, num_stages=stages))
                    add("paged_decode", shape, f"block_n={block_n} warps={warps} stages={stages}",
                        us, kv_bytes)
        for splits in ((1, 4, 8, 16, 32, 64) if on_gpu else (1, 3)):
            us = bench(lambda: pd.paged_decode_attention(q, kv, 1, tables, lens, d**-0.5, out=out,
                                                         num_splits=splits))
            add("paged_decode", shape, f"splits={splits}", us, kv_bytes)
        meta = torch_attn.build_attention_metadata(
            [], [(tables[i].tolist(), ctx - 1) for i in range(batch)], bs, dev)
        backend = torch_attn.TorchAttentionBackend(hq, hkv, d, bs, d**-0.5)
        us = bench(lambda: backend._decode(1, q, kv, meta))
        add("paged_decode", shape, "torch SDPA backend", us, kv_bytes)
        ref = backend._decode(1, q, kv, meta).float()
        got = pd.paged_decode_attention(q, kv, 1, tables, lens, d**-0.5).float()
        err = ((got - ref).norm() / ref.norm()).item()
        print(f"  {'':<16} {shape:<26} rel. error vs torch: {err:.2e}", flush=True)
        if not err < 2e-2:
            raise RuntimeError(f"paged decode attention disagrees with torch: {err}")
        del kv

    # --- KV cache write
    kv = torch.randn(cache_blocks, 28, 2, hkv, bs, d, device=dev, dtype=dt)
    for t in token_counts:
        k = torch.randn(t, hkv, d, device=dev, dtype=dt)
        v = torch.randn(t, hkv, d, device=dev, dtype=dt)
        slots = torch.randperm(cache_blocks * bs, device=dev)[:t]
        meta = torch_attn.AttentionMetadata(slot_mapping=slots, slot_block=slots // bs,
                                            slot_offset=slots % bs, num_prefill_tokens=t)
        gbytes = 2 * 2 * t * hkv * d * 2 / 1e9
        add("store_kv", f"T={t}", "triton", bench(lambda: kvk.store_kv_cache(k, v, kv, 3, slots)), gbytes)
        add("store_kv", f"T={t}", "torch index_put",
            bench(lambda: torch_attn.write_kv(kv, 3, k, v, meta)), gbytes)
    del kv

    # --- RMSNorm (+ residual)
    w = torch.randn(hidden, device=dev, dtype=dt)
    for t in token_counts:
        x = torch.randn(t, hidden, device=dev, dtype=dt)
        r = torch.randn(t, hidden, device=dev, dtype=dt)
        add("rms_norm+res", f"T={t}", "triton fused",
            bench(lambda: rn.rms_norm(x, w, 1e-6, residual=r)))
        add("rms_norm+res", f"T={t}", "torch (add + layers.norm.rms_norm)",
            bench(lambda: norm_layer.rms_norm(x + r, w, 1e-6)))

    # --- q/k RMSNorm + rotary
    cos = torch.randn(4096, d // 2, device=dev)
    sin = torch.randn(4096, d // 2, device=dev)
    wq = torch.randn(d, device=dev, dtype=dt)
    for t in token_counts:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt)
        q = qkv[:, : hq * d].view(t, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
        pos = torch.randint(0, 4096, (t,), device=dev)

        def fused():
            rot.rotary_embedding_qk(q, k, pos, cos, sin, wq, wq)

        def torch_version():
            c = cos[pos].to(dt).unsqueeze(1)
            s = sin[pos].to(dt).unsqueeze(1)
            rotary_layer.apply_rotary(norm_layer.rms_norm(q, wq, 1e-6), c, s)
            rotary_layer.apply_rotary(norm_layer.rms_norm(k, wq, 1e-6), c, s)

        add("qk_norm+rope", f"T={t}", "triton fused (q and k)", bench(fused))
        add("qk_norm+rope", f"T={t}", "torch (layer ops)", bench(torch_version))

    # --- q/k RMSNorm + rotary + KV write: one launch against the two the backend used before
    kv = torch.randn(cache_blocks, 28, 2, hkv, bs, d, device=dev, dtype=dt)
    for t in token_counts:
        qkv = torch.randn(t, (hq + 2 * hkv) * d, device=dev, dtype=dt)
        q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hkv * d, hkv * d], 1))
        pos = torch.randint(0, 4096, (t,), device=dev)
        slots = torch.randperm(cache_blocks * bs, device=dev)[:t]
        add("qk_norm+rope+store_kv", f"T={t}", "triton, one launch",
            bench(lambda: rot.rotary_embedding_qk_store(q, k, v, pos, cos, sin, kv, 3, slots,
                                                         wq, wq)))
        add("qk_norm+rope+store_kv", f"T={t}", "triton, rotary then store",
            bench(lambda: (rot.rotary_embedding_qk(q, k, pos, cos, sin, wq, wq),
                           kvk.store_kv_cache(k, v, kv, 3, slots))))
    del kv

    # --- the fused draw over Qwen3's vocabulary against torch's exponential race (five passes)
    from pdserve.kernels import sampling as ts

    vocab = cfg["vocab_size"] if on_gpu else 100
    for rows_n in ((1, 64, 137, 256) if on_gpu else (1, 3)):
        logits = torch.randn(rows_n, vocab, device=dev, dtype=dt)
        temps = torch.ones(rows_n, device=dev)
        ids = torch.arange(rows_n, device=dev)
        add("draw", f"rows={rows_n} V={vocab}", "triton fused (inverse CDF)",
            bench(lambda: ts.draw_tokens(logits, temps, ids, ids)))
        add("draw", f"rows={rows_n} V={vocab}", "torch (softmax, exponential race)",
            bench(lambda: (torch.softmax(logits.float() / temps[:, None], -1)
                           / torch.empty_like(logits, dtype=torch.float32).exponential_()).argmax(-1)))

    # --- linear layers at decode batch sizes: the Triton kernel for 1-2 rows vs F.linear
    from pdserve.kernels import gemv

    inter = cfg["intermediate_size"]
    projections = {"qkv_proj": ((hq + 2 * hkv) * d, hidden), "o_proj": (hidden, hq * d),
                   "gate_up_proj": (2 * inter, hidden), "down_proj": (hidden, inter)}
    for name, (n, k) in projections.items():
        if not on_gpu:
            n, k = 24, 40
        w = torch.randn(n, k, device=dev, dtype=dt) * 0.02
        for m in ((1, 2, 4) if on_gpu else (1, 2)):
            x = torch.randn(m, k, device=dev, dtype=dt)
            gbytes = n * k * 2 / 1e9
            add(name, f"rows={m} {n}x{k}", "torch F.linear",
                bench(lambda: torch.nn.functional.linear(x, w)), gbytes)
            if m <= gemv.MAX_ROWS:
                ref = torch.nn.functional.linear(x.float(), w.float())
                err = ((gemv.small_batch_linear(x, w).float() - ref).norm() / ref.norm()).item()
                if not err < 1e-2:
                    raise RuntimeError(f"small_batch_linear disagrees with F.linear: {err}")
                add(name, f"rows={m} {n}x{k}", "triton small_batch_linear",
                    bench(lambda: gemv.small_batch_linear(x, w)), gbytes)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-preset", choices=sorted(MODEL_PRESETS), default="qwen3-0.6b")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="graphs,eager", help="comma-separated: graphs, eager")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float16", "float32"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache bytes (CPU)")
    p.add_argument("--kernels", action="store_true", help="also time the Triton kernels (CUDA)")
    p.add_argument("--skip-engine", action="store_true", help="only the kernel timings")
    p.add_argument("--async-scheduling", choices=["on", "off", "both"], default="on",
                   help="overlapped scheduling (the engine default: on), synchronous steps, or "
                        "both in the same run")
    p.add_argument("--output-json", default=None)
    args = p.parse_args(argv)
    if args.output_len < 2:
        p.error("--output-len must be at least 2")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if any(m not in ("graphs", "eager") for m in modes):
        p.error("--modes takes graphs and/or eager")
    args.modes = modes
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    results: dict = {"engine": [], "kernels": [], "failures": []}
    print(f"torch {torch.__version__}, "
          + (torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU")
          + f", model {args.model_preset} (dummy weights), {args.dtype}, "
            f"prompt {args.input_len}, output {args.output_len}", flush=True)
    if not args.skip_engine:
        tmp = Path(tempfile.mkdtemp(prefix="pdserve-tpot-"))
        try:
            model_dir = write_model_config(tmp / args.model_preset, args.model_preset)
            overlap = {"on": [True], "off": [False], "both": [True, False]}[args.async_scheduling]
            for mode, async_on in [(m, a) for m in args.modes for a in overlap]:
                try:
                    r = measure_tpot(model_dir, eager=mode == "eager", args=args,
                                     async_scheduling=async_on)
                except Exception as exc:
                    results["failures"].append(f"{mode}: {type(exc).__name__}: {exc}")
                    print(f"[{mode}] FAILED: {exc!r}", file=sys.stderr, flush=True)
                    continue
                results["engine"].append(r)
                label = r["mode"] + (" (enforce_eager=False)" if mode == "graphs" else "") \
                    + (", overlapped scheduling" if async_on else ", synchronous steps")
                print(f"[{label}] TPOT {r['tpot_ms']:.3f} ms (1 token "
                      f"{r['time_to_1_token_s'] * 1e3:.1f} ms, "
                      f"engine start {r['startup_s']:.1f} s)", flush=True)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.kernels:
        if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            print("--kernels needs CUDA (or TRITON_INTERPRET=1 for a code check); skipped", flush=True)
        else:
            try:
                results["kernels"] = kernel_benchmarks(args)
            except Exception as exc:
                results["failures"].append(f"kernels: {type(exc).__name__}: {exc}")
                print(f"[kernels] FAILED: {exc!r}", file=sys.stderr, flush=True)
    if results["engine"]:
        print("\nmode          batch-1 TPOT (ms)")
        for r in results["engine"]:
            print(f"{r['mode']:<13} {r['tpot_ms']:>17.3f}")
    if args.output_json:
        with open(args.output_json, "w") as fh:
            json.dump({"args": vars(args), **results}, fh, indent=2)
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
