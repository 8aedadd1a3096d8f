"""The P/D benchmark scripts start: each one's imports (sibling modules of benchmarks/ included)
resolve and its options parse (``--help``, run in this process), without starting any
deployment."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["pd_overhead.py", "pd_multi_turn.py", "kv_tiers.py",
                                    "pd_latency.py", "one_gpu_pd.py", "prefix_eviction.py"])
def test_script_help(script, monkeypatch, capsys):
    path = str(ROOT / "benchmarks" / script)
    monkeypatch.setattr(sys, "argv", [path, "--help"])
    monkeypatch.setattr(sys, "path", [str(ROOT / "benchmarks"), *sys.path])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(path, run_name="__main__")
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
