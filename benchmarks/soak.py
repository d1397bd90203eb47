"""Soak: does a long-running server's memory stay flat, round after round of sessions?

``duplexrt serve`` (echo model) runs in a process of its own; this one runs ``--rounds`` rounds of
``--sessions`` paced sessions of ``--frames`` frames against it, through the simulator's own URL
client (``duplexrt simulate --url``, the same code and guards), and after each round reads the
server's resident memory (VmRSS in /proc/PID/status, once its sessions have all closed).  Memory
is flat when RSS after the last round is within ``--tolerance-mb`` of round 2 (round 1 pays for
warm-up: imports, codecs, buffers sized by the first burst).

``--trace`` finds out what grows: the server then runs under tracemalloc, and after round 2 and
after the last round it dumps a snapshot and a count of live objects by type (on SIGUSR1); the
script prints the largest differences between the two.  Tracing slows the server and adds its own
memory, so its RSS figures are not the soak's.

Usage: python benchmarks/soak.py [--rounds 20] [--sessions 128] [--frames 75] [--quick]
                                 [--trace] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import gc
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

import trio

BIN = Path(sys.executable).parent / "duplexrt"
MIB = 1024 * 1024


# -- the server process ---------------------------------------------------------------------------


class SoakServer:
    """``duplexrt serve`` on a free loopback port.  With ``work_dir`` it runs through
    ``serve_instrumented`` (the same command, plus signal handlers): ``trim`` and, with
    ``trace``, ``dump``."""

    def __init__(self, slots: int, work_dir: Path | None, trace: bool) -> None:
        serve = ["serve", "--port", "0", "--log-level", "info", "--slots", str(slots), "--no-log-stats"]
        if work_dir is None:
            command = [str(BIN), *serve]
        else:
            command = [sys.executable, __file__, "--serve-instrumented", str(work_dir), "trace" if trace else "-",
                       "--", *serve]
        self.work_dir = work_dir
        self.trace = trace
        self.dumps = 0
        self.trims = 0
        # Its log goes to a file: a line per session would fill a pipe nobody reads.
        self.log_path = Path(tempfile.mkstemp(prefix="duplexrt-soak-", suffix=".log")[1])
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(command, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 120
        while True:
            for line in self.log_path.read_text().splitlines():
                if "port(s)" in line:
                    self.port = int(line.split("port(s) ")[1].split()[0])
                    return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start; its log: {self.log_path}")
            time.sleep(0.1)

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / MIB
        raise RuntimeError("no VmRSS in /proc/PID/status")

    def _signal_and_wait(self, signum: int, done: Path) -> None:
        self.proc.send_signal(signum)
        deadline = time.monotonic() + 300
        while not done.exists():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise SystemExit(f"the instrumented server did not write {done.name}")
            time.sleep(0.05)

    def dump(self) -> int:
        """Ask the traced server for a snapshot; returns its number once it is written."""
        assert self.work_dir is not None and self.trace
        self.dumps += 1
        self._signal_and_wait(signal.SIGUSR1, self.work_dir / f"objects{self.dumps}.json")
        return self.dumps

    def trim(self) -> None:
        """Have the server's C allocator hand its free memory back (glibc ``malloc_trim(0)``)."""
        assert self.work_dir is not None
        self.trims += 1
        self._signal_and_wait(signal.SIGUSR2, self.work_dir / f"trimmed{self.trims}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)


def serve_instrumented(work_dir: str, trace: bool, argv: list[str]) -> None:
    """``duplexrt`` with ``argv``, plus: on each SIGUSR2, ``malloc_trim(0)`` (then ``trimmedN``);
    with ``trace``, tracemalloc on and, on each SIGUSR1, a snapshot (``snapN.tm``) and live
    objects counted by type (``objectsN.json``, written last)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    trims = itertools.count(1)

    def trim(_signum: int, _frame: Any) -> None:
        libc.malloc_trim(0)
        Path(work_dir, f"trimmed{next(trims)}").touch()

    signal.signal(signal.SIGUSR2, trim)
    if trace:
        tracemalloc.start(16)
    numbers = itertools.count(1)

    def dump(_signum: int, _frame: Any) -> None:
        n = next(numbers)
        gc.collect()
        tracemalloc.take_snapshot().dump(os.path.join(work_dir, f"snap{n}.tm"))
        counts = collections.Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.get_objects())
        counts["(tracemalloc: bytes traced now)"] = tracemalloc.get_traced_memory()[0]
        partial = os.path.join(work_dir, f"objects{n}.json.part")
        with open(partial, "w") as handle:
            json.dump(counts, handle)
        os.rename(partial, os.path.join(work_dir, f"objects{n}.json"))

    if trace:
        signal.signal(signal.SIGUSR1, dump)
    from duplexrt_cli.app import main

    sys.argv = ["duplexrt", *argv]
    main()


def compare_dumps(trace_dir: Path, first: int, last: int, top: int = 15) -> dict:
    """What grew between two dumps: allocation sites (by line) and live objects (by type)."""
    old = tracemalloc.Snapshot.load(str(trace_dir / f"snap{first}.tm"))
    new = tracemalloc.Snapshot.load(str(trace_dir / f"snap{last}.tm"))
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__), tracemalloc.Filter(False, "<frozen importlib._bootstrap*")]
    stats = new.filter_traces(ignore).compare_to(old.filter_traces(ignore), "lineno")
    sites = [{"site": str(s.traceback[0]), "grew_kib": round(s.size_diff / 1024, 1), "blocks": s.count_diff}
             for s in stats[:top]]
    before = json.loads((trace_dir / f"objects{first}.json").read_text())
    after = json.loads((trace_dir / f"objects{last}.json").read_text())
    grown = sorted(((after.get(k, 0) - before.get(k, 0), k) for k in set(before) | set(after)), reverse=True)
    objects = [{"type": k, "more": d, "now": after.get(k, 0)} for d, k in grown[:top] if d > 0]
    return {"sites": sites, "objects": objects}


# -- the load -------------------------------------------------------------------------------------


async def wait_idle(url: str, timeout: float = 30.0) -> None:
    """Until the server's sessions have all ended (their goodbyes included)."""
    from duplexrt.client.metrics import scrape_metrics

    with trio.move_on_after(timeout):
        while True:
            snapshot = await scrape_metrics(url)
            if snapshot.value("duplexrt_sessions_active") == 0:
                return
            await trio.sleep(0.2)
    print(f"   (sessions still active after {timeout:.0f} s)", file=sys.stderr)


async def soak(args: argparse.Namespace, server: SoakServer) -> dict:
    from duplexrt.config import load_config
    from duplexrt.simulate.runner import SimulateOptions, run_url_simulation

    url = f"ws://127.0.0.1:{server.port}/v1/duplex"
    config = load_config(None, [])
    options = SimulateOptions(concurrency=args.sessions, frames=args.frames, mode="paced")
    rounds = []
    for number in range(1, args.rounds + 1):
        started = time.monotonic()
        report = await run_url_simulation(config, options, url, adopt_server_backend=True)
        await wait_idle(url)
        await trio.sleep(args.settle)
        rss = server.rss_mib()
        trimmed = None
        if args.trim:
            server.trim()
            trimmed = server.rss_mib()
        round_ = report.rounds[-1]
        lag = round_.frame_lag_ms
        rounds.append({"round": number, "rss_mib": round(rss, 1),
                       "rss_after_trim_mib": round(trimmed, 1) if trimmed is not None else None,
                       "seconds": round(time.monotonic() - started, 1),
                       "frames_out": round_.frames_out, "lag_p99_ms": round(lag.p99, 1) if lag else None,
                       "late_frames": round_.late_frames, "failures": len(round_.failures),
                       "connection_errors": sum(round_.measured.connection_errors.values())})
        row = rounds[-1]
        print(f"{number:5d}  {rss:8.1f}  {'' if trimmed is None else f'{trimmed:8.1f}  '}{row['seconds']:6.1f}  {row['frames_out']:9d}  "
              f"{row['lag_p99_ms'] if lag else float('nan'):8.1f}  {row['late_frames'] or 0:6d}  "
              f"{row['failures'] + row['connection_errors']:6d}", flush=True)
        if server.trace and number in (min(2, args.rounds), args.rounds):
            server.dump()
    return {"rounds": rounds}


def main() -> None:
    if len(sys.argv) > 4 and sys.argv[1] == "--serve-instrumented" and sys.argv[4] == "--":
        serve_instrumented(sys.argv[2], sys.argv[3] == "trace", sys.argv[5:])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--sessions", type=int, default=128)
    parser.add_argument("--frames", type=int, default=75, help="frames per session (80 ms each, paced)")
    parser.add_argument("--tolerance-mb", type=float, default=5.0,
                        help="RSS after the last round may exceed round 2's by this much (MiB)")
    parser.add_argument("--settle", type=float, default=0.5, help="seconds to wait after a round before reading RSS")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds of 8 sessions x 10 frames")
    parser.add_argument("--trace", action="store_true", help="tracemalloc in the server: what grows, not how much")
    parser.add_argument("--trim", action="store_true",
                        help="after each round also read RSS once the server's allocator has trimmed its free memory")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sessions, args.frames, args.settle = 3, 8, 10, 0.2
    if args.rounds < 2:
        parser.error("--rounds must be at least 2 (round 2 is the baseline)")

    work_dir = Path(tempfile.mkdtemp(prefix="duplexrt-soak-")) if args.trace or args.trim else None
    server = SoakServer(slots=max(args.sessions, 4), work_dir=work_dir, trace=args.trace)
    print(f"soak: {args.rounds} rounds x {args.sessions} paced sessions x {args.frames} frames, echo, "
          f"server pid {server.proc.pid}{', TRACED' if args.trace else ''}; RSS read after each round", file=sys.stderr)
    print(f"{'round':>5}  {'RSS MiB':>8}  {'  trimmed' if args.trim else ''}{'secs':>6}  {'frames out':>9}  {'p99 lag':>8}  {'late':>6}  {'errors':>6}")
    start_rss = server.rss_mib()
    try:
        result = trio.run(soak, args, server)
    finally:
        code = server.stop()
    rounds = result["rounds"]
    base, last = rounds[1]["rss_mib"], rounds[-1]["rss_mib"]
    growth = last - base
    flat = growth <= args.tolerance_mb
    per_round = growth / (len(rounds) - 2) if len(rounds) > 2 else 0.0
    result.update({"sessions": args.sessions, "frames": args.frames, "rss_before_mib": round(start_rss, 1),
                   "growth_after_round_2_mib": round(growth, 1), "growth_per_round_mib": round(per_round, 2),
                   "flat": flat, "tolerance_mib": args.tolerance_mb, "server_exit_code": code})
    print(f"RSS: {start_rss:.1f} MiB idle, {rounds[0]['rss_mib']:.1f} after round 1, {base:.1f} after round 2, "
          f"{last:.1f} after round {len(rounds)}: {growth:+.1f} MiB since round 2 ({per_round:+.2f} per round) -> "
          f"{'FLAT (within' if flat else 'GROWS (beyond'} {args.tolerance_mb:g} MiB); server exit code {code}")
    if args.trim:
        trimmed_base, trimmed_last = rounds[1]["rss_after_trim_mib"], rounds[-1]["rss_after_trim_mib"]
        result["growth_after_trim_mib"] = round(trimmed_last - trimmed_base, 1)
        print(f"RSS after malloc_trim: {trimmed_base:.1f} MiB after round 2, {trimmed_last:.1f} after round "
              f"{len(rounds)}: {trimmed_last - trimmed_base:+.1f} MiB")
    if args.trace:
        assert work_dir is not None
        grew = compare_dumps(work_dir, 1, server.dumps)
        result["trace"] = grew
        print(f"traced, round 2 -> round {len(rounds)}: allocation sites that grew")
        for site in grew["sites"]:
            print(f"  {site['grew_kib']:+10.1f} KiB {site['blocks']:+8d} blocks  {site['site']}")
        print("live objects that grew, by type")
        for obj in grew["objects"]:
            print(f"  {obj['more']:+8d} (now {obj['now']})  {obj['type']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    server.log_path.unlink()  # kept only when the run fails, to see why
    if work_dir is not None:
        shutil.rmtree(work_dir)


if __name__ == "__main__":
    main()
