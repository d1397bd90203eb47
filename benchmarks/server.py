"""The server's benchmark (issue 12: `duplexrt serve` targets), server and load in separate processes.

1. Server and load-generator CPU per frame over loopback, paced sessions (``--sessions``, 96 and
   256 by default), for each route in ``--routes``: ``duplexrt serve`` (echo model) in one process,
   ``duplexrt simulate --url`` in another; the server's CPU comes from its own /metrics
   (process_cpu_seconds_total).  Each (route, sessions) is run once per variant, the variants
   alternated so that they share the machine's load: ``native`` (this checkout's server and load
   generator) and, with ``--before-bin``, ``before`` (another checkout's ``duplexrt``, server and load).
   ``bare`` (benchmarks/bare_echo.py) is the floor: trio and the WebSocket layer echoing with no
   runtime behind them, measured by the same load generator and the same /metrics series, so that
   the difference to ``native`` is what the runtime adds.  It speaks ``/v1/duplex`` only, and is
   run there beside every route (its row names ``/v1/duplex``), so that each route's rows have a
   floor measured next to them.  A row run after the floor of the same route group and sessions
   also gives its CPU as a multiple of that floor (``floor_ratio``): run the floor first
   (``--variants bare,native``; ``before`` then runs right after the floor).
2. Capacity: the largest number of paced sessions one server process keeps real-time (p99 frame
   lag under 80 ms, no late frames beyond 1 %, no connection errors) on ``/v1/duplex``, trying
   each of ``--capacity`` in turn (this checkout, native), ``--capacity-frames`` frames a session
   (300 by default: every session connects at once, and the first second of hundreds of
   handshakes makes frames late that a steady state would not; at 100 frames that ramp alone is
   about 1 % of them).  The load generator shares the machine: the figure is a floor.

Usage: python benchmarks/server.py [--frames 100] [--before-bin /work/main/.venv/bin/duplexrt] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BIN = Path(sys.executable).parent / "duplexrt"


BARE_ECHO = Path(__file__).with_name("bare_echo.py")


class RunningServer:
    def __init__(self, *args: str, bin: Path = BIN) -> None:
        if bin == BARE_ECHO:
            command = [sys.executable, str(BARE_ECHO), "--port", "0", *args]
        else:
            # The load generator opens every session at once: past 256 that is more handshakes at
            # a time than the flood guard (server.max_pending_handshakes) lets wait, and the rest
            # would be refused with 503 before the steady state this measures.
            command = [str(bin), "serve", "--port", "0", "--log-level", "info", "--slots", "1024", "--no-log-stats",
                       "--set", "server.max_pending_handshakes=4096", *args]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        for line in self.proc.stderr:
            if "port(s)" in line:
                self.port = int(line.split("port(s) ")[1].split()[0])
                break
        else:
            raise SystemExit("the server did not start")
        # Keep reading its log: a full pipe would stall the server mid-run.
        self._drain = threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True)
        self._drain.start()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=60)
        self._drain.join(timeout=5)
        return code


def simulate(url: str, concurrency: int, frames: int, bin: Path = BIN, message_ms: float = 160.0) -> dict:
    if bin == BARE_ECHO:
        bin = BIN  # the floor is driven by this checkout's load generator
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    proc = subprocess.run([str(bin), "simulate", "--url", url, "--mode", "paced", "--concurrency", str(concurrency),
                           "--frames", str(frames), "--message-ms", f"{message_ms:g}", "--json", out, "--no-progress"],
                          capture_output=True, text=True, timeout=600)
    data = json.loads(Path(out).read_text())
    os.unlink(out)
    round_ = data["rounds"][-1]
    round_["exit_code"] = proc.returncode
    return round_


def run_once(bin: Path, serve_args: list[str], url_path: str, concurrency: int, frames: int,
             message_ms: float = 160.0) -> tuple[dict, int]:
    server = RunningServer(*serve_args, bin=bin)
    try:
        round_ = simulate(f"ws://127.0.0.1:{server.port}{url_path}", concurrency, frames, bin, message_ms)
    finally:
        code = server.stop()
    return round_, code


def _variant(name: str) -> tuple[str, Path, list[str]]:
    """A variant's server: this checkout's, or the floor."""
    if name == "bare":
        return name, BARE_ECHO, []
    if name == "native":
        return name, BIN, []
    raise SystemExit(f"unknown variant {name!r}: native or bare (before comes with --before-bin)")


def _loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def _floor_ratio(row: dict, floor: float | None) -> float | None:
    """A server's CPU per frame over the floor's at the same route and sessions, in the same run.
    This host's speed swings by up to two times within an hour, and the floor with it; the ratio
    to a floor measured minutes apart holds still.  None for the floor itself, without a floor
    run before it, or where a short run counted no CPU (the kernel counts in 10 ms ticks)."""
    server = row["server_cpu_us_per_frame"]
    if row["variant"] == "bare" or not floor or server is None:
        return None
    return server / floor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=100)
    parser.add_argument("--message-ms", type=float, default=160.0,
                        help="audio per client message in the CPU step (160: two frames; a browser or a voice-agent "
                             "framework sends 10-20 ms)")
    parser.add_argument("--routes", default="/v1/duplex,/v1/realtime?duplex=1&continuous=1,/v1/live/sessions")
    parser.add_argument("--sessions", default="96,256")
    parser.add_argument("--variants", default="bare,native",
                        help="which of native and bare to run, in order (before is added first by --before-bin); "
                             "bare is benchmarks/bare_echo.py, the floor with no runtime, on /v1/duplex only")
    parser.add_argument("--before-bin", type=Path, default=None,
                        help="another checkout's duplexrt (e.g. main's .venv/bin/duplexrt): server and load generator")
    parser.add_argument("--capacity", default="256,512,768,1024", help="'' to skip")
    parser.add_argument("--capacity-frames", type=int, default=300, help="frames a session in the capacity step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    variants: list[tuple[str, Path, list[str]]] = [_variant(name) for name in args.variants.split(",") if name]
    if args.before_bin is not None:  # after the floor, so that it has one
        at = 1 if variants and variants[0][1] == BARE_ECHO else 0
        variants.insert(at, ("before", args.before_bin, []))
    results: dict = {"cpu": [], "capacity": [], "load_average_before": _loadavg()}
    #: (route, sessions) -> the floor's server CPU per frame in this run, for the rows after it.
    floors: dict[tuple[str, int], float | None] = {}

    print(f"1. CPU per frame, paced sessions x {args.frames} frames, {args.message_ms:g} ms messages, echo; "
          f"load average {_loadavg()}", file=sys.stderr)
    for route in (r for r in args.routes.split(",") if r):
        for concurrency in (int(n) for n in args.sessions.split(",") if n):
            for name, bin, serve_args in variants:
                path = "/v1/duplex" if bin == BARE_ECHO else route  # the floor speaks /v1/duplex only
                round_, code = run_once(bin, serve_args, path, concurrency, args.frames, args.message_ms)
                lag = round_["frame_lag_ms"] or {"p99": float("nan")}
                row = {"route": path, "sessions": concurrency, "variant": name,
                       "server_cpu_us_per_frame": round_["server_cpu_us_per_frame"],
                       "load_generator_cpu_us_per_frame": round_["load_generator_cpu_us_per_frame"],
                       "frame_lag_p99_ms": lag["p99"], "late_frames": round_["late_frames"],
                       "guards_ok": not round_["failures"], "server_exit_code": code,
                       # None from a server that does not count its scheduler thread (the floor, older builds)
                       "server_scheduler_cpu_share": round_.get("server_scheduler_cpu_share")}
                if bin == BARE_ECHO:
                    floors[(route, concurrency)] = row["server_cpu_us_per_frame"]
                row["floor_ratio"] = _floor_ratio(row, floors.get((route, concurrency)))
                results["cpu"].append(row)
                share = row["server_scheduler_cpu_share"]
                on_thread = f" ({100 * share:.0f} % on the scheduler thread)" if share is not None else ""
                ratio = f", {row['floor_ratio']:.2f} x the floor" if row["floor_ratio"] is not None else ""
                print(f"   {path} x{concurrency} {name:>14}: server {row['server_cpu_us_per_frame']:.1f} us/frame"
                      f"{on_thread}{ratio}, load generator {row['load_generator_cpu_us_per_frame']:.1f} us/frame, lag p99 "
                      f"{lag['p99']:.1f} ms, late {round_['late_frames']}, "
                      f"guards {'ok' if not round_['failures'] else round_['failures'][:2]}", file=sys.stderr)

    steps = [int(n) for n in args.capacity.split(",") if n]
    if steps:
        print(f"2. capacity on /v1/duplex, native, {args.capacity_frames} frames a session "
              "(p99 lag < 80 ms, late <= 1 %, no connection errors)", file=sys.stderr)
    best = 0
    for concurrency in steps:
        round_, _ = run_once(BIN, [], "/v1/duplex", concurrency, args.capacity_frames)
        lag = round_["frame_lag_ms"] or {"p99": float("inf")}
        total = concurrency * args.capacity_frames
        realtime = (lag["p99"] < 80 and (round_["late_frames"] or 0) <= 0.01 * total
                    and not round_["connection_errors"] and not round_["failures"])
        results["capacity"].append({"sessions": concurrency, "p99_lag_ms": lag["p99"], "late_frames": round_["late_frames"],
                                    "server_cpu_us_per_frame": round_["server_cpu_us_per_frame"],
                                    "load_generator_cpu_us_per_frame": round_["load_generator_cpu_us_per_frame"],
                                    "connection_errors": round_["connection_errors"], "real_time": realtime})
        print(f"   {concurrency:4d} sessions: lag p99 {lag['p99']:.1f} ms, late {round_['late_frames']}, "
              f"server {round_['server_cpu_us_per_frame']:.1f} us/frame, load generator "
              f"{round_['load_generator_cpu_us_per_frame']:.1f} -> {'real-time' if realtime else 'NOT real-time'}",
              file=sys.stderr)
        if not realtime:
            break
        best = concurrency
    results["largest_real_time"] = best
    results["load_average_after"] = _loadavg()
    print(json.dumps({"cpu": [(r["route"], r["sessions"], r["variant"], r["server_cpu_us_per_frame"],
                               r["load_generator_cpu_us_per_frame"]) for r in results["cpu"]],
                      "largest_real_time_sessions": best, "load_average": [results["load_average_before"],
                                                                           results["load_average_after"]]}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
