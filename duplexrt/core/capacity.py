"""How many sessions the model can step within one frame period: admission by cost, not by slots.

Slots are the model's batch rows; they say nothing about time.  One session past what the model
can step in a frame period and every call on the process falls behind at once, so the runtime
learns the step time as a function of the batch size and admits only as many sessions as fit.

The scheduler thread records each step's (rows, duration) into fixed per-batch-size arrays (a few
scalar writes per step, no allocation) and, every ``refit_every`` steps (for steps far cheaper
than a refit, once ``REFIT_AFTER_MS`` of them is recorded), fits a line
``cost(n) = base + per_session * n`` by weighted least squares over the batch sizes seen, seeded by
what the backend measured at load (``Backend.warmup_costs``).  The result is one immutable
``CapacityEstimate`` swapped in whole: the trio thread's admission check reads an attribute, with
no lock on either side.

A model whose step costs the whole batch whatever the rows (Moshi's fixed batch) fits a flat line:
every slot fits, or one does.  A model that steps a bucket of rows covering its sessions (Moshi's
default) records each step under the rows it paid for, and a session count is priced at the
bucket that would carry it (``Backend.paid_rows``): the line runs through the buckets' costs, and
admission never counts on the rows between two buckets being cheaper than the larger one.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable

import attrs
import numpy as np

#: A batch size's mean step time follows its recent steps: an exponential average past this many.
_WINDOW = 16
#: One batch size weighs at most this much in the fit, so the steady-state size (seen every step)
#: does not drown the few others that pin the slope.
_MAX_WEIGHT = 32.0


@attrs.frozen
class CapacityEstimate:
    """What admission reads: one immutable snapshot."""

    #: Sessions the fitted cost allows within the budget (1 .. slots); ``slots`` before anything
    #: is known.
    sessions: int
    #: What admission enforces: ``runtime.max_sessions`` when the operator pinned it, else
    #: ``sessions``.  Never above the slots.
    limit: int
    slots: int
    #: The fitted step cost, milliseconds: ``base_ms + per_session_ms * n``.
    base_ms: float
    per_session_ms: float
    #: One frame period less ``runtime.capacity_margin``.
    budget_ms: float
    frame_ms: float
    #: Steps (and warm-up points) the fit rests on, and how many distinct batch sizes.
    samples: int
    batch_sizes: int
    #: ``none`` (nothing measured yet), ``warm-up``, ``steps`` or ``pinned`` (max_sessions).
    source: str

    def cost_ms(self, sessions: int) -> float:
        return self.base_ms + self.per_session_ms * sessions

    def as_dict(self) -> dict[str, object]:
        return attrs.asdict(self)


def sessions_within(base: float, per_session: float, budget: float, slots: int,
                    paid_rows: Callable[[int], int] | None = None) -> int:
    """The largest n in 1..slots with ``base + per_session * paid_rows(n) <= budget`` (at least 1:
    a model too slow for one session in real time still serves one, and says so in its
    estimate).  ``paid_rows``: the rows a step of n sessions pays for (None: n)."""
    if per_session <= 0:
        return slots if base <= budget else 1
    if paid_rows is not None:
        fits = [n for n in range(1, slots + 1) if base + per_session * paid_rows(n) <= budget + 1e-9]
        return max(fits, default=1)
    n = math.floor((budget - base) / per_session + 1e-9)
    return max(1, min(slots, n))


def fit_line(sizes: np.ndarray, means: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    """Weighted least squares ``(base, per_session)``, both kept non-negative.

    One batch size alone cannot separate the two: its whole cost is taken as per-session, which
    over-estimates larger batches (refusing early rather than admitting past the edge) until a
    second size is seen."""
    if len(sizes) == 1:
        return 0.0, float(means[0]) / float(sizes[0])
    w = weights
    sw = w.sum()
    mx = (w * sizes).sum() / sw
    my = (w * means).sum() / sw
    var = (w * (sizes - mx) ** 2).sum()
    slope = (w * (sizes - mx) * (means - my)).sum() / var
    if slope < 0:  # noise on a flat curve: flat
        return float(my), 0.0
    base = my - slope * mx
    if base < 0:  # through the origin instead
        return 0.0, float((w * sizes * means).sum() / (w * sizes * sizes).sum())
    return float(base), float(slope)


#: After its first fit from steps, the estimator refits only once this much step time has been
#: recorded since the last fit, as well as ``refit_every`` steps.  A refit costs the scheduler
#: thread many times what a cheap model's step does (echo), so refitting every 16 such steps spent
#: a visible share of the server's CPU on an estimate that admits every slot anyway (the scheduler
#: thread's share of the server's CPU is a column of ``benchmarks/server.py``).  Here a refit is
#: small beside the step time it sums up; a step of 1.25 ms or more (20 ms over 16 steps: every
#: GPU model) refits every ``refit_every`` steps as before.
REFIT_AFTER_MS = 20.0


class CapacityEstimator:
    """Learns step cost by batch size on the scheduler thread; publishes ``estimate``."""

    def __init__(self, slots: int, frame_seconds: float, margin: float, max_sessions: int = 0,
                 refit_every: int = 16, paid_rows: Callable[[int], int] | None = None) -> None:
        self.slots = slots
        #: The rows a step of n sessions pays for (``Backend.paid_rows``); None: n.
        self.paid_rows = paid_rows
        self.frame_ms = frame_seconds * 1e3
        self.budget_ms = self.frame_ms * (1.0 - margin)
        self.max_sessions = min(max_sessions, slots) if max_sessions else 0
        self.refit_every = refit_every
        # Index = rows in the step.  Plain Python lists: a scalar write to a list is cheaper than
        # one to a numpy array, and the scheduler thread does two per step.
        self._mean = [0.0] * (slots + 1)
        self._count = [0] * (slots + 1)
        #: The batch sizes seen so far, ascending: a refit reads these, not every possible size.
        self._sizes: list[int] = []
        self._since_fit = 0
        self._ms_since_fit = 0.0
        self._fitted_from_steps = False
        self._steps = 0
        self.estimate = self._publish(None, 0)

    # -- scheduler thread ------------------------------------------------------------------------

    def seed(self, points: Iterable[tuple[int, float]]) -> None:
        """Costs measured before any session (the backend's warm-up): ``(rows, seconds)``."""
        seeded = False
        for rows, seconds in points:
            if 1 <= rows <= self.slots and seconds >= 0:
                self._add(rows, seconds * 1e3)
                seeded = True
        if seeded:
            self.refit("warm-up")

    def record(self, rows: int, duration_ns: int) -> None:
        """One step's rows and duration.  Cheap: two list writes; a refit every few steps (the
        first after ``refit_every``, later ones once ``REFIT_AFTER_MS`` of steps came too)."""
        ms = duration_ns / 1e6
        self._add(rows, ms)
        self._steps += 1
        self._since_fit += 1
        self._ms_since_fit += ms
        if self._since_fit >= self.refit_every and (self._ms_since_fit >= REFIT_AFTER_MS
                                                    or not self._fitted_from_steps):
            self._fitted_from_steps = True
            self.refit("steps")

    def _add(self, rows: int, ms: float) -> None:
        count = self._count[rows] + 1
        self._count[rows] = count
        if count == 1:
            bisect.insort(self._sizes, rows)
        self._mean[rows] += (ms - self._mean[rows]) / min(count, _WINDOW)

    def refit(self, source: str = "steps") -> CapacityEstimate:
        self._since_fit = 0
        self._ms_since_fit = 0.0
        seen = self._sizes
        if not seen:
            return self.estimate
        counts = [self._count[size] for size in seen]
        sizes = np.array(seen, dtype=np.float64)
        means = np.array([self._mean[size] for size in seen], dtype=np.float64)
        weights = np.minimum(np.array(counts, dtype=np.float64), _MAX_WEIGHT)
        base, slope = fit_line(sizes, means, weights)
        self.estimate = self._publish((base, slope), sum(counts), len(seen), source)
        return self.estimate

    def _publish(self, line: tuple[float, float] | None, samples: int, sizes: int = 0,
                 source: str = "none") -> CapacityEstimate:
        if line is None:
            base = slope = 0.0
            sessions = self.slots
        else:
            base, slope = line
            sessions = sessions_within(base, slope, self.budget_ms, self.slots, self.paid_rows)
        limit = self.max_sessions or sessions
        return CapacityEstimate(
            sessions=sessions, limit=limit, slots=self.slots, base_ms=base, per_session_ms=slope,
            budget_ms=self.budget_ms, frame_ms=self.frame_ms, samples=samples, batch_sizes=sizes,
            source="pinned" if self.max_sessions else source,
        )
