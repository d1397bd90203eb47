"""``log_stats``: one line in the log every interval while something changes, for operators who
read logs, not graphs.

Everything comes from ``Runtime.statistics()``: the line costs one record (a few histogram
copies) per interval, nothing per frame.
"""

from __future__ import annotations

import logging

import trio

from duplexrt.runtime import Runtime

log = logging.getLogger("duplexrt.stats")


async def log_stats(runtime: Runtime, interval: float) -> None:
    """Log active sessions, steps/s, mean batch, frame latency p50/p99, handoffs/s and offloads/s
    over each interval, until cancelled.  A line the same as the one logged last is not logged
    again: an idle server logs one line, not one every interval."""
    previous_time = trio.current_time()
    previous = runtime.statistics()
    last: str | None = None  # the line logged last
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        elapsed = max(now - previous_time, 1e-9)
        stats = runtime.statistics()
        interval_latency = stats.histograms.latency.minus(previous.histograms.latency).summary()
        step_count = stats.scheduler.steps - previous.scheduler.steps
        frames = stats.scheduler.frames - previous.scheduler.frames
        line = (
            f"sessions {stats.sessions_active} | steps/s {step_count / elapsed:.1f} | "
            f"mean batch {frames / step_count if step_count else 0.0:.1f} | "
            f"frame latency p50 {interval_latency.p50 / 1e6:.1f} ms p99 {interval_latency.p99 / 1e6:.1f} ms | "
            f"handoffs/s {(sum(stats.handoffs.by_kind.values()) - sum(previous.handoffs.by_kind.values())) / elapsed:.1f}"
            f" | offloads/s {(stats.handoffs.offloads - previous.handoffs.offloads) / elapsed:.1f}"
        )
        if line != last:  # an idle server says so once, then nothing until something changes
            log.info("%s", line)
            last = line
        previous_time, previous = now, stats
