"""Prometheus metrics, read from ``Server.statistics()`` at scrape time.

Nothing is recorded for Prometheus on the hot path: the runtime already keeps counters and
fixed-size histograms, and this collector turns them into Prometheus families when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from duplexrt.core.histogram import Histogram
from duplexrt.server.statistics import ServerStatistics

_SECONDS = [0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12]
_BATCH = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def _histogram(name: str, doc: str, histogram: Histogram, bounds: Sequence[float], scale: float) -> HistogramMetricFamily:
    edges = [int(b * scale) for b in bounds]
    cumulative = histogram.cumulative(edges)
    buckets = [(repr(b), c) for b, c in zip(bounds, cumulative)] + [("+Inf", histogram.count)]
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=histogram.total / scale)


class RuntimeCollector:
    """Turns ``Server.statistics()`` into Prometheus families at scrape time."""

    def __init__(self, read: Callable[[], ServerStatistics | None]) -> None:
        self._read = read  # None: the server has not started yet

    def collect(self) -> Iterator[Metric]:
        server = self._read()
        if server is None:
            return
        stats = server.runtime
        frames = stats.frames
        histograms = stats.histograms
        capacity = stats.capacity
        replica = GaugeMetricFamily("duplexrt_replica_info", "This replica's name behind a load balancer (always 1).",
                                    labels=["replica_id"])
        replica.add_metric([server.replica_id], 1)
        yield replica
        yield GaugeMetricFamily("duplexrt_sessions_active", "Sessions being served now.", frames.sessions_active)
        yield CounterMetricFamily("duplexrt_sessions_opened", "Sessions opened since start.", frames.sessions_opened)
        yield GaugeMetricFamily("duplexrt_sessions_detached",
                                "Sessions whose connection dropped, holding their slots while they wait for a resume.",
                                server.detached)
        yield CounterMetricFamily("duplexrt_sessions_resumed",
                                  "Sessions resumed on a new connection after a drop (runtime.resume_window_s).",
                                  frames.sessions_resumed)
        refused = CounterMetricFamily("duplexrt_connections_refused", "WebSocket connections refused, by reason.",
                                      labels=["reason"])
        for reason, count in server.refused.items():
            refused.add_metric([reason], count)
        yield refused
        yield GaugeMetricFamily("duplexrt_pending_handshakes", "Connections still sending their request head.",
                                server.pending_handshakes)
        yield GaugeMetricFamily("duplexrt_slots", "Slots (batch rows) of the model.", stats.slots)
        yield GaugeMetricFamily("duplexrt_slots_free", "Slots free for new sessions (the slots less those admitted).",
                                server.free_slots)
        yield GaugeMetricFamily("duplexrt_capacity_sessions",
                                "Sessions the model can step within a frame period, from its fitted step cost.",
                                capacity.sessions)
        yield GaugeMetricFamily("duplexrt_capacity_limit",
                                "Sessions admitted at most: the estimate, or runtime.max_sessions.", capacity.limit)
        yield GaugeMetricFamily("duplexrt_sessions_admitted", "Connections admitted and not yet ended.",
                                server.admitted)
        yield GaugeMetricFamily("duplexrt_step_cost_base_seconds",
                                "Fitted step cost: the part paid whatever the batch size.", capacity.base_ms / 1e3)
        yield GaugeMetricFamily("duplexrt_step_cost_per_session_seconds",
                                "Fitted step cost: the part each row of the batch adds.",
                                capacity.per_session_ms / 1e3)
        yield CounterMetricFamily("duplexrt_frames_in", "Model frames submitted by sessions.", frames.frames_in)
        yield CounterMetricFamily("duplexrt_frames_out", "Model frames sent back to clients.", frames.frames_out)
        yield CounterMetricFamily("duplexrt_steps", "Batched model steps.", stats.scheduler.steps)
        yield CounterMetricFamily("duplexrt_scheduler_thread_cpu_seconds",
                                  "CPU time of the scheduler thread (the rest of process_cpu_seconds is the trio "
                                  "thread's and the worker threads').", stats.scheduler.thread_cpu_seconds)
        by_kind = CounterMetricFamily("duplexrt_handoffs", "Thread crossings, by kind.", labels=["kind"])
        for kind, count in sorted(stats.handoffs.by_kind.items()):
            by_kind.add_metric([kind], count)
        yield by_kind
        yield CounterMetricFamily("duplexrt_output_batches_direct",
                                  "Batches of output sent from the step delivery itself, with no writer task woken.",
                                  frames.direct_batches)
        yield CounterMetricFamily("duplexrt_writer_wakeups", "Times a session's writer task woke.",
                                  frames.writer_wakeups)
        yield _histogram("duplexrt_batch_size", "Sessions per model step.", histograms.batch_sizes, _BATCH, 1)
        yield _histogram("duplexrt_step_seconds", "Time the model took per step.",
                         histograms.step_time, _SECONDS, 1e9)
        yield CounterMetricFamily("duplexrt_frames_filled",
                                  "Frames stepped with silence because a session's input was overdue.",
                                  frames.frames_filled)
        yield CounterMetricFamily("duplexrt_frames_dropped_late",
                                  "Frames of input dropped because they came for time already filled.",
                                  frames.frames_dropped_late)
        yield CounterMetricFamily("duplexrt_text_pieces", "Pieces of model text sent.", frames.text_pieces)
        yield CounterMetricFamily("duplexrt_late_frames",
                                  "Frames whose submit to sent took longer than one frame period.",
                                  frames.late_frames)
        yield _histogram("duplexrt_frame_latency_seconds", "A frame's submit to its output being sent.",
                         histograms.latency, _SECONDS, 1e9)
        yield _histogram("duplexrt_time_to_first_audio_seconds", "Session opened to its first audio sent.",
                         histograms.first_audio, _SECONDS, 1e9)
        yield _histogram("duplexrt_frame_jitter_seconds",
                         "How far each send strays from one frame period after the previous one.",
                         histograms.jitter, _SECONDS, 1e9)
        yield _histogram("duplexrt_delivery_seconds", "A step finished to its outputs reaching the sessions.",
                         histograms.delivery, _SECONDS, 1e9)
        stages = HistogramMetricFamily("duplexrt_stage_seconds", "Time per model step, by backend stage.",
                                       labels=["stage"])
        for name, histogram in histograms.stages.items():
            edges = [int(b * 1e9) for b in _SECONDS]
            buckets = [(repr(b), c) for b, c in zip(_SECONDS, histogram.cumulative(edges))]
            stages.add_metric([name], buckets + [("+Inf", histogram.count)], histogram.total / 1e9)
        yield stages


def metrics_text(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
