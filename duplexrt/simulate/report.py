"""What a simulation measured, as a record, a table and JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import attrs

from duplexrt.core.histogram import Summary


@attrs.frozen
class InProcessFigures:
    """What only a round in this process can measure: the runtime's own counters and histograms,
    and the kernel's account of the whole process (scheduler thread and load generator
    included, so nothing the runtime costs can hide)."""

    cpu_us_per_frame: float
    voluntary_switches: int
    involuntary_switches: int
    voluntary_switches_per_frame: float
    involuntary_switches_per_frame: float
    #: Worker-thread runs (``HandoffStatistics.offloads``).
    executor_submissions: int
    preprocess_us: Summary
    enqueue_us: Summary
    latency_ms: Summary
    delivery_ms: Summary
    step_to_sent_ms: Summary
    step_ms: Summary


@attrs.frozen
class ServerFigures:
    """What a round against a running server (``--url``) measures beyond the common figures:
    the connections, the differences between two scrapes of the server's ``/metrics``, and this
    process's own CPU as the load generator's.  A figure is None only where a scrape failed
    (``notes`` says why) or the server does not collect it."""

    #: The WebSocket URL the clients connected to.
    url: str
    #: Sessions whose connection opened (and whose server greeted them).
    sessions_connected: int
    #: Connections that failed, by kind (refused, http_503, closed_early, idle_timeout, ...).
    connection_errors: dict[str, int]
    #: This process's own CPU per frame sent: what generating the load cost.
    load_generator_cpu_us_per_frame: float
    #: ``--drop-rate``: connections cut mid-stream (None without it), and sessions resumed after
    #: a drop, injected or real.
    drops: int | None = None
    resumes: int = 0
    #: The server process's CPU (process_cpu_seconds_total, 10 ms ticks) per frame it took in.
    server_cpu_us_per_frame: float | None = None
    #: The scheduler thread's part of that CPU: stepping and its crossings, against the trio
    #: thread's serving (sockets, translators, sessions).  Its own clock is exact and the
    #: process's counts 10 ms ticks, so it means something over seconds of load (None without a
    #: tick, or from a server that does not export it).
    server_scheduler_cpu_share: float | None = None
    server_frames_in: int | None = None
    server_frames_out: int | None = None
    #: Mean model step time and mean frame latency (submitted to sent), from the server's
    #: histograms' sums and counts.
    server_step_ms_mean: float | None = None
    server_latency_ms_mean: float | None = None
    #: The replica whose /metrics gave the server figures (its ``server.replica_id``): behind a
    #: balancer, one replica's figures, not the whole cluster's.
    server_replica: str | None = None
    #: What could not be measured, and why (a failed scrape of /metrics).
    notes: list[str] = attrs.Factory(list)


#: A round's JSON row names every figure of both paths, as it always has: the other path's are null.
_JSON_FIELDS = ("cpu_us_per_frame", "voluntary_switches", "involuntary_switches", "voluntary_switches_per_frame",
                "involuntary_switches_per_frame", "executor_submissions", "preprocess_us", "enqueue_us",
                "latency_ms", "delivery_ms", "step_to_sent_ms", "step_ms", "sessions_connected",
                "server_cpu_us_per_frame", "server_scheduler_cpu_share", "load_generator_cpu_us_per_frame",
                "server_frames_in",
                "server_frames_out", "server_step_ms_mean", "server_latency_ms_mean", "server_replica", "drops",
                "resumes")


@attrs.frozen
class RoundReport:
    """One measured round: every figure is for this round alone.

    The figures both paths measure are here; ``measured`` holds the rest, which differ by path:
    ``InProcessFigures`` in process, ``ServerFigures`` against a running server (``--url``).  The
    client-side figures (elapsed, frames in and out, frame lag, late frames, real-time factor,
    guards) come from the virtual clients either way.
    """

    mode: str
    sessions: int
    elapsed_s: float
    frames_in: int
    frames_out: int
    #: Thread handoffs by kind (the server's, against a server).
    handoffs: dict[str, int]
    #: Scheduler steps and the mean batch (None only when a server's /metrics could not be read).
    steps: int | None
    mean_batch: float | None
    failures: list[str]
    measured: InProcessFigures | ServerFigures
    #: Paced rounds, and burst rounds that keep their samples: each output frame's lag.
    frame_lag_ms: Summary | None = None
    late_frames: int | None = None
    real_time_factor: float | None = None
    #: Paced: the output stream's duration over the input's (``stream_real_time_factor``): what
    #: the real-time criterion of ``--find-capacity`` reads, unlike ``real_time_factor``, which
    #: includes the last frame's lag.
    stream_rtf: float | None = None
    #: The runtime's own admission estimate at the end of the round (``/readyz``'s ``capacity``).
    capacity: dict[str, Any] | None = None
    #: With ``keep_samples``: every output frame's (seconds into the round, lag in ms), for
    #: ``--plot``.  Never written to JSON.
    lag_samples: tuple[Any, Any] | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def in_process(self) -> bool:
        return isinstance(self.measured, InProcessFigures)

    @property
    def target(self) -> str:
        """``in-process``, or the WebSocket URL the clients connected to."""
        return self.measured.url if isinstance(self.measured, ServerFigures) else "in-process"

    @property
    def ok(self) -> bool:
        return not self.failures

    def as_dict(self) -> dict[str, Any]:
        """The round as one flat record (its JSON row): every figure of either path by name."""
        row = attrs.asdict(self, recurse=True, filter=lambda a, _v: a.name not in ("lag_samples", "measured"))
        measured = attrs.asdict(self.measured)
        row.update({name: measured.get(name) for name in _JSON_FIELDS})
        row["target"] = self.target
        row["connection_errors"] = measured.get("connection_errors", {})
        row["notes"] = measured.get("notes", [])
        return row


@attrs.frozen
class SimulationReport:
    settings: dict[str, Any]
    rounds: list[RoundReport]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rounds)

    def to_json(self) -> str:
        rounds = [r.as_dict() for r in self.rounds]
        return json.dumps({"settings": self.settings, "ok": self.ok, "rounds": rounds}, indent=2)


#: One row of a table: a round's figure as text.
Column = Callable[[RoundReport], str]


def _in_process(r: RoundReport) -> InProcessFigures:
    """The in-process figures of a round the in-process table shows (it shows no other)."""
    assert isinstance(r.measured, InProcessFigures), "format_table sends --url rounds to their own table"
    return r.measured


def _server(r: RoundReport) -> ServerFigures:
    """The server figures of a round the ``--url`` table shows (it shows no other)."""
    assert isinstance(r.measured, ServerFigures), "format_table sends in-process rounds to their own table"
    return r.measured


def _handoffs_of(kind: str) -> Column:
    return lambda r: str(r.handoffs.get(kind, 0))


def _percent(share: float | None) -> float | None:
    return None if share is None else 100 * share


def _summary(s: Summary, digits: int = 2) -> str:
    return f"{s.p50:.{digits}f} / {s.p99:.{digits}f} / {s.max:.{digits}f}"


def format_table(report: SimulationReport) -> str:
    """A plain-text table: one column per round."""
    if report.rounds and not all(r.in_process for r in report.rounds):
        return _format_url_table(report)
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, fn: Column) -> None:
        rows.append((name, [fn(r) for r in report.rounds]))

    add("elapsed (s)", lambda r: f"{r.elapsed_s:.3f}")
    add("frames in / out", lambda r: f"{r.frames_in} / {r.frames_out}")
    add("host CPU per frame (µs)", lambda r: f"{_in_process(r).cpu_us_per_frame:.2f}")
    add("voluntary ctx switches / frame", lambda r: f"{_in_process(r).voluntary_switches_per_frame:.3f}")
    add("involuntary ctx switches / frame", lambda r: f"{_in_process(r).involuntary_switches_per_frame:.3f}")
    kinds = sorted({k for r in report.rounds for k in r.handoffs})
    for kind in kinds:
        add(f"handoffs: {kind}", _handoffs_of(kind))
    add("executor submissions", lambda r: str(_in_process(r).executor_submissions))
    add("preprocess per message p50 (µs)", lambda r: f"{_in_process(r).preprocess_us.p50:.1f}")
    add("enqueue per frame p50 (µs)", lambda r: f"{_in_process(r).enqueue_us.p50:.1f}")
    add("latency p50/p99/max (ms)", lambda r: _summary(_in_process(r).latency_ms))
    add("step→delivered p50/p99/max (ms)", lambda r: _summary(_in_process(r).delivery_ms, 3))
    add("step→sent p50/p99/max (ms)", lambda r: _summary(_in_process(r).step_to_sent_ms, 3))
    add("scheduler steps", lambda r: str(r.steps))
    add("mean batch", lambda r: f"{r.mean_batch:.1f}")
    add("step time p50/p99 (ms)", lambda r: f"{_in_process(r).step_ms.p50:.3f} / {_in_process(r).step_ms.p99:.3f}")
    _add_pacing_and_guards(report, add)
    return _render(report, rows)


def _add_pacing_and_guards(report: SimulationReport, add: Callable[[str, Column], None]) -> None:
    if any(r.frame_lag_ms is not None for r in report.rounds):
        add("frame lag p50/p99/max (ms)", lambda r: _summary(r.frame_lag_ms) if r.frame_lag_ms else "-")
        add("late frames", lambda r: str(r.late_frames))
        # Two ratios, named apart: the verdict (docs/capacity.md) reads the stream's.
        add("stream real-time factor (criterion)",
            lambda r: f"{r.stream_rtf:.4f}" if r.stream_rtf is not None and math.isfinite(r.stream_rtf) else "-")
        add("send→last output / audio (incl. lag)",
            lambda r: f"{r.real_time_factor:.3f}" if r.real_time_factor else "-")
    if any(r.capacity for r in report.rounds):
        add("admission estimate (sessions)", lambda r: _capacity_text(r.capacity))
    add("guards", lambda r: "ok" if r.ok else f"FAILED ({len(r.failures)})")


def _capacity_text(capacity: dict[str, Any] | None) -> str:
    if not capacity:
        return "-"
    return (f"{capacity['limit']} ({capacity['base_ms']:.1f} + {capacity['per_session_ms']:.2f}·n ms, "
            f"{capacity['source']})")


def _render(report: SimulationReport, rows: list[tuple[str, list[str]]]) -> str:
    header = ["", *[f"round {i + 1}" for i in range(len(report.rounds))]]
    width0 = max(len(name) for name, _ in rows)
    widths = [max(len(header[i + 1]), *(len(v[i]) for _, v in rows)) for i in range(len(report.rounds))]
    lines = ["  ".join([header[0].ljust(width0), *(h.rjust(w) for h, w in zip(header[1:], widths))])]
    for name, values in rows:
        lines.append("  ".join([name.ljust(width0), *(v.rjust(w) for v, w in zip(values, widths))]))
    return "\n".join(lines)


def _optional(value: float | int | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _format_url_table(report: SimulationReport) -> str:
    """The table for a run against a server (``--url``): client-side figures, then the server's
    (from its /metrics), then what generating the load cost this process."""
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, fn: Column) -> None:
        rows.append((name, [fn(r) for r in report.rounds]))

    add("elapsed (s)", lambda r: f"{r.elapsed_s:.3f}")
    add("sessions connected / attempted", lambda r: f"{_server(r).sessions_connected} / {r.sessions}")
    add("connection errors", lambda r: ", ".join(f"{k}: {v}" for k, v in sorted(_server(r).connection_errors.items()))
        or "none")
    if any(_server(r).drops or _server(r).resumes for r in report.rounds):
        add("connections cut / sessions resumed",
            lambda r: f"{_optional(_server(r).drops, 'd')} / {_server(r).resumes}")
    add("frames in / out (clients)", lambda r: f"{r.frames_in} / {r.frames_out}")
    add("server figures from replica", lambda r: _server(r).server_replica or "-")
    add("frames in / out (server)", lambda r: f"{_optional(_server(r).server_frames_in, 'd')} / "
                                              f"{_optional(_server(r).server_frames_out, 'd')}")
    add("server CPU per frame (µs)", lambda r: _optional(_server(r).server_cpu_us_per_frame, ".2f"))
    add("server CPU on the scheduler thread (%)",
        lambda r: _optional(_percent(_server(r).server_scheduler_cpu_share), ".1f"))
    add("load-generator CPU per frame (µs)", lambda r: _optional(_server(r).load_generator_cpu_us_per_frame, ".2f"))
    kinds = sorted({k for r in report.rounds for k in r.handoffs})
    for kind in kinds:
        add(f"server handoffs: {kind}", _handoffs_of(kind))
    add("server scheduler steps", lambda r: _optional(r.steps, "d"))
    add("server mean batch", lambda r: _optional(r.mean_batch, ".1f"))
    add("server step time mean (ms)", lambda r: _optional(_server(r).server_step_ms_mean, ".3f"))
    add("server frame latency mean (ms)", lambda r: _optional(_server(r).server_latency_ms_mean, ".2f"))
    _add_pacing_and_guards(report, add)
    targets = sorted({r.target for r in report.rounds})
    notes = [*report.settings.get("notes", []), *(n for r in report.rounds for n in _server(r).notes)]
    return "\n".join([f"server: {', '.join(targets)}", _render(report, rows), *(f"note: {n}" for n in notes)])
