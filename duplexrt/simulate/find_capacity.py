"""``simulate --find-capacity``: the most paced sessions a backend holds in real time, by bisection.

The real-time criterion, the one place it is written (docs/capacity.md quotes it): over at least
``MIN_SECONDS`` of paced audio,

* the real-time factor is at most 1.0: each session's output stream (first output frame to last)
  lasts no longer than its input (first message sent to last), allowing the same slack as one
  frame's lag below, so that phase alone cannot fail it; and
* at least ``ON_TIME_SHARE`` of all output frames arrive within one frame period + the step time at
  that batch (the round's mean step) + ``SLACK_MS`` of their input being sent,

with every guard of the round passing (every frame back, in order, right content; no connection
refused).  ``find_capacity`` bisects the session count between one that holds and one that fails,
starting from the runtime's own admission estimate when one is known.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import attrs
import numpy as np

from duplexrt.simulate.report import InProcessFigures, RoundReport

MIN_SECONDS = 30.0
ON_TIME_SHARE = 0.999
SLACK_MS = 10.0


@attrs.frozen
class Verdict:
    """One probe: how many sessions, whether the criterion held, and the figures it read."""

    sessions: int
    holds: bool
    #: Why it failed ("" when it held).
    reason: str
    on_time_share: float | None
    deadline_ms: float | None
    step_ms: float | None
    stream_rtf: float | None
    lag_p50_ms: float | None
    lag_p99_ms: float | None
    lag_p999_ms: float | None
    mean_batch: float | None
    round: RoundReport | None = attrs.field(default=None, eq=False, repr=False)

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self, filter=lambda a, _v: a.name != "round")


def round_step_ms(report: RoundReport) -> float | None:
    """The step time at the round's batch: the mean step, in process or the server's.  The
    mean, because it is exact (a sum over a count); the in-process median is read from log
    buckets about 4 ms wide at 77 ms, which moved the deadline by up to 2 ms either way."""
    measured = report.measured
    if isinstance(measured, InProcessFigures):
        return measured.step_ms.mean if measured.step_ms.count else None
    return measured.server_step_ms_mean


def judge(report: RoundReport, frame_ms: float) -> Verdict:
    """Apply the criterion to one paced round that kept its per-frame lags."""
    step_ms = round_step_ms(report)
    deadline = frame_ms + (step_ms or 0.0) + SLACK_MS
    lags = report.lag_samples[1] if report.lag_samples is not None else None
    share = p50 = p99 = p999 = None
    if lags is not None and len(lags):
        share = float(np.count_nonzero(lags <= deadline)) / len(lags)
        p50, p99, p999 = (float(v) for v in np.percentile(lags, [50, 99, 99.9]))
    duration = report.elapsed_s or 1.0
    rtf_allowed = 1.0 + deadline / 1e3 / duration
    reasons = []
    if not report.ok:
        reasons.append(f"guards failed ({report.failures[0]})")
    if share is None:
        reasons.append("no frame lags measured")
    elif share < ON_TIME_SHARE:
        reasons.append(f"{100 * share:.2f} % of frames on time (< {100 * ON_TIME_SHARE:g} %)")
    if report.stream_rtf is None or not math.isfinite(report.stream_rtf):
        reasons.append("no real-time factor measured")
    elif report.stream_rtf > rtf_allowed:
        reasons.append(f"stream real-time factor {report.stream_rtf:.4f} > {rtf_allowed:.4f} "
                       "(1.0, plus the lag deadline over the round)")
    return Verdict(sessions=report.sessions, holds=not reasons, reason="; ".join(reasons),
                   on_time_share=share, deadline_ms=deadline, step_ms=step_ms, stream_rtf=report.stream_rtf,
                   lag_p50_ms=p50, lag_p99_ms=p99, lag_p999_ms=p999, mean_batch=report.mean_batch,
                   round=report)


def describe_verdict(verdict: Verdict, seconds: float) -> str:
    """One line for a paced round: whether it held in real time, why not, and the figures read;
    a round shorter than the criterion's ``MIN_SECONDS`` says it is indicative only."""
    figures = []
    if verdict.on_time_share is not None:
        figures.append(f"{100 * verdict.on_time_share:.2f} % of frames within {verdict.deadline_ms:.0f} ms")
    if verdict.stream_rtf is not None and math.isfinite(verdict.stream_rtf):
        figures.append(f"stream real-time factor {verdict.stream_rtf:.4f}")
    words = "holds" if verdict.holds else f"FAILS: {verdict.reason}"
    short = (f"; {seconds:.1f} s of audio, under the criterion's {MIN_SECONDS:g} s: indicative only"
             if seconds < MIN_SECONDS else "")
    return f"real time (docs/capacity.md): {words} ({', '.join(figures) or 'nothing measured'}){short}"


@attrs.frozen
class CapacitySearch:
    """What the bisection found."""

    #: The most sessions that held (0: not even one).
    sessions: int
    #: The fewest that failed (None: every count up to ``ceiling`` held).
    failed_at: int | None
    ceiling: int
    probes: list[Verdict]
    #: The runtime's own admission estimate (``/readyz``'s ``capacity``) after the last probe.
    estimate: dict | None = None

    @property
    def best(self) -> Verdict | None:
        """The probe at the found count."""
        held = [p for p in self.probes if p.holds and p.sessions == self.sessions]
        return held[-1] if held else None

    def as_dict(self) -> dict[str, object]:
        return {"sessions": self.sessions, "failed_at": self.failed_at, "ceiling": self.ceiling,
                "estimate": self.estimate, "probes": [p.as_dict() for p in self.probes]}


Probe = Callable[[int], Awaitable[Verdict]]


async def find_capacity(probe: Probe, ceiling: int, *, start: int | None = None,
                        on_probe: Callable[[Verdict], None] | None = None, retries: int = 0) -> CapacitySearch:
    """Bisect 1..``ceiling`` for the largest count whose probe holds, assuming that holding is
    monotone (fewer sessions never fail where more hold).  ``start`` (the runtime's estimate) is
    probed first; then each probe halves the bracket: about log2(ceiling) probes.

    A count that fails on time or real-time factor is probed again, up to ``retries`` times, and
    holds if any try holds: on a shared host, other processes taking the CPU can only make a
    round late, never make one past the edge keep time (past it, queues grow whatever the host
    does), so a failure may be the neighbours' while a hold is the model's.  A failed guard
    (wrong output, a refused connection) is not retried."""
    good, bad = 0, ceiling + 1
    probes: list[Verdict] = []
    guess = max(1, min(ceiling, start)) if start else (ceiling + 1) // 2
    while bad - good > 1:
        for _try in range(retries + 1):
            verdict = await probe(guess)
            probes.append(verdict)
            if on_probe is not None:
                on_probe(verdict)
            if verdict.holds or (verdict.round is not None and not verdict.round.ok):
                break
        if verdict.holds:
            good = guess
            # From the estimate, look just above it first: the edge is usually near.
            if len(probes) == 1 and start and guess < ceiling:
                guess = min(ceiling, guess + max(1, guess // 16))
                continue
        else:
            bad = guess
        guess = (good + bad) // 2
    return CapacitySearch(sessions=good, failed_at=bad if bad <= ceiling else None, ceiling=ceiling,
                          probes=probes, estimate=probes[-1].round.capacity if probes and probes[-1].round else None)


def format_search(search: CapacitySearch) -> str:
    lines = ["probes (sessions: verdict, on time, lag p50/p99/p99.9 ms, mean batch, step ms):"]
    for p in search.probes:
        figures = ", ".join([
            f"{100 * p.on_time_share:.2f} % on time" if p.on_time_share is not None else "-",
            "/".join(f"{v:.0f}" if v is not None else "-" for v in (p.lag_p50_ms, p.lag_p99_ms, p.lag_p999_ms)),
            f"batch {p.mean_batch:.1f}" if p.mean_batch else "batch -",
            f"step {p.step_ms:.1f}" if p.step_ms is not None else "step -",
        ])
        lines.append(f"  {p.sessions:5d}: {'holds' if p.holds else 'FAILS'}  {figures}"
                     + (f"  ({p.reason})" if p.reason else ""))
    best = search.best
    if search.sessions == 0:
        lines.append("capacity: not even one session holds in real time")
    else:
        edge = f"(fails at {search.failed_at})" if search.failed_at else f"(every count up to {search.ceiling} held)"
        lines.append(f"capacity: {search.sessions} sessions {edge}")
        if best is not None and best.lag_p50_ms is not None:
            lines.append(f"  at {search.sessions}: frame lag p50 {best.lag_p50_ms:.0f} ms, p99 {best.lag_p99_ms:.0f} ms, "
                         f"p99.9 {best.lag_p999_ms:.0f} ms; deadline {best.deadline_ms:.0f} ms")
    estimate = search.estimate
    if estimate:
        limit = estimate.get("limit")
        delta = "" if not isinstance(limit, int) or not search.sessions else f" ({limit - search.sessions:+d})"
        lines.append(f"runtime admission estimate: {limit}{delta}; fitted step cost "
                     f"{estimate.get('base_ms', 0):.2f} + {estimate.get('per_session_ms', 0):.3f}·n ms "
                     f"(source: {estimate.get('source')})")
    return "\n".join(lines)
