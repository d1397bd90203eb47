"""One paced round judged by the real-time criterion, with the figures that explain a verdict.

``simulate --find-capacity`` bisects; this runs one count, for hand checks of its answer and for
tables at fixed loads (docs/capacity.md).  Besides the verdict it prints when the late frames
came (per 2 s of the round: a cluster says something outside the runtime stalled it), the step
time spread, and, against a server (``--url``), the server's own step and send-jitter spread from
``/stats`` (cumulative since the server started: start one per measurement).

    python benchmarks/capacity_probe.py 38 -o step_ms=28 -o slot_us=1300 --slots 48
    python benchmarks/capacity_probe.py 40 --url ws://127.0.0.1:8000/v1/duplex -o step_ms=28 -o slot_us=1300
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import trio

from duplexrt.client.metrics import http_get
from duplexrt.config import load_config
from duplexrt.simulate.find_capacity import judge
from duplexrt.simulate.in_process import run_simulation
from duplexrt.simulate.network import run_url_simulation
from duplexrt.simulate.options import SimulateOptions, search_options
from duplexrt.simulate.report import InProcessFigures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sessions", type=int)
    parser.add_argument("--url", default=None)
    parser.add_argument("--message-ms", type=float, default=80.0)
    parser.add_argument("--seconds", type=float, default=30.0, help="paced audio per session (criterion: 30)")
    parser.add_argument("-o", dest="options", action="append", default=[], help="synthetic backend option")
    parser.add_argument("--slots", type=int, default=48, help="in process")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="config override, in process")
    args = parser.parse_args()
    overrides = ['backend.name="synthetic"', *(f"backend.options.{o}" for o in args.options)]
    if args.url is None:
        overrides += [f"runtime.slots={args.slots}", *args.sets]
    config = load_config(None, overrides)
    frame_ms = config.audio.frame_seconds * 1e3
    options = search_options(SimulateOptions(concurrency=args.sessions, message_ms=args.message_ms),
                             config.audio.frame_seconds, args.seconds)
    if args.url is None:
        report = trio.run(run_simulation, config, options)
    else:
        report = trio.run(run_url_simulation, config, options, args.url)
    round_ = report.rounds[0]
    verdict = judge(round_, frame_ms)
    times, lags = round_.lag_samples
    late = lags > verdict.deadline_ms
    print(f"{args.sessions} sessions, {args.message_ms:g} ms messages: {'holds' if verdict.holds else 'FAILS'}; "
          f"{100 * verdict.on_time_share:.2f} % on time (deadline {verdict.deadline_ms:.1f} ms); frame lag "
          f"p50/p99/p99.9/max {verdict.lag_p50_ms:.1f}/{verdict.lag_p99_ms:.1f}/{verdict.lag_p999_ms:.1f}/"
          f"{lags.max():.1f} ms; mean batch {round_.mean_batch:.1f}; step {verdict.step_ms:.1f} ms (mean); "
          f"stream RTF {round_.stream_rtf:.4f}")
    measured = round_.measured
    if isinstance(measured, InProcessFigures) and measured.step_ms.count:
        step = measured.step_ms
        print(f"  step p50/p99/max {step.p50:.1f}/{step.p99:.1f}/{step.max:.1f} ms; "
              f"host CPU per frame {measured.cpu_us_per_frame:.0f} µs")
    if late.any():
        per_2s = np.histogram(times[late], bins=np.arange(0.0, times.max() + 2.0, 2.0))[0]
        print(f"  late frames per 2 s: {per_2s.tolist()}")
    if args.url is not None:
        _, body = trio.run(http_get, args.url, "/stats")
        stats = json.loads(body)
        print(f"  server (since start): step {stats['step']}, send jitter {stats['send_jitter_ms']}, "
              f"refused {stats['refused']}, capacity {stats['capacity']}")
    if verdict.reason:
        print(f"  {verdict.reason}")
    print(f"  admission estimate: {round_.capacity}")


if __name__ == "__main__":
    main()
