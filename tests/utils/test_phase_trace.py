"""The opt-in phase trace (pdserve/utils/phase_trace.py) and the timeline benchmarks/pd_phases.py reads
from it."""

from __future__ import annotations

import importlib.util
import os
import time
from pathlib import Path

import pytest

from pdserve.utils import phase_trace
from pdserve.engine.async_scheduling import launch_phase
from pdserve.types.outputs import ScheduledRequest, SchedulerOutput
from pdserve.types.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


def _pd_phases():
    spec = importlib.util.spec_from_file_location("pd_phases", ROOT / "benchmarks/pd_phases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def trace_dir(tmp_path):
    phase_trace.configure(str(tmp_path))
    yield tmp_path
    phase_trace.configure(None)
    phase_trace.set_role("?")


def test_off_writes_nothing(tmp_path):
    phase_trace.configure(None)
    phase_trace.mark("api.in")
    assert not phase_trace.enabled()
    assert list(tmp_path.iterdir()) == []


def test_marks_go_to_the_process_file_with_its_role(trace_dir):
    phase_trace.set_role("P.api")
    phase_trace.mark("api.in")
    phase_trace.mark("api.prompt")
    assert not (trace_dir / f"{os.getpid()}.trace").exists()  # buffered: no write per mark
    phase_trace.flush()
    lines = (trace_dir / f"{os.getpid()}.trace").read_text().splitlines()
    assert lines[0] == "# role P.api"
    assert [ln.split(" ", 1)[1] for ln in lines[1:]] == ["api.in", "api.prompt"]
    t_in, t_prompt = (float(ln.split(" ", 1)[0]) for ln in lines[1:])
    assert 0 <= t_prompt - t_in < 5


def test_the_flusher_thread_writes_the_marks(trace_dir):
    phase_trace.set_role("D.core")
    phase_trace.mark("core.add")
    path = trace_dir / f"{os.getpid()}.trace"
    deadline = time.monotonic() + 5
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(phase_trace.FLUSH_INTERVAL_S / 5)
    assert path.read_text().splitlines()[1].endswith(" core.add")


def test_role_prefix():
    assert [phase_trace.kv_role_prefix(r) for r in ("kv_producer", "kv_consumer", "kv_both",
                                                    None)] == ["P", "D", "PD", "S"]


def _step(*token_counts: int) -> SchedulerOutput:
    reqs = [ScheduledRequest(request_id=f"r{i}", token_ids=[1] * n, num_computed_tokens=0,
                             block_ids=[0], sample=True, sampling_params=SamplingParams(),
                             prompt_token_ids=[1] * n, output_token_ids=[])
            for i, n in enumerate(token_counts)]
    return SchedulerOutput(scheduled=reqs)


def test_launch_phase_names_prompt_chunks():
    assert launch_phase(_step(1, 1)) == "core.launch"
    assert launch_phase(_step(1, 232)) == "core.launch_prefill"


def test_timeline_medians_per_phase_skipping_warmup_and_first_turns(tmp_path):
    pd_phases = _pd_phases()
    (tmp_path / "1.trace").write_text("# role client\n" + "".join(
        f"{t0:.3f} cl.send\n{t0 + 0.050 + k * 0.001:.3f} cl.first\n{t0 + 0.2:.3f} cl.end\n"
        for k, t0 in enumerate(range(0, 8))))
    (tmp_path / "2.trace").write_text("# role P.core\n" + "".join(
        f"{t0 + 0.010:.3f} kv.done\n{t0 + 0.020:.3f} core.launch\n{t0 + 0.030:.3f} core.launch\n"
        for t0 in range(0, 8)) + "9.000 kv.done\n")  # after every turn's end: not counted
    rows = pd_phases.timeline(pd_phases.read_traces(tmp_path), turns=2, skip=1)
    names = [r[0] for r in rows]
    assert names == ["P.core kv.done", "P.core core.launch", "P.core core.launch#1",
                     "client cl.first"]
    # counted turns: 3, 5, 7 (turn 2, 4, 6 open a conversation, 0-1 warm up)
    assert rows[-1][1] == pytest.approx(55.0) and rows[-1][2] == 3
    assert rows[0][1] == pytest.approx(10.0)
