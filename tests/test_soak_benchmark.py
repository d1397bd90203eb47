"""benchmarks/soak.py end to end, as small as it goes: a real `duplexrt serve` process, two
rounds of two paced sessions over loopback, RSS read from /proc, the allocator trimmed on signal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


def test_soak_runs_rounds_against_a_server_process_and_reads_its_memory(tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--rounds", "2", "--sessions", "2", "--frames", "2", "--settle", "0",
         "--trim", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert [r["round"] for r in result["rounds"]] == [1, 2]
    for row in result["rounds"]:
        assert row["frames_out"] == 4 and row["failures"] == 0 and row["connection_errors"] == 0, row
        assert 10 < row["rss_after_trim_mib"] <= row["rss_mib"] + 1 < 10_000, row
    assert result["server_exit_code"] == 0
    assert "FLAT" in proc.stdout or "GROWS" in proc.stdout
