"""What a simulation measured, as a record, a table and JSON."""

from __future__ import annotations

import json
from typing import Any

import attrs

from duplexrt.core.histogram import Summary


@attrs.frozen
class RoundReport:
    """One measured round: every figure is for this round alone.

    In process (``target == "in-process"``) every figure is this process's: the runtime's counters
    and the kernel's account of the whole process.  Against a running server (``--url``), the
    client-side figures (elapsed, frames in and out, frame lag, late frames, real-time factor,
    guards) come from the virtual clients; the server-side ones (``server_*``, handoffs, steps,
    mean batch) from the differences between two scrapes of its ``/metrics``; the figures only
    the in-process runtime has are None, and ``cpu_us_per_frame`` gives way to
    ``server_cpu_us_per_frame`` and ``load_generator_cpu_us_per_frame``.
    """

    mode: str
    sessions: int
    elapsed_s: float
    frames_in: int
    frames_out: int
    cpu_us_per_frame: float | None
    voluntary_switches: int | None
    involuntary_switches: int | None
    voluntary_switches_per_frame: float | None
    involuntary_switches_per_frame: float | None
    handoffs: dict[str, int]
    executor_submissions: int | None
    preprocess_us: Summary | None
    enqueue_us: Summary | None
    latency_ms: Summary | None
    delivery_ms: Summary | None
    step_to_sent_ms: Summary | None
    steps: int | None
    mean_batch: float | None
    step_ms: Summary | None
    frame_lag_ms: Summary | None
    late_frames: int | None
    real_time_factor: float | None
    failures: list[str]
    #: ``in-process``, or the WebSocket URL the clients connected to.
    target: str = "in-process"
    #: --url: sessions whose connection opened (and whose server greeted them).
    sessions_connected: int | None = None
    #: --url: connections that failed, by kind (refused, http_503, closed_early, idle_timeout, ...).
    connection_errors: dict[str, int] = attrs.Factory(dict)
    #: ``--drop-rate``: connections cut mid-stream, and sessions resumed after their cut.
    drops: int | None = None
    resumes: int | None = None
    #: --url: the server process's CPU (process_cpu_seconds_total, 10 ms ticks) per frame it took in.
    server_cpu_us_per_frame: float | None = None
    #: --url: this process's own CPU per frame sent: what generating the load cost.
    load_generator_cpu_us_per_frame: float | None = None
    server_frames_in: int | None = None
    server_frames_out: int | None = None
    #: --url: mean model step time and mean frame latency (submitted to sent), from the server's
    #: histograms' sums and counts (None where it does not collect them).
    server_step_ms_mean: float | None = None
    server_latency_ms_mean: float | None = None
    #: --url: what could not be measured, and why (a failed scrape of /metrics).
    notes: list[str] = attrs.Factory(list)
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
        return self.target == "in-process"

    @property
    def ok(self) -> bool:
        return not self.failures


@attrs.frozen
class SimulationReport:
    settings: dict[str, Any]
    rounds: list[RoundReport]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.rounds)

    def to_json(self) -> str:
        rounds = [attrs.asdict(r, filter=lambda a, _v: a.name != "lag_samples") for r in self.rounds]
        return json.dumps({"settings": self.settings, "ok": self.ok, "rounds": rounds}, indent=2)


def _summary(s: Summary, digits: int = 2) -> str:
    return f"{s.p50:.{digits}f} / {s.p99:.{digits}f} / {s.max:.{digits}f}"


def format_table(report: SimulationReport) -> str:
    """A plain-text table: one column per round."""
    if report.rounds and not all(r.in_process for r in report.rounds):
        return _format_url_table(report)
    rows: list[tuple[str, list[str]]] = []

    def add(name: str, fn) -> None:
        rows.append((name, [fn(r) for r in report.rounds]))

    add("elapsed (s)", lambda r: f"{r.elapsed_s:.3f}")
    add("frames in / out", lambda r: f"{r.frames_in} / {r.frames_out}")
    add("host CPU per frame (µs)", lambda r: f"{r.cpu_us_per_frame:.2f}")
    add("voluntary ctx switches / frame", lambda r: f"{r.voluntary_switches_per_frame:.3f}")
    add("involuntary ctx switches / frame", lambda r: f"{r.involuntary_switches_per_frame:.3f}")
    kinds = sorted({k for r in report.rounds for k in r.handoffs})
    for kind in kinds:
        add(f"handoffs: {kind}", lambda r, k=kind: str(r.handoffs.get(k, 0)))
    add("executor submissions", lambda r: str(r.executor_submissions))
    add("preprocess per message p50 (µs)", lambda r: f"{r.preprocess_us.p50:.1f}")
    add("enqueue per frame p50 (µs)", lambda r: f"{r.enqueue_us.p50:.1f}")
    add("latency p50/p99/max (ms)", lambda r: _summary(r.latency_ms))
    add("step→delivered p50/p99/max (ms)", lambda r: _summary(r.delivery_ms, 3))
    add("step→sent p50/p99/max (ms)", lambda r: _summary(r.step_to_sent_ms, 3))
    add("scheduler steps", lambda r: str(r.steps))
    add("mean batch", lambda r: f"{r.mean_batch:.1f}")
    add("step time p50/p99 (ms)", lambda r: f"{r.step_ms.p50:.3f} / {r.step_ms.p99:.3f}")
    _add_pacing_and_guards(report, add)
    return _render(report, rows)


def _add_pacing_and_guards(report: SimulationReport, add) -> None:
    if any(r.frame_lag_ms is not None for r in report.rounds):
        add("frame lag p50/p99/max (ms)", lambda r: _summary(r.frame_lag_ms) if r.frame_lag_ms else "-")
        add("late frames", lambda r: str(r.late_frames))
        add("real-time factor", lambda r: f"{r.real_time_factor:.3f}" if r.real_time_factor else "-")
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

    def add(name: str, fn) -> None:
        rows.append((name, [fn(r) for r in report.rounds]))

    add("elapsed (s)", lambda r: f"{r.elapsed_s:.3f}")
    add("sessions connected / attempted", lambda r: f"{_optional(r.sessions_connected, 'd')} / {r.sessions}")
    add("connection errors", lambda r: ", ".join(f"{k}: {v}" for k, v in sorted(r.connection_errors.items()))
        or "none")
    if any(r.drops or r.resumes for r in report.rounds):
        add("connections cut / sessions resumed", lambda r: f"{_optional(r.drops, 'd')} / {_optional(r.resumes, 'd')}")
    add("frames in / out (clients)", lambda r: f"{r.frames_in} / {r.frames_out}")
    add("frames in / out (server)", lambda r: f"{_optional(r.server_frames_in, 'd')} / "
                                              f"{_optional(r.server_frames_out, 'd')}")
    add("server CPU per frame (µs)", lambda r: _optional(r.server_cpu_us_per_frame, ".2f"))
    add("load-generator CPU per frame (µs)", lambda r: _optional(r.load_generator_cpu_us_per_frame, ".2f"))
    kinds = sorted({k for r in report.rounds for k in r.handoffs})
    for kind in kinds:
        add(f"server handoffs: {kind}", lambda r, k=kind: str(r.handoffs.get(k, 0)))
    add("server scheduler steps", lambda r: _optional(r.steps, "d"))
    add("server mean batch", lambda r: _optional(r.mean_batch, ".1f"))
    add("server step time mean (ms)", lambda r: _optional(r.server_step_ms_mean, ".3f"))
    add("server frame latency mean (ms)", lambda r: _optional(r.server_latency_ms_mean, ".2f"))
    _add_pacing_and_guards(report, add)
    targets = sorted({r.target for r in report.rounds})
    notes = [*report.settings.get("notes", []), *(n for r in report.rounds for n in r.notes)]
    return "\n".join([f"server: {', '.join(targets)}", _render(report, rows), *(f"note: {n}" for n in notes)])
