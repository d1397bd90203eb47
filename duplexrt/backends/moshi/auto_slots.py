"""``runtime.slots = "auto"``: the largest batch whose measured step leaves the margin.

A fixed batch costs the whole batch every step, whatever the rows active, so a batch whose step
is over the frame period keeps no session in real time, and one far under it wastes the GPU.  The
right size is the largest that fits the device's memory (``memory.slots_that_fit``) whose full
batch steps within the budget (the frame period less ``runtime.capacity_margin``).  Step time
grows about linearly with the rows (each row's K/V ring is read every step), so a few timed sizes
find it: one small size, a guess from it, then guesses from a line through what was measured,
each kept strictly between the largest size known to fit and the smallest known not to.

``search`` only decides which sizes to time; ``time_at(n)`` (the backend: allocate ``n`` rows,
warm up with CUDA graphs and torch.compile as served, time the steady steps) does the measuring.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import numpy as np

#: The first size timed (or the memory limit, if smaller).
START = 8
#: Sizes timed at most.  Each costs an allocation and a warm-up (graph capture) at load.
MAX_PROBES = 6


@attrs.frozen
class SearchResult:
    #: The largest size timed within the budget (1 when not even that was).
    slots: int
    #: ``(rows, step ms)`` of every size timed, in the order timed.
    timings: tuple[tuple[int, float], ...]
    #: The smallest size timed over the budget, if any.
    over: int | None
    within_budget: bool


def _next_size(timed: dict[int, float], budget_ms: float, good: int, bad: int) -> int:
    sizes = np.array(sorted(timed), dtype=np.float64)
    times = np.array([timed[int(n)] for n in sizes])
    if len(sizes) >= 2:
        slope, base = np.polyfit(sizes, times, 1)
        guess = (budget_ms - base) / slope if slope > 0 else float(bad - 1)
    else:  # one point: as if the step cost only the rows (an underestimate where it has a base)
        (n,), (ms,) = sizes, times
        guess = n * budget_ms / ms if ms > 0 else float(bad - 1)
        if ms <= budget_ms:
            guess = max(guess, 2 * n)
    return int(min(max(int(guess), good + 1), bad - 1))


def search(time_at: Callable[[int], float], limit: int, budget_ms: float, *, start: int = START,
           max_probes: int = MAX_PROBES) -> SearchResult:
    """The largest ``n <= limit`` with ``time_at(n) <= budget_ms``, as far as ``max_probes``
    timings can tell (``limit >= 1``)."""
    if limit < 1:
        raise ValueError("no size to search: the limit is below one row")
    timed: dict[int, float] = {}
    order: list[tuple[int, float]] = []
    good, bad = 0, limit + 1
    size = min(start, limit)
    while len(order) < max_probes:
        ms = time_at(size)
        timed[size] = ms
        order.append((size, ms))
        if ms <= budget_ms:
            good = max(good, size)
        else:
            bad = min(bad, size)
        if good + 1 >= bad:
            break
        size = _next_size(timed, budget_ms, good, bad)
    return SearchResult(slots=max(good, 1), timings=tuple(order), over=bad if bad <= limit else None,
                        within_budget=good >= 1)
