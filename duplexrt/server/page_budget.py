"""A budget of the trio thread for the pages rendered per request: ``/stats`` and ``/readyz``.

Each of them reads the whole server record and renders JSON, about a millisecond of the thread
every session runs on, and anyone may ask for them (a balancer checks ``/readyz`` twice a second,
a dashboard polls ``/stats``).  A client asking in a loop would take as much of the thread as it
asks for.  So, as ``/metrics`` does (``duplexrt.server.metrics.MetricsPage``), renders spend a
credit of thread time that fills at ``share`` of the clock (1 %: 10 ms a second), up to
``burst_s``: with credit left a request gets a fresh page; without it, the last page of that kind
again, unless that one is older than its ``max_age_s``.  So these pages cost at most ``share`` of
the thread plus one render per kind per ``max_age_s``, and a page is never older than that.

The pages are kept by a key that holds whatever must never be stale: ``/readyz`` keys on whether
the server drains, so a balancer sees a drain at once whatever the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

__all__ = ["PageBudget"]

T = TypeVar("T")


class PageBudget(Generic[T]):
    """Pages rendered within a share of the thread (see the module docstring)."""

    def __init__(self, *, share: float = 0.01, burst_s: float = 0.01,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._share = share
        self._burst_s = burst_s
        self._clock = clock
        self._credit = burst_s
        self._filled_at = clock()
        self._pages: dict[Hashable, tuple[float, T]] = {}
        #: Pages rendered; the other requests got a page rendered before.
        self.renders = 0

    def page(self, key: Hashable, render: Callable[[], T], max_age_s: float) -> T:
        """The page of ``key``: ``render()`` while the budget allows or the last one is older
        than ``max_age_s``, else the last one again."""
        now = self._clock()
        self._credit = min(self._burst_s, self._credit + (now - self._filled_at) * self._share)
        self._filled_at = now
        last = self._pages.get(key)
        if last is not None and self._credit <= 0 and now - last[0] < max_age_s:
            return last[1]
        started = time.perf_counter()
        page = render()
        self._credit -= time.perf_counter() - started
        self._pages[key] = (now, page)
        self.renders += 1
        return page
