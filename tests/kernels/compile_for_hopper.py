"""Compiles every pdserve Triton kernel for sm_90 (no GPU needed: Triton's bundled ptxas), with
the interpreter off; run as a script in a fresh process (``hopper_compile`` fixture of
tests/kernels/conftest.py). Prints ``ok GROUP LABEL`` per compiled configuration, or
``FAIL GROUP LABEL`` and the traceback on stderr, then ``done``.

Groups: ``attention`` (paged decode and its merge, KV store, RMS norm, rotary with and without
the KV store, SwiGLU, the sampler's inverse-CDF draw) and ``moe`` (the grouped GEMM), checked by
tests/kernels/test_triton_attention.py and tests/kernels/test_triton_moe.py, and ``mla`` (the
MLA decode split kernel; tests/kernels/test_mla_decode.py), and ``copy`` (the KV block copy;
tests/kernels/test_block_copy.py). The interpreter accepts code the compiler rejects, so the
configurations cover every constexpr branch the kernels take in production.
"""

from __future__ import annotations

import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _compile(group: str, label: str, fn, types: dict, consts: dict, aligned, **opts) -> None:
    """Compile ``fn`` for sm_90 with ``types`` (argument name -> Triton type; unnamed: i32) and
    ``consts`` (constexpr values); the arguments for which ``aligned(name)`` holds are marked
    16-divisible, as the JIT specialises 16-byte aligned pointers and strides at run time."""
    try:
        names = fn.arg_names
        # every pdserve kernel is launched as a programmatic dependent launch on Hopper
        # (pdserve.kernels.pdl.launch_options)
        consts = {"USE_PDL": True, **consts}
        opts = {"launch_pdl": True, **opts}
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if aligned(n)}
        src = ASTSource(fn=fn, signature=sig, attrs=attrs,
                        constexprs={(names.index(k),): v for k, v in consts.items()})
        kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert kernel.asm["cubin"], label
        print(f"ok {group} {label}", flush=True)
    except Exception:  # noqa: BLE001  (reported per configuration)
        print(f"FAIL {group} {label}", flush=True)
        print(f"--- {group} {label}\n{traceback.format_exc()}", file=sys.stderr, flush=True)


def attention() -> None:
    from pdserve.kernels import activation as act
    from pdserve.kernels import kv_cache as kvk, paged_decode as pd, rms_norm as rn, rotary as rot
    from pdserve.kernels import sampling as ts

    def aligned(n):
        return n.endswith("_ptr") or (n.startswith("stride") and not n.startswith("stride_pm"))

    for dt, splits in (("bf16", (False, True)), ("fp32", (True,))):
        types = {"out_ptr": "*" + dt, "q_ptr": "*" + dt, "kv_ptr": "*" + dt,
                 "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                 "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "scale_log2": "fp32",
                 "v_scale": "fp32"}
        for split in splits:
            _compile("attention", f"paged_decode_{dt}_split{int(split)}",
                     pd._paged_decode_split_kernel, types, dict(
                         QUERY_GROUP=2, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
                         BLOCK_SIZE=16, BLOCK_N=32, SPLIT=split,
                         DOT_PRECISION="ieee" if dt == "fp32" else "tf32", DOT_IN_FP32=False,
                         SLIDING=split, KV_FP8=False, FP8_DOT_FP16=False), aligned, num_warps=4, num_stages=2)
        # an fp8 (e4m3) KV cache read with bf16 queries (--kv-cache-dtype fp8)
        # (dot products in fp16, the default, and in the query's bf16)
        for label, dot_fp16 in (("paged_decode_bf16_fp8_kv", True), ("paged_decode_bf16_fp8_kv_bf16_dot", False)):
            if dt != "bf16":
                break
            _compile("attention", label, pd._paged_decode_split_kernel,
                     dict(types, kv_ptr="*fp8e4nv"),
                     dict(QUERY_GROUP=2, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128,
                          BLOCK_SIZE=16, BLOCK_N=64, SPLIT=True, DOT_PRECISION="tf32",
                          DOT_IN_FP32=False, SLIDING=False, KV_FP8=True, FP8_DOT_FP16=dot_fp16),
                     aligned, num_warps=4, num_stages=2)
    # the most pieces (one head per program) and four heads of four pieces each
    for label, heads, splits_pad in (("paged_decode_reduce", 1, 64), ("paged_decode_reduce_4x4", 4, 4)):
        _compile("attention", label, pd._paged_decode_reduce_kernel,
                 {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_max_ptr": "*fp32",
                  "part_sum_ptr": "*fp32"},
                 dict(NUM_HEADS=16, HEADS=heads, HEAD_DIM=128, HEAD_DIM_PAD=128, SPLITS_PAD=splits_pad),
                 aligned, num_warps=4)
    for kv_dt, quantize in (("*bf16", False), ("*fp8e4nv", True)):
        _compile("attention", f"store_kv_quantize{int(quantize)}", kvk._store_kv_kernel,
                 {"k_ptr": "*bf16", "v_ptr": "*bf16", "kv_ptr": kv_dt, "slot_mapping_ptr": "*i64",
                  "k_inv_scale": "fp32", "v_inv_scale": "fp32"},
                 dict(NUM_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128, BLOCK_SIZE=16,
                      QUANTIZE=quantize), aligned, num_warps=4)
    for kv_dt, dequantize in (("*bf16", False), ("*fp8e4nv", True)):
        _compile("attention", f"gather_kv_dequantize{int(dequantize)}", kvk._gather_kv_kernel,
                 {"kv_ptr": kv_dt, "block_ptr": "*i64", "offset_ptr": "*i64", "k_out_ptr": "*bf16",
                  "v_out_ptr": "*bf16", "k_scale": "fp32", "v_scale": "fp32"},
                 dict(NUM_HEADS=8, HEADS_PAD=8, HEAD_DIM=128, HEAD_DIM_PAD=128,
                      DEQUANTIZE=dequantize), aligned, num_warps=4)
    _compile("attention", "rms_norm", rn._rms_norm_kernel,
             {"x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*bf16",
              "eps": "fp32"}, dict(HAS_RESIDUAL=True, BLOCK=1024), aligned, num_warps=4)
    # rotary alone (STORE_KV off: the cache arguments are stand-ins) and with the KV write
    for label, kv_dt, store, quantize in (("rotary", "*bf16", False, False),
                                          ("rotary_store_kv_quantize0", "*bf16", True, False),
                                          ("rotary_store_kv_quantize1", "*fp8e4nv", True, True)):
        _compile("attention", label, rot._rotary_kernel,
                 {"x_ptr": "*bf16", "y_ptr": "*bf16", "positions_ptr": "*i64", "cos_ptr": "*fp32",
                  "sin_ptr": "*fp32", "x_norm_ptr": "*bf16", "y_norm_ptr": "*bf16",
                  "x_eps": "fp32", "y_eps": "fp32", "v_ptr": "*bf16", "kv_ptr": kv_dt,
                  "slot_mapping_ptr": "*i64", "k_inv_scale": "fp32", "v_inv_scale": "fp32"},
                 dict(X_HEADS=16, X_HEADS_PAD=16, Y_HEADS=8, Y_HEADS_PAD=8, HEAD_DIM=128, HALF=64,
                      HALF_PAD=64, HAS_NORM=True, STORE_KV=store, BLOCK_SIZE=16 if store else 1,
                      QUANTIZE=quantize),
                 aligned, num_warps=4)
    _compile("attention", "silu_and_mul", act._silu_and_mul_kernel,
             {"x_ptr": "*bf16", "out_ptr": "*bf16"}, dict(BLOCK=1024), aligned, num_warps=4)
    # the decode step's draw: bf16 logits straight from the LM head, a vocabulary divisible by
    # 16 as the JIT specialises it for Qwen3's 151,936 entries; and float32 logits
    for dt in ("bf16", "fp32"):
        _compile("attention", f"draw_block_stats_{dt}", ts._block_stats_kernel,
                 {"logits_ptr": "*" + dt, "temps_ptr": "*fp32", "max_ptr": "*fp32",
                  "idx_ptr": "*i32", "sum_ptr": "*fp32"}, dict(BLOCK=ts.BLOCK_V),
                 lambda n: aligned(n) or n == "vocab", num_warps=4)
        _compile("attention", f"draw_pick_{dt}", ts._pick_kernel,
                 {"logits_ptr": "*" + dt, "temps_ptr": "*fp32", "seeds_ptr": "*i64",
                  "positions_ptr": "*i64", "max_ptr": "*fp32", "idx_ptr": "*i32",
                  "sum_ptr": "*fp32", "out_ptr": "*i64"}, dict(BLOCK=ts.BLOCK_V, BLOCKS_PAD=128),
                 lambda n: aligned(n) or n == "vocab", num_warps=8)
    from pdserve.kernels import gemv

    for rows, bias in ((1, False), (2, True)):
        _compile("attention", f"gemv_rows{rows}", gemv._gemv_kernel,
                 {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16"},
                 dict(HAS_BIAS=bias, BLOCK_M=rows, BLOCK_N=gemv._BLOCK_N, BLOCK_K=gemv._BLOCK_K),
                 lambda n: n.endswith("_ptr") or n in ("K", "stride_xm", "stride_wn", "stride_ym"),
                 num_warps=4, num_stages=3)


def moe() -> None:
    from pdserve.kernels import moe as moe_kernels

    def aligned(n):
        return n.endswith("_ptr") or n in ("stride_am", "stride_we", "stride_wn", "stride_cm")

    for dt, block_m, dot_fp32 in (("bf16", 16, False), ("bf16", 32, False), ("bf16", 64, False),
                                   ("fp32", 64, True)):
        _compile("moe", f"grouped_gemm_{dt}_m{block_m}", moe_kernels._grouped_gemm_kernel,
                 {"a_ptr": "*" + dt, "w_ptr": "*" + dt, "c_ptr": "*" + dt, "weights_ptr": "*fp32",
                  "sorted_pairs_ptr": "*i32", "block_expert_ptr": "*i32", "num_rows_ptr": "*i32"},
                 dict(A_ROW_DIV=8, MUL_WEIGHT=True, DOT_IN_FP32=dot_fp32, BLOCK_M=block_m,
                      BLOCK_N=64, BLOCK_K=64), aligned, num_warps=4)


def mla() -> None:
    from pdserve.kernels import mla_decode

    def aligned(n):
        return n.endswith("_ptr") or (n.startswith("stride") and not n.startswith("stride_pm"))

    # DeepSeek-V2-Lite's latent (halves of 288 = 256 + 32), bf16 and an fp8 cache, with and
    # without the merge
    for label, kv_dt, split in (("mla_decode_bf16_split0", "*bf16", False),
                                ("mla_decode_bf16_split1", "*bf16", True),
                                ("mla_decode_bf16_fp8_kv", "*fp8e4nv", True)):
        _compile("mla", label, mla_decode._mla_decode_split_kernel,
                 {"out_ptr": "*bf16", "q_ptr": "*bf16", "kv_ptr": kv_dt,
                  "part_out_ptr": "*fp32", "part_max_ptr": "*fp32", "part_sum_ptr": "*fp32",
                  "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
                  "scale_log2": "fp32", "k_scale": "fp32", "v_scale": "fp32"},
                 dict(NUM_HEADS=16, BLOCK_H=16, HALF=288, MAIN=256, TAIL_PAD=32, LORA_RANK=512,
                      BLOCK_SIZE=16, BLOCK_N=16, SPLIT=split, DOT_IN_FP32=False,
                      KV_FP8=kv_dt == "*fp8e4nv"), aligned, num_warps=8, num_stages=2)


def copy() -> None:
    from pdserve.kernels import block_copy

    _compile("copy", "copy_blocks", block_copy._copy_blocks_kernel,
             {"dst_ptr": "*i32", "src_ptr": "*i32", "dst_ids_ptr": "*i32",
              "src_ids_ptr": "*i32"}, dict(BLOCK=block_copy.WORDS_PER_PROGRAM),
             lambda n: n.endswith("_ptr") or n == "words_per_block", num_warps=8)


#: labels each group must report
EXPECTED = {
    "attention": {"paged_decode_bf16_split0", "paged_decode_bf16_split1",
                  "paged_decode_bf16_fp8_kv", "paged_decode_bf16_fp8_kv_bf16_dot",
                  "paged_decode_fp32_split1", "paged_decode_reduce", "paged_decode_reduce_4x4",
                  "store_kv_quantize0", "store_kv_quantize1", "gather_kv_dequantize0",
                  "gather_kv_dequantize1", "rms_norm", "rotary", "rotary_store_kv_quantize0",
                  "rotary_store_kv_quantize1",
                  "silu_and_mul", "draw_block_stats_bf16", "draw_block_stats_fp32",
                  "draw_pick_bf16", "draw_pick_fp32", "gemv_rows1", "gemv_rows2"},
    "moe": {"grouped_gemm_bf16_m16", "grouped_gemm_bf16_m32", "grouped_gemm_bf16_m64",
            "grouped_gemm_fp32_m64"},
    "mla": {"mla_decode_bf16_split0", "mla_decode_bf16_split1", "mla_decode_bf16_fp8_kv"},
    "copy": {"copy_blocks"},
}

if __name__ == "__main__":
    attention()
    moe()
    mla()
    copy()
    print("done", flush=True)
