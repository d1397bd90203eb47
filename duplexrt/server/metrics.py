"""Prometheus metrics, read from ``Server.statistics()`` at scrape time.

Nothing is recorded for Prometheus on the hot path: the runtime already keeps counters and
fixed-size histograms, and this collector turns them into Prometheus families when scraped.

A page costs about a millisecond of the trio thread to render, the thread every session runs on,
so scrapes may not take as much of it as they ask for (``MetricsPage``): a scraper that comes now
and then (Prometheus every few seconds, ``simulate --url`` before and after a round) always gets
a fresh page; a client that scrapes in a loop gets the last page again, never more than a second
old, once renders have taken 1 % of the thread's time.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from duplexrt.core.histogram import Histogram
from duplexrt.reasons import REFUSAL_REASONS, FinishReason
from duplexrt.routes import ROUTE_TABLE
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
        by_route = GaugeMetricFamily("duplexrt_route_sessions_active", "Sessions being served now, by route.",
                                     labels=["route"])
        for route in _routes(frames.sessions_active_by_route):
            by_route.add_metric([route], frames.sessions_active_by_route.get(route, 0))
        yield by_route
        ended = CounterMetricFamily("duplexrt_sessions_ended", "Sessions ended, by route and finish reason.",
                                    labels=["route", "reason"])
        for (route, reason), count in _ended(frames.sessions_ended):
            ended.add_metric([route, reason], count)
        yield ended
        refused = CounterMetricFamily("duplexrt_connections_refused", "WebSocket connections refused, by reason.",
                                      labels=["reason"])
        for reason in sorted({*REFUSAL_REASONS, *server.refused}):
            refused.add_metric([reason], server.refused.get(reason, 0))
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
        if stats.persona is not None:
            yield from _prompt_cache(stats.persona.get("prompt_cache") or {})


def _routes(counted: Mapping[str, object]) -> list[str]:
    """Every route of the table, then any other counted (a session served without a route is not
    one of a server's)."""
    paths = [route.path for route in ROUTE_TABLE]
    return paths + sorted(route for route in counted if route and route not in paths)


def _ended(ended: Mapping[str, Mapping[str, int]]) -> Iterator[tuple[tuple[str, str], int]]:
    """``duplexrt_sessions_ended_total``'s samples: every route by every finish reason, at 0
    until one ends so (an alert on a rate needs its series before the first event)."""
    for route in _routes(ended):
        counts = ended.get(route, {})
        for reason in sorted({*FinishReason, *counts}):
            yield (route, str(reason)), counts.get(reason, 0)


def _prompt_cache(cache: Mapping[str, Any]) -> Iterator[Metric]:
    """The prompt cache of a model that takes a persona (``Backend.persona_info``): its counters
    and its size.  A model that takes none has no such families at all."""

    def value(key: str) -> float:
        return float(cache.get(key) or 0)

    yield CounterMetricFamily("duplexrt_prompt_cache_hits",
                              "Persona prompts whose state came from the prompt cache.", value("hits"))
    yield CounterMetricFamily("duplexrt_prompt_cache_misses",
                              "Persona prompts not in the prompt cache (each is prefilled).", value("misses"))
    yield CounterMetricFamily("duplexrt_prompt_cache_evictions",
                              "Prompt states dropped from the cache, least recently used first, to fit its bound.",
                              value("evictions"))
    yield CounterMetricFamily("duplexrt_prompt_prefills",
                              "Persona prompts run through the model (the misses, and the default one at load).",
                              value("prefills"))
    yield GaugeMetricFamily("duplexrt_prompt_cache_entries", "Prompt states in the cache now.", value("entries"))
    yield GaugeMetricFamily("duplexrt_prompt_cache_bytes", "Memory the cached prompt states take.", value("bytes"))
    yield GaugeMetricFamily("duplexrt_prompt_cache_max_bytes",
                            "The prompt cache's bound (backend.options.prompt_cache_mb).", value("max_bytes"))


class MetricsPage:
    """The rendered ``/metrics`` page of one registry, rendered again only while renders stay
    within their share of the thread.

    A credit of thread time fills at ``share`` of the clock (1 %: 10 ms a second), up to
    ``burst_s``; each render spends what it took.  With credit left, or with the last page older
    than ``max_age_s``, a scrape renders; otherwise it gets the last page.  So renders cost at
    most ``share`` of the thread plus one page per ``max_age_s``, and a page is at most
    ``max_age_s`` old."""

    def __init__(self, registry: CollectorRegistry, *, max_age_s: float = 1.0, share: float = 0.01,
                 burst_s: float = 0.01, clock: Callable[[], float] = time.monotonic) -> None:
        self._registry = registry
        self._max_age_s = max_age_s
        self._share = share
        self._burst_s = burst_s
        self._clock = clock
        self._credit = burst_s
        self._filled_at = clock()
        self._page = b""
        self._rendered_at = -float("inf")
        #: Pages rendered (the rest of the scrapes got the last one again).
        self.renders = 0

    def text(self) -> bytes:
        now = self._clock()
        self._credit = min(self._burst_s, self._credit + (now - self._filled_at) * self._share)
        self._filled_at = now
        if self._credit <= 0 and now - self._rendered_at < self._max_age_s:
            return self._page
        started = time.perf_counter()
        self._page = generate_latest(self._registry)
        self._credit -= time.perf_counter() - started
        self._rendered_at = now
        self.renders += 1
        return self._page


_PAGES: weakref.WeakKeyDictionary[CollectorRegistry, MetricsPage] = weakref.WeakKeyDictionary()


def metrics_text(registry: CollectorRegistry) -> bytes:
    """The ``/metrics`` page of ``registry`` (a server's): its ``MetricsPage``, made on first use."""
    page = _PAGES.get(registry)
    if page is None:
        page = _PAGES[registry] = MetricsPage(registry)
    return page.text()
