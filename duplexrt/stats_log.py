"""``log_stats``: one line in the log every interval, for operators who read logs, not graphs.

Everything comes from counters and histograms the runtime keeps anyway: the line costs a few
snapshots per interval, nothing per frame.
"""

from __future__ import annotations

import logging

import trio

from duplexrt.runtime import Runtime

log = logging.getLogger("duplexrt.stats")


def _offloads(by_kind: dict[str, int]) -> int:
    return sum(count for kind, count in by_kind.items() if kind.endswith("_offload"))


async def log_stats(runtime: Runtime, interval: float) -> None:
    """Log active sessions, steps/s, mean batch, frame latency p50/p99, handoffs/s and offloads/s
    over each interval, until cancelled."""
    previous_time = trio.current_time()
    previous_steps = runtime.scheduler.statistics()
    previous_handoffs = runtime.handoffs.statistics().by_kind
    previous_latency = runtime.metrics.latency.snapshot()
    while True:
        await trio.sleep(interval)
        now = trio.current_time()
        elapsed = max(now - previous_time, 1e-9)
        steps = runtime.scheduler.statistics()
        handoffs = runtime.handoffs.statistics().by_kind
        latency = runtime.metrics.latency.snapshot()
        interval_latency = latency.minus(previous_latency).summary()
        step_count = steps.steps - previous_steps.steps
        frames = steps.frames - previous_steps.frames
        log.info(
            "sessions %d | steps/s %.1f | mean batch %.1f | frame latency p50 %.1f ms p99 %.1f ms | "
            "handoffs/s %.1f | offloads/s %.1f",
            runtime.metrics.sessions_active, step_count / elapsed, frames / step_count if step_count else 0.0,
            interval_latency.p50 / 1e6, interval_latency.p99 / 1e6,
            (sum(handoffs.values()) - sum(previous_handoffs.values())) / elapsed,
            (_offloads(handoffs) - _offloads(previous_handoffs)) / elapsed,
        )
        previous_time, previous_steps, previous_handoffs, previous_latency = now, steps, handoffs, latency
