"""Prometheus metrics, read from the runtime's own counters at scrape time.

Nothing is recorded for Prometheus on the hot path: the runtime already keeps counters and
fixed-size histograms, and this collector turns them into Prometheus families when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from duplexrt.histogram import Histogram

_SECONDS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def _histogram(name: str, doc: str, histogram: Histogram, bounds: list[float], scale: float) -> HistogramMetricFamily:
    edges = [int(b * scale) for b in bounds]
    cumulative = histogram.cumulative(edges)
    buckets = [(repr(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", histogram.count)]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=histogram.total / scale)


class RuntimeCollector:
    def __init__(self, server) -> None:  # duplexrt.server.app.Server
        self._server = server

    def collect(self) -> Iterator[Metric]:
        runtime = self._server.runtime
        if runtime is None:  # not started yet
            return
        scheduler = runtime.scheduler
        metrics = runtime.metrics
        handoffs = runtime.handoffs.statistics()
        replica = GaugeMetricFamily("duplexrt_replica_info", "This replica's name behind a load balancer (always 1).",
                                    labels=["replica_id"])
        replica.add_metric([self._server.replica_id], 1)
        yield replica
        yield GaugeMetricFamily("duplexrt_sessions_active", "Sessions being served now.", metrics.sessions_active)
        yield CounterMetricFamily("duplexrt_sessions_opened", "Sessions opened since start.", metrics.sessions_opened)
        refused = CounterMetricFamily("duplexrt_connections_refused", "WebSocket connections refused, by reason.",
                                      labels=["reason"])
        for reason, count in sorted(self._server.refused.items()):
            refused.add_metric([reason], count)
        yield refused
        yield GaugeMetricFamily("duplexrt_pending_handshakes", "Connections still sending their request head.",
                                self._server.pending_handshakes)
        yield GaugeMetricFamily("duplexrt_slots", "Slots (batch rows) of the model.", scheduler.slots)
        yield GaugeMetricFamily("duplexrt_slots_free", "Slots free for new sessions.", scheduler.free_slots)
        capacity = scheduler.capacity.estimate
        yield GaugeMetricFamily("duplexrt_capacity_sessions",
                                "Sessions the model can step within a frame period, from its fitted step cost.",
                                capacity.sessions)
        yield GaugeMetricFamily("duplexrt_capacity_limit",
                                "Sessions admitted at most: the estimate, or runtime.max_sessions.", capacity.limit)
        yield GaugeMetricFamily("duplexrt_sessions_admitted", "Connections admitted and not yet ended.",
                                self._server.admitted)
        yield GaugeMetricFamily("duplexrt_step_cost_base_seconds",
                                "Fitted step cost: the part paid whatever the batch size.", capacity.base_ms / 1e3)
        yield GaugeMetricFamily("duplexrt_step_cost_per_session_seconds",
                                "Fitted step cost: the part each row of the batch adds.",
                                capacity.per_session_ms / 1e3)
        yield CounterMetricFamily("duplexrt_frames_in", "Model frames submitted by sessions.", metrics.frames_in)
        yield CounterMetricFamily("duplexrt_frames_out", "Model frames sent back to clients.", metrics.frames_out)
        stats = scheduler.statistics()
        yield CounterMetricFamily("duplexrt_steps", "Batched model steps.", stats.steps)
        by_kind = CounterMetricFamily("duplexrt_handoffs", "Thread crossings, by kind.", labels=["kind"])
        for kind, count in sorted(handoffs.by_kind.items()):
            by_kind.add_metric([kind], count)
        yield by_kind
        yield _histogram("duplexrt_batch_size", "Sessions per model step.", scheduler.batch_sizes.snapshot(),
                         _BATCH, 1)
        yield _histogram("duplexrt_step_seconds", "Time the model took per step.",
                         scheduler.step_time_snapshot(), _SECONDS, 1e9)
        yield CounterMetricFamily("duplexrt_frames_filled",
                                  "Frames stepped with silence because a session's input was overdue.",
                                  metrics.frames_filled)
        yield CounterMetricFamily("duplexrt_frames_dropped_late",
                                  "Frames of input dropped because they came for time already filled.",
                                  metrics.frames_dropped_late)
        yield CounterMetricFamily("duplexrt_text_pieces", "Pieces of model text sent.", metrics.text_pieces)
        yield CounterMetricFamily("duplexrt_late_frames",
                                  "Frames whose submit to sent took longer than one frame period.",
                                  metrics.late_frames)
        yield _histogram("duplexrt_frame_latency_seconds", "A frame's submit to its output being sent.",
                         metrics.latency, _SECONDS, 1e9)
        yield _histogram("duplexrt_time_to_first_audio_seconds", "Session opened to its first audio sent.",
                         metrics.first_audio, _SECONDS, 1e9)
        yield _histogram("duplexrt_frame_jitter_seconds",
                         "How far each send strays from one frame period after the previous one.",
                         metrics.jitter, _SECONDS, 1e9)
        yield _histogram("duplexrt_delivery_seconds", "A step finished to its outputs reaching the sessions.",
                         scheduler.delivery_delay, _SECONDS, 1e9)
        stages = HistogramMetricFamily("duplexrt_stage_seconds", "Time per model step, by backend stage.",
                                       labels=["stage"])
        for name, histogram in sorted(scheduler.stage_time.items()):
            edges = [int(b * 1e9) for b in _SECONDS]
            buckets = [(repr(b), c) for b, c in zip(_SECONDS, histogram.cumulative(edges))]
            stages.add_metric([name], buckets + [("+Inf", histogram.count)], histogram.total / 1e9)
        yield stages


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
