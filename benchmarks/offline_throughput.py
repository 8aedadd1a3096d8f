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

Where the time goes: ``--watch-pauses``, ``--profile-decode N``, ``--host-profile ROWS`` and, on
CUDA, the GPU time line printed after every run (benchmarks/run_diagnostics.py).

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
    # DeepSeek-V2-Lite shaped (MLA, 64 experts top-6 + 2 shared), dummy weights
    python benchmarks/offline_throughput.py --model-preset deepseek-v2-lite --hf-max-prompts 64
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
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from model_configs import (deepseek_v2_lite_config, qwen2_5_7b_config, qwen3_30b_a3b_config,
                           tiny_config, tiny_deepseek_config)
from workload import Workload, make_workload
from run_diagnostics import PauseWatch, StepTimer, on_cuda, sync_device, profile_decode_steps, profile_host

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
                 "tiny-qwen2": tiny_config(qwen2_5_7b_config()),
                 "deepseek-v2-lite": deepseek_v2_lite_config(),
                 "tiny-deepseek-v2-lite": tiny_deepseek_config(deepseek_v2_lite_config())}


def write_model_config(directory: Path, preset: str) -> Path:
    """Write ``config.json`` of a model preset into ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "config.json", "w") as fh:
        json.dump(MODEL_PRESETS[preset], fh, indent=2)
    return directory


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


def _free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_pdserve(model_dir: Path, work: Workload, args: argparse.Namespace,
                async_scheduling: bool = True) -> Result:
    """Generate the workload with :class:`pdserve.engine.llm_engine.LLMEngine`, with overlapped
    scheduling (result ``pdserve``) or synchronous steps (``pdserve-sync``)."""
    label = "pdserve" if async_scheduling else "pdserve-sync"
    from pdserve.types.engine_config import EngineConfig, KVCacheDtype
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.types.sampling_params import SamplingParams

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
    if args.piecewise_cuda_graph_max_tokens is not None:
        config.piecewise_cuda_graph_max_tokens = args.piecewise_cuda_graph_max_tokens
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
        sync_device(args.device)
        stats = StepTimer(engine.core.runner, label, cuda=on_cuda(args.device))
        pauses = PauseWatch(stats) if args.watch_pauses else None
        t0 = time.perf_counter()
        outputs = engine.generate(work.prompts, params)
        sync_device(args.device)
        seconds = time.perf_counter() - t0
        stats.report(seconds)
        if pauses is not None:
            pauses.report()
        attn = engine.core.runner.model.attn_backend
        from pdserve.attention.torch_backend import TorchAttentionBackend

        if isinstance(attn, TorchAttentionBackend):  # per-head models
            print(f"[{label}] prefill attention: {attn.last_prefill_impl}", flush=True)
        else:  # multi-head latent attention (its own prefill forms)
            print(f"[{label}] attention backend: {type(attn).__name__}", flush=True)
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
        sync_device(device)
        t0 = time.perf_counter()
        for i, batch in enumerate(batches):
            max_new = max(work.output_lens[j] for j in batch)
            out = generate(batch, max_new)
            if out.shape[1] - max(len(work.prompts[j]) for j in batch) != max_new:
                raise RuntimeError("transformers stopped early despite min_new_tokens")
            print(f"[transformers] batch {i + 1}/{len(batches)}: {len(batch)} requests, "
                  f"{max_new} steps, {time.perf_counter() - t0:.1f} s so far", flush=True)
        sync_device(device)
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
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None, metavar="N",
                   help="pdserve's steps with prefills of up to N tokens replay CUDA graphs "
                        "between attention calls (default: the engine's, 8192; 0: eager)")
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
                traceback.print_exc()
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
