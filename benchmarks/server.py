"""The server's benchmark (issue: `duplexrt serve` targets), server and load in separate processes.

1. Server CPU per frame (in and out) over loopback, 96 paced sessions, for each route in
   ``--routes``: ``duplexrt serve`` (echo model) in one process, ``duplexrt simulate --url`` in
   another; the server's CPU comes from its own /metrics (process_cpu_seconds_total).
2. Capacity: the largest number of paced sessions one server process keeps real-time (p99 frame
   lag under 80 ms, no late frames beyond 1 %, no connection errors) on ``/v1/duplex``, trying
   each of ``--capacity`` in turn.  The load generator shares the machine: the figure is a floor.

Usage: python benchmarks/server.py [--frames 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

BIN = Path(sys.executable).parent / "duplexrt"


class RunningServer:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [str(BIN), "serve", "--port", "0", "--log-level", "info", "--slots", "1024", "--no-log-stats", *args],
            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in self.proc.stderr:
            if "port(s)" in line:
                self.port = int(line.split("port(s) ")[1].split()[0])
                break
        else:
            raise SystemExit("the server did not start")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self.proc.stderr.close()
        return code


def simulate(url: str, concurrency: int, frames: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    proc = subprocess.run([str(BIN), "simulate", "--url", url, "--mode", "paced", "--concurrency", str(concurrency),
                           "--frames", str(frames), "--json", out, "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    round_ = data["rounds"][-1]
    round_["exit_code"] = proc.returncode
    return round_


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--routes", default="/v1/duplex,/v1/realtime,/v1/live/sessions")
    parser.add_argument("--capacity", default="96,192,288,384,512")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    results: dict = {"cpu": {}, "capacity": []}

    print(f"1. server CPU per frame, 96 paced sessions x {args.frames} frames, echo", file=sys.stderr)
    for route in args.routes.split(","):
        server = RunningServer()
        try:
            round_ = simulate(f"ws://127.0.0.1:{server.port}{route}", 96, args.frames)
        finally:
            code = server.stop()
        results["cpu"][route] = {
            "server_cpu_us_per_frame": round_["server_cpu_us_per_frame"],
            "load_generator_cpu_us_per_frame": round_["load_generator_cpu_us_per_frame"],
            "frame_lag_ms": round_["frame_lag_ms"], "late_frames": round_["late_frames"],
            "guards_ok": not round_["failures"], "server_exit_code": code,
        }
        print(f"   {route}: server {round_['server_cpu_us_per_frame']:.1f} us/frame, load generator "
              f"{round_['load_generator_cpu_us_per_frame']:.1f} us/frame, lag p99 "
              f"{round_['frame_lag_ms']['p99']:.1f} ms, late {round_['late_frames']}, "
              f"guards {'ok' if not round_['failures'] else round_['failures'][:2]}", file=sys.stderr)

    print("2. capacity on /v1/duplex (p99 lag < 80 ms, late <= 1 %, no connection errors)", file=sys.stderr)
    best = 0
    for concurrency in (int(n) for n in args.capacity.split(",")):
        server = RunningServer()
        try:
            round_ = simulate(f"ws://127.0.0.1:{server.port}/v1/duplex", concurrency, args.frames)
        finally:
            server.stop()
        lag = round_["frame_lag_ms"] or {"p99": float("inf")}
        total = concurrency * args.frames
        realtime = (lag["p99"] < 80 and (round_["late_frames"] or 0) <= 0.01 * total
                    and not round_["connection_errors"] and not round_["failures"])
        results["capacity"].append({"sessions": concurrency, "p99_lag_ms": lag["p99"], "late_frames": round_["late_frames"],
                                    "server_cpu_us_per_frame": round_["server_cpu_us_per_frame"],
                                    "connection_errors": round_["connection_errors"], "real_time": realtime})
        print(f"   {concurrency:4d} sessions: lag p99 {lag['p99']:.1f} ms, late {round_['late_frames']}, "
              f"server {round_['server_cpu_us_per_frame']:.1f} us/frame -> {'real-time' if realtime else 'NOT real-time'}",
              file=sys.stderr)
        if not realtime:
            break
        best = concurrency
    results["largest_real_time"] = best
    print(json.dumps({"cpu": {k: v["server_cpu_us_per_frame"] for k, v in results["cpu"].items()},
                      "largest_real_time_sessions": best}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
