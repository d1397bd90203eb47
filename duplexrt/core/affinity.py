"""Keeping the runtime's two GIL-bound threads on one CPU (``runtime.pin_host_threads``).

The trio thread and the scheduler thread take turns on the GIL; they never run Python at the same
time.  On two cores every handoff of the GIL wakes a thread on the other core, which costs far
more than the handoff itself.  Pinning only these two threads keeps handoffs on one core; the
model's own worker threads (a torch thread pool on CPU) are created before the scheduler thread
pins itself, so they keep every core.
"""

from __future__ import annotations

import os


def chosen_cpu() -> int | None:
    """The CPU to share: the lowest this process may use; None where affinity is not supported."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        return None
    return min(getter(0))


def pin_this_thread(cpu: int | None) -> set[int] | None:
    """Pin the calling thread to ``cpu``; returns its previous CPU set, for ``restore``."""
    if cpu is None:
        return None
    previous = set(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return previous


def restore(previous: set[int] | None) -> None:
    if previous is not None:
        os.sched_setaffinity(0, previous)
