"""benchmarks/mla_decode.py: the decode steps it builds are valid for the kernel (block ids within
the cache, tables that cover the contexts, no block shared) at the default sweep's shapes, its
check refuses steps that are not, and the script runs end to end on the CPU (interpreter)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.mla_decode import check_step, make_step, parse_args

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("batch,ctx", [(1, 4096), (8, 1024), (8, 4096), (32, 1000)])
def test_steps_of_the_default_sweep_are_valid(batch, ctx):
    args = parse_args(["--num-layers", "1"])  # one layer: the same tables, less memory
    gen = torch.Generator().manual_seed(0)
    s = make_step(batch, ctx, args, torch.device("cpu"), gen)
    check_step(s, args.block_size)
    tables = s["tables"]
    assert tables.dtype == torch.int32 and tables.shape == (batch, -(-ctx // args.block_size))
    assert int(tables.max()) < s["cache"].shape[0]
    assert s["ctx"].tolist() == [ctx] * batch
    assert s["q"].shape == (batch, args.num_heads, args.kv_lora_rank + args.rope_dim)


def test_check_refuses_invalid_steps():
    args = parse_args(["--num-layers", "1"])
    s = make_step(2, 40, args, torch.device("cpu"), torch.Generator().manual_seed(0))
    bad = dict(s, tables=s["tables"].clone())
    bad["tables"][1, 0] = s["cache"].shape[0]
    with pytest.raises(ValueError, match="outside"):
        check_step(bad, args.block_size)
    with pytest.raises(ValueError, match="needs more than"):
        check_step(dict(s, ctx=s["ctx"] + args.block_size), args.block_size)
    shared = dict(s, tables=s["tables"].clone())
    shared["tables"][1, 0] = shared["tables"][0, 0]
    with pytest.raises(ValueError, match="same block"):
        check_step(shared, args.block_size)


@pytest.mark.slow  # a process: the script under Triton's interpreter (about 10 s)
@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="a CUDA machine runs the compiled kernel (tests/kernels/"
                           "test_mla_decode.py); the interpreter of its older Triton (3.6) "
                           "cannot loop over a runtime kernel argument")
def test_script_runs_on_cpu():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    script = str(ROOT / "benchmarks/mla_decode.py")
    out = subprocess.run([sys.executable, script, "--device", "cpu"], capture_output=True,
                         text=True, env=env, timeout=240, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines()
            if line.strip() and line.split()[0].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "20"), ("1", "40"), ("3", "20"), ("3", "40")]
    assert all(float(r[-1]) < 2e-2 for r in rows)  # rel err of the kernel against torch
