"""``log_stats``: one line in the log every interval, for operators who read logs, not graphs.

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
    over each interval, until cancelled."""
    previous_time = trio.current_time()
    previous = runtime.statistics()
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        elapsed = max(now - previous_time, 1e-9)
        stats = runtime.statistics()
        interval_latency = stats.histograms.latency.minus(previous.histograms.latency).summary()
        step_count = stats.scheduler.steps - previous.scheduler.steps
        frames = stats.scheduler.frames - previous.scheduler.frames
        log.info(
            "sessions %d | steps/s %.1f | mean batch %.1f | frame latency p50 %.1f ms p99 %.1f ms | "
            "handoffs/s %.1f | offloads/s %.1f",
            stats.sessions_active, step_count / elapsed, frames / step_count if step_count else 0.0,
            interval_latency.p50 / 1e6, interval_latency.p99 / 1e6,
            (sum(stats.handoffs.by_kind.values()) - sum(previous.handoffs.by_kind.values())) / elapsed,
            (stats.handoffs.offloads - previous.handoffs.offloads) / elapsed,
        )
        previous_time, previous = now, stats
