"""Accuracy of the fp8 KV cache (``--kv-cache-dtype fp8``) next to the full-precision cache,
measured in the same run on the same prompts.

The model is the embedded SmolLM2-135M-Instruct (or ``--model``) in its default dtype (float32
on CPU). Prompts are ``--num-prompts`` chat questions built from the subjects and question forms
below (deterministic, nothing downloaded), rendered with the model's chat template. Each prompt
is decoded greedily for ``--max-tokens`` tokens (``ignore_eos``) with the chosen token's
log-prob, once with the full-precision cache (the reference) and once per fp8 scale method:

* ``weights``: the engine's per-layer scales, bounded from the weights
  (:mod:`pdserve.attention.kv_quant`);
* ``unit``: scale 1.0 for every layer (vLLM's default without calibrated scales).

Reported per method:

* ``same_sequence``: prompts whose whole greedy continuation equals the reference's;
* ``same_first_token``: prompts whose first generated token equals the reference's;
* ``tokens_before_divergence``: greedy tokens equal to the reference's before the first
  difference, as a fraction of all generated tokens;
* ``mean_abs_logprob_diff`` / ``mean_logprob_diff``: over those agreeing positions (the
  contexts are identical there), the mean of ``|lp_fp8 - lp_ref|`` and of ``lp_fp8 - lp_ref``
  for the chosen token (nats).

Example (CPU; about 4 minutes per run on a quiet 2-core machine, docs/benchmarks.md)::

    python benchmarks/kv_cache_fp8_accuracy.py --json-out fp8.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from pdserve.attention.kv_quant import KVCacheScales
from pdserve.types.engine_config import DEFAULT_MODEL, EngineConfig, KVCacheDtype
from pdserve.engine.llm_engine import LLMEngine
from pdserve.types.sampling_params import SamplingParams
from pdserve.model_files.tokenizer import load_tokenizer

SUBJECTS = [
    "photosynthesis", "the French Revolution", "black holes", "the water cycle", "vaccines",
    "plate tectonics", "the Roman Empire", "machine learning", "climate change", "the human heart",
    "compound interest", "the printing press", "volcanoes", "honey bees", "the internet",
    "electric cars", "the Moon landing", "rainbows", "sourdough bread", "the immune system",
    "prime numbers", "the Great Wall of China", "jazz music", "recycling", "earthquakes",
    "the Python programming language", "coral reefs",
]
FORMS = [
    "What is {}? Answer in two sentences.",
    "Explain {} to a ten-year-old.",
    "Give three interesting facts about {}.",
    "Why is {} important?",
]


def make_prompts(n: int) -> list[str]:
    """``n`` questions: every form of every subject, in a fixed order."""
    questions = [f.format(s) for s, f in itertools.product(SUBJECTS, FORMS)]
    if n > len(questions):
        raise SystemExit(f"--num-prompts is at most {len(questions)}")
    return questions[:n]


def run(args: argparse.Namespace, kind: KVCacheDtype, unit_scales: bool,
        prompts: list[list[int]]):
    """Greedy outputs with logprobs of one cache configuration, and the seconds they took."""
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, kv_cache_dtype=kind,
                                    max_model_len=args.max_model_len,
                                    kv_cache_memory=args.kv_cache_memory_mib << 20,
                                    max_num_seqs=args.max_num_seqs))
    if unit_scales:
        engine.core.runner.model.attn_backend.set_kv_cache_scales(
            KVCacheScales.unit(engine.core.runner.arch.num_layers))
    t0 = time.perf_counter()
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens,
                                                   ignore_eos=True, logprobs=0))
    return outs, time.perf_counter() - t0


def compare(ref, got, max_tokens: int) -> dict[str, float]:
    """The figures of the module docstring for one fp8 run against the reference."""
    diffs: list[float] = []
    agreeing = 0
    for a, b in zip(ref, got):
        for la, lb in zip(a.logprobs, b.logprobs):
            if la.token_id != lb.token_id:
                break
            agreeing += 1
            diffs.append(lb.logprob - la.logprob)
    n = len(ref)
    return {
        "prompts": n,
        "same_sequence": sum(a.token_ids == b.token_ids for a, b in zip(ref, got)) / n,
        "same_first_token": sum(a.token_ids[0] == b.token_ids[0] for a, b in zip(ref, got)) / n,
        "tokens_before_divergence": agreeing / (n * max_tokens),
        "mean_abs_logprob_diff": sum(map(abs, diffs)) / max(1, len(diffs)),
        "mean_logprob_diff": sum(diffs) / max(1, len(diffs)),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--num-prompts", type=int, default=104)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--kv-cache-memory-mib", type=int, default=1024,
                   help="KV cache of each run (room for every prompt at once: no preemption)")
    p.add_argument("--scales", choices=["weights", "unit", "both"], default="both")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json-out", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    tok = load_tokenizer(EngineConfig(model=args.model))
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=False),
                          add_special_tokens=False) for q in make_prompts(args.num_prompts)]
    ref, ref_s = run(args, KVCacheDtype.AUTO, False, prompts)
    results = {"args": vars(args), "reference_seconds": round(ref_s, 1)}
    print(f"full-precision cache: {len(prompts)} prompts x {args.max_tokens} tokens in "
          f"{ref_s:.1f} s", flush=True)
    methods = ["weights", "unit"] if args.scales == "both" else [args.scales]
    for method in methods:
        got, secs = run(args, KVCacheDtype.FP8_E4M3, method == "unit", prompts)
        figures = compare(ref, got, args.max_tokens) | {"seconds": round(secs, 1)}
        results[f"fp8_{method}_scales"] = figures
        print(f"fp8 cache, {method} scales: " + json.dumps(figures), flush=True)
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
