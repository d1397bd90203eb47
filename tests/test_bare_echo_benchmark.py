"""benchmarks/bare_echo.py (the floor under ``duplexrt serve``) through benchmarks/server.py, as
small as it goes: two paced sessions of four frames from the real load generator, whose guards
check every echoed frame, and the floor's CPU per frame read from its /metrics as a server's is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SERVER_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "server.py"


def test_the_floor_echoes_every_frame_and_reports_its_cpu_like_a_server(tmp_path):
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [sys.executable, str(SERVER_BENCHMARK), "--variants", "bare", "--routes", "/v1/duplex,/v1/realtime",
         "--sessions", "2", "--frames", "4", "--capacity", "", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["cpu"]
    # The floor speaks /v1/duplex only: the Realtime route is skipped, not run against it.
    assert [(row["route"], row["sessions"], row["variant"]) for row in rows] == [("/v1/duplex", 2, "bare")]
    row = rows[0]
    assert row["guards_ok"], proc.stderr
    assert row["late_frames"] == 0 and row["server_exit_code"] == 0, row
    assert row["server_cpu_us_per_frame"] is not None and row["server_cpu_us_per_frame"] >= 0, row


def test_the_floor_through_the_read_hub_echoes_every_frame(tmp_path):
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [sys.executable, str(SERVER_BENCHMARK), "--variants", "bare-hub", "--routes", "/v1/duplex",
         "--sessions", "2", "--frames", "6", "--capacity", "", "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    (row,) = json.loads(out.read_text())["cpu"]
    assert row["variant"] == "bare-hub" and row["guards_ok"], proc.stderr
    assert row["late_frames"] == 0 and row["server_exit_code"] == 0, row
