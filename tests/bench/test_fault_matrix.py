"""The fault matrix's quick run (benchmarks/fault_matrix.py --quick): a real deployment (2 P,
2 D, two proxy replicas), SIGKILL of a decoder and of a prefiller under load; every answer right
and no token lost or duplicated. Requests may still fail (no proxy retries are assumed), so the
failed count is not asserted; the launcher must have brought each killed engine back."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import fault_matrix  # noqa: E402


@pytest.mark.slow
def test_quick_fault_matrix_has_no_wrong_answers_and_no_lost_tokens(tmp_path, capsys):
    rows_path = tmp_path / "rows.json"
    rc = fault_matrix.main(["--quick", "--work-dir", str(tmp_path / "work"),
                            "--json", str(rows_path), "--recovery-timeout", "240"])
    out = capsys.readouterr().out
    rows = json.loads(rows_path.read_text())
    assert [r["fault"] for r in rows] == ["SIGKILL the busiest decoder", "SIGKILL prefill-1"], out
    for row in rows:
        assert row["requests"] > 0 and row["ok"] + row["failed"] == row["requests"], out
        assert row["wrong"] == 0 and row["lost_or_duplicated"] == 0, out
        assert row["recovery_s"] is not None, out
    assert rc == 0, out
    assert re.search(r"\| SIGKILL the busiest decoder \| \d+ \| \d+ \|", out)
    up_out = (tmp_path / "work" / "up.out").read_text()
    assert re.search(r"decode-\d is serving again", up_out), up_out
    assert "prefill-1 is serving again" in up_out, up_out
