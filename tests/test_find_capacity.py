"""``simulate --find-capacity``: the real-time criterion and the bisection, on scripted curves."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

from duplexrt.core.histogram import Summary
from duplexrt.simulate.find_capacity import Verdict, find_capacity, format_search, judge
from duplexrt.simulate.report import InProcessFigures, RoundReport

FRAME_MS = 80.0


def _round(sessions: int, lags_ms: np.ndarray, *, step_ms: float = 30.0, stream_rtf: float = 1.0,
           failures: tuple[str, ...] = ()) -> RoundReport:
    """A paced round as the runner reports it, with scripted per-frame lags."""
    nothing = Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    measured = InProcessFigures(
        cpu_us_per_frame=30.0, voluntary_switches=0, involuntary_switches=0, voluntary_switches_per_frame=0.0,
        involuntary_switches_per_frame=0.0, executor_submissions=0, preprocess_us=nothing, enqueue_us=nothing,
        latency_ms=nothing, delivery_ms=nothing, step_to_sent_ms=nothing,
        step_ms=Summary(10, step_ms, step_ms, step_ms, step_ms, step_ms))
    return RoundReport(mode="paced", sessions=sessions, elapsed_s=30.0, frames_in=len(lags_ms),
                       frames_out=len(lags_ms), handoffs={}, steps=10, mean_batch=float(sessions),
                       failures=list(failures), measured=measured,
                       lag_samples=(np.arange(len(lags_ms)) * 0.08, lags_ms), stream_rtf=stream_rtf,
                       capacity={"limit": 36, "base_ms": 28.0, "per_session_ms": 1.3, "source": "steps"})


def test_the_criterion_allows_one_frame_plus_the_step_plus_10_ms_for_99_9_percent_of_frames():
    deadline = FRAME_MS + 30.0 + 10.0
    lags = np.full(10_000, 100.0)
    lags[:10] = deadline + 1  # 0.1 % late: still holds
    verdict = judge(_round(20, lags), FRAME_MS)
    assert verdict.holds and verdict.deadline_ms == deadline and verdict.on_time_share == 0.999
    lags[10] = deadline + 1  # one more: 0.11 % late
    verdict = judge(_round(20, lags), FRAME_MS)
    assert not verdict.holds and "on time" in verdict.reason


def test_the_step_time_in_the_deadline_is_the_exact_mean_not_a_histogram_bucket():
    # The in-process median comes from log buckets about 4 ms wide at 77 ms: its midpoint moved
    # the deadline by up to 2 ms either way.  The mean is exact (sum / count), as the server's is.
    plain = _round(38, np.full(1000, 100.0))
    bucketed = attrs.evolve(plain.measured, step_ms=Summary(500, 77.0, 74.4, 80.7, 82.0, 60.0))
    report = attrs.evolve(plain, measured=bucketed)
    assert judge(report, FRAME_MS).deadline_ms == FRAME_MS + 77.0 + 10.0


def test_the_criterion_fails_a_round_that_drifts_or_fails_its_guards():
    lags = np.full(1000, 100.0)
    drifting = judge(_round(20, lags, stream_rtf=1.02), FRAME_MS)
    assert not drifting.holds and "real-time factor" in drifting.reason
    refused = judge(_round(20, lags, failures=("connection errors: 3 http_503",)), FRAME_MS)
    assert not refused.holds and "guards failed" in refused.reason


def _scripted(edge: int, asked: list[int]):
    """A probe on a curve whose known answer is ``edge``: lags jump past the deadline above it."""

    async def probe(sessions: int) -> Verdict:
        asked.append(sessions)
        lag = 100.0 if sessions <= edge else 400.0
        return judge(_round(sessions, np.full(500, lag)), FRAME_MS)

    return probe


@pytest.mark.parametrize("edge, ceiling, start", [(38, 128, None), (38, 128, 36), (38, 128, 40), (1, 64, None),
                                                  (64, 64, None), (0, 16, None), (127, 128, 36)])
async def test_bisection_finds_the_known_edge_in_few_probes(edge, ceiling, start):
    asked: list[int] = []
    search = await find_capacity(_scripted(edge, asked), ceiling, start=start)
    assert search.sessions == edge
    assert search.failed_at == (edge + 1 if edge < ceiling else None)
    assert len(asked) <= ceiling.bit_length() + 2 and len(set(asked)) == len(asked)
    text = format_search(search)
    assert (f"capacity: {edge} sessions" in text) if edge else ("not even one" in text)


async def test_a_failure_is_retried_and_a_count_holds_if_any_try_holds():
    # A count at or under the edge fails its first try (a neighbour took the CPU), then holds.
    asked: list[int] = []

    async def probe(sessions: int) -> Verdict:
        asked.append(sessions)
        disturbed = sessions <= 38 and asked.count(sessions) == 1
        lag = 400.0 if sessions > 38 or disturbed else 100.0
        return judge(_round(sessions, np.full(500, lag)), FRAME_MS)

    assert (await find_capacity(probe, 48, start=36)).sessions < 38  # no retry: the noise decides
    asked.clear()
    search = await find_capacity(probe, 48, start=36, retries=1)
    assert search.sessions == 38 and search.failed_at == 39
    assert asked.count(39) == 2  # past the edge: fails every try
    assert len(search.probes) == len(asked)


async def test_a_failed_guard_is_not_retried():
    asked: list[int] = []

    async def probe(sessions: int) -> Verdict:
        asked.append(sessions)
        failures = ("session 1: refused: at_capacity",) if sessions > 36 else ()
        return judge(_round(sessions, np.full(500, 100.0), failures=failures), FRAME_MS)

    search = await find_capacity(probe, 48, start=36, retries=2)
    assert search.sessions == 36 and len(asked) == len(set(asked))


async def test_the_report_compares_the_runtime_estimate_with_the_found_edge():
    search = await find_capacity(_scripted(38, []), 128, start=36)
    assert search.estimate["limit"] == 36
    text = format_search(search)
    assert "runtime admission estimate: 36 (-2)" in text and "at 38: frame lag p50 100 ms" in text
    assert attrs.asdict(search.best, filter=lambda a, _v: a.name != "round")["sessions"] == 38
