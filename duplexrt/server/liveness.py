"""``GET /healthz``: liveness, so it fails when the process cannot serve and a restart would help.

A process that answers HTTP is not necessarily alive as a server: after a sticky CUDA error every
model step fails, ``/readyz`` answers 503 ``model_failing`` (the balancer steers new calls away),
and nothing ever clears it but a restart.  So ``/healthz`` is 200 while the process answers, except
when the model has been failing (``runtime.max_consecutive_step_failures`` failed steps in a row,
and no step since that worked) for ``FAILING_S`` seconds or more, seen across the checks: then 503
with the reason, and Kubernetes' liveness probe (or Docker's health check) restarts the replica.
A short run of failures that a working step ends never reaches it.

The time is counted from the first check that found the model failing: a probe every 10 s
(the manifest's) fails within ``FAILING_S`` + 10 s of the failures.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: How long the model must have been failing every step before ``/healthz`` fails.
FAILING_S = 30.0

_TEXT = "text/plain; charset=utf-8"


class Liveness:
    """What ``/healthz`` answers, from whether the model is failing each time it is asked."""

    def __init__(self, failing_s: float = FAILING_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.failing_s = failing_s
        self._clock = clock
        #: When a check first found the model failing (None: it was not, at the last check).
        self._since: float | None = None

    def observe(self, failing: bool) -> float:
        """Record what a check found; returns for how long the model has been failing (0: not)."""
        if not failing:
            self._since = None
            return 0.0
        now = self._clock()
        if self._since is None:
            self._since = now
        return now - self._since

    def answer(self, failing: bool) -> tuple[int, bytes, str]:
        """``(status, body, content type)`` of ``/healthz``."""
        held = self.observe(failing)
        if failing and held >= self.failing_s:
            return 503, (f"model_failing: every model step has failed for {held:.0f} s "
                         f"(at least {self.failing_s:g} s): restart this replica\n").encode(), _TEXT
        return 200, b"ok\n", _TEXT
