"""What a simulation measured, as a record, a table and JSON."""

from __future__ import annotations

import json
from typing import Any

import attrs

from duplexrt.histogram import Summary


@attrs.frozen
class RoundReport:
    """One measured round: every figure is for this round alone."""

    mode: str
    sessions: int
    elapsed_s: float
    frames_in: int
    frames_out: int
    cpu_us_per_frame: float
    voluntary_switches: int
    involuntary_switches: int
    voluntary_switches_per_frame: float
    involuntary_switches_per_frame: float
    handoffs: dict[str, int]
    executor_submissions: int
    preprocess_us: Summary
    enqueue_us: Summary
    latency_ms: Summary
    delivery_ms: Summary
    step_to_sent_ms: Summary
    steps: int
    mean_batch: float
    step_ms: Summary
    frame_lag_ms: Summary | None
    late_frames: int | None
    real_time_factor: float | None
    failures: list[str]

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
        return json.dumps({"settings": self.settings, "ok": self.ok,
                           "rounds": [attrs.asdict(r) for r in self.rounds]}, indent=2)


def _summary(s: Summary, digits: int = 2) -> str:
    return f"{s.p50:.{digits}f} / {s.p99:.{digits}f} / {s.max:.{digits}f}"


def format_table(report: SimulationReport) -> str:
    """A plain-text table: one column per round."""
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
    if any(r.frame_lag_ms is not None for r in report.rounds):
        add("frame lag p50/p99/max (ms)", lambda r: _summary(r.frame_lag_ms) if r.frame_lag_ms else "-")
        add("late frames", lambda r: str(r.late_frames))
        add("real-time factor", lambda r: f"{r.real_time_factor:.3f}" if r.real_time_factor else "-")
    add("guards", lambda r: "ok" if r.ok else f"FAILED ({len(r.failures)})")
    header = ["", *[f"round {i + 1}" for i in range(len(report.rounds))]]
    width0 = max(len(name) for name, _ in rows)
    widths = [max(len(header[i + 1]), *(len(v[i]) for _, v in rows)) for i in range(len(report.rounds))]
    lines = ["  ".join([header[0].ljust(width0), *(h.rjust(w) for h, w in zip(header[1:], widths))])]
    for name, values in rows:
        lines.append("  ".join([name.ljust(width0), *(v.rjust(w) for v, w in zip(values, widths))]))
    return "\n".join(lines)
