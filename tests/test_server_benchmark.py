"""benchmarks/server.py's variants, as small as they go: each is a real ``duplexrt serve`` driven
by the real load generator, whose guards check every frame."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SERVER_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "server.py"


def test_the_read_hub_and_the_sessions_own_reads_both_serve_every_frame(tmp_path):
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [sys.executable, str(SERVER_BENCHMARK), "--variants", "native,native-no-hub", "--routes", "/v1/duplex",
         "--sessions", "2", "--frames", "4", "--capacity", "", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["cpu"]
    assert [row["variant"] for row in rows] == ["native", "native-no-hub"]
    for row in rows:
        assert row["guards_ok"] and row["late_frames"] == 0 and row["server_exit_code"] == 0, row
