"""benchmarks/server.py's variants, as small as they go: the floor under ``duplexrt serve``
(benchmarks/bare_echo.py) and the server, each driven by the real load generator, whose guards check every
echoed frame, and each one's CPU per frame read from its /metrics as a server's is."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import load_benchmark

SERVER_BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "server.py"


def _run(tmp_path: Path, variants: str, routes: str = "/v1/duplex", frames: int = 4,
         message_ms: float = 160) -> tuple[str, list[dict]]:
    """Two paced sessions per route and variant; (what it logged, its CPU rows)."""
    out = tmp_path / "server.json"
    proc = subprocess.run(
        [sys.executable, str(SERVER_BENCHMARK), "--variants", variants, "--routes", routes,
         "--sessions", "2", "--frames", str(frames), "--message-ms", str(message_ms), "--capacity", "",
         "--json", str(out)],
        capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr, json.loads(out.read_text())["cpu"]


def test_the_floor_echoes_every_frame_and_reports_its_cpu_like_a_server(tmp_path):
    log, rows = _run(tmp_path, "bare", routes="/v1/duplex,/v1/realtime")
    # The floor speaks /v1/duplex only: beside the Realtime route it runs there too, so that
    # route's rows have a floor of their own.
    assert [(row["route"], row["sessions"], row["variant"]) for row in rows] == [("/v1/duplex", 2, "bare")] * 2
    for row in rows:
        assert row["guards_ok"], log
        assert row["late_frames"] == 0 and row["server_exit_code"] == 0, row
        assert row["server_cpu_us_per_frame"] is not None and row["server_cpu_us_per_frame"] >= 0, row


def test_the_floor_and_the_server_after_it_serve_every_frame(tmp_path):
    log, rows = _run(tmp_path, "bare,native", frames=6)
    assert [row["variant"] for row in rows] == ["bare", "native"]
    for row in rows:
        assert row["guards_ok"] and row["late_frames"] == 0 and row["server_exit_code"] == 0, (row, log)
    # Each server's CPU as a multiple of the floor run just before it (none for the floor itself,
    # and none where the floor's short run counted no CPU tick, as it mostly does here).
    floor, *servers = rows
    assert floor["floor_ratio"] is None
    for row in servers:
        assert row["floor_ratio"] == load_benchmark("server")._floor_ratio(row, floor["server_cpu_us_per_frame"]), row


def test_a_server_row_is_given_as_a_multiple_of_the_floor_measured_beside_it():
    ratio = load_benchmark("server")._floor_ratio
    native = {"variant": "native", "server_cpu_us_per_frame": 130.2}
    assert ratio(native, 40.6) == 130.2 / 40.6
    assert ratio({"variant": "bare", "server_cpu_us_per_frame": 40.6}, 40.6) is None  # the floor itself
    assert ratio(native, None) is None  # no floor run before it
    assert ratio(native, 0.0) is None  # the floor's run counted no CPU tick
    assert ratio({"variant": "native", "server_cpu_us_per_frame": None}, 40.6) is None


def test_messages_shorter_than_a_frame_are_echoed_per_frame_by_the_floor_and_the_server(tmp_path):
    """20 ms messages (what browsers and voice-agent frameworks send): the floor answers per whole
    frame, as the server does, so the two still compare; every frame is checked; the server says
    how much of its CPU was the scheduler thread's and the floor, which has none, says nothing."""
    log, rows = _run(tmp_path, "bare,native", frames=4, message_ms=20)
    assert [row["variant"] for row in rows] == ["bare", "native"]
    for row in rows:
        assert row["guards_ok"] and row["late_frames"] == 0 and row["server_exit_code"] == 0, (row, log)
    floor, native = rows
    assert floor["server_scheduler_cpu_share"] is None
    # The process's CPU comes in 10 ms ticks: a run this short may count none, and then no share.
    assert native["server_scheduler_cpu_share"] is not None or native["server_cpu_us_per_frame"] == 0, native
    assert "20 ms messages" in log
