"""What stage timing costs per call on the trio thread, in process: the meter's own calls and the
histogram inserts behind them, best of five runs of 200,000 calls each.

Whole-process A/B runs (``duplexrt simulate --collect-stage-metrics`` against
``--no-collect-stage-metrics``) carry the meter's effect on batching too, and this machine's noise;
this isolates the calls themselves, so that a change to them can be judged on its own.

Usage: python benchmarks/stage_meter_cost.py
"""

from __future__ import annotations

import time
import timeit
from collections.abc import Callable

from duplexrt.core.histogram import Histogram
from duplexrt.core.metrics import FrameMetrics
from duplexrt.core.stage_meter import StageMeter

CALLS = 200_000


def per_call_ns(call: Callable[[], object]) -> float:
    return min(timeit.repeat(call, number=CALLS, repeat=5)) / CALLS * 1e9


def main() -> None:
    meter = StageMeter(FrameMetrics(), 0.08)
    meter.opened()
    now = time.perf_counter_ns()
    meter.batch_sent([(None, None, now - 5_000_000, now - 1_000_000)], now, 0)  # first audio taken
    one = [(None, None, now - 5_000_000, now - 1_000_000)]
    four = one * 4
    histogram = Histogram()
    rows = [
        ("StageMeter.message_started", lambda: meter.message_started()),
        ("StageMeter.message_framed", lambda: meter.message_framed(now)),
        ("StageMeter.batch_sent, 1 frame", lambda: meter.batch_sent(one, now, now - 80_000_000)),
        ("StageMeter.batch_sent, 4 frames", lambda: meter.batch_sent(four, now, now - 80_000_000)),
        ("Histogram.record", lambda: histogram.record(5_000_000)),
        ("Histogram.add", lambda: histogram.add(5_000_000)),
        ("an empty call (the floor)", lambda: None),
    ]
    for name, call in rows:
        print(f"{name:34s} {per_call_ns(call):7.0f} ns")


if __name__ == "__main__":
    main()
