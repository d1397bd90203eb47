"""Which CPUs a replica runs on, and keeping its two GIL-bound threads on one of them.

The trio thread and the scheduler thread take turns on the GIL; they never run Python at the same
time.  On two cores every handoff of the GIL wakes a thread on the other core, which costs far
more than the handoff itself.  Pinning only these two threads keeps handoffs on one core; the
model's own worker threads (a torch thread pool on CPU) are created before the scheduler thread
pins itself, so they keep every core the process has.

One box often runs one replica per GPU.  Each must get a CPU of its own, or every replica's two
host threads share one core (they all took the lowest CPU they could use, once).  So, in order:

1. ``runtime.cpus``: the process keeps to those CPUs (threads started from then on inherit them),
   and its host threads share the first.  What an operator gives to put each replica on the CPUs
   near its GPU (``nvidia-smi topo -m``), and on Kubernetes without the static CPU manager, where
   every pod may use every CPU and sees its own GPU as ``cuda:0``.
2. A GPU model: the CPU at the GPU's position among the CPUs this process may use, by the GPU's
   index on the box (``cuda:N``, through ``CUDA_VISIBLE_DEVICES`` when that lists indices): GPU 0
   on the first, GPU 1 on the second...
3. Otherwise the lowest CPU this process may use.

Every CPU chosen is one ``os.sched_getaffinity(0)`` allows: a container's or a cgroup's limits hold.
"""

from __future__ import annotations

import logging
import os

import attrs

from duplexrt.config import ConfigError

log = logging.getLogger("duplexrt.affinity")


@attrs.frozen
class CpuPlan:
    """Where this replica runs."""

    #: The CPUs the process keeps to (None: every one it may use, as it started).
    process: frozenset[int] | None
    #: The CPU the trio and scheduler threads share (None: no affinity support here).
    host: int | None
    #: Why, for the log.
    reason: str


def gpu_ordinal(device: str, visible: str | None) -> int | None:
    """The index on the box of the GPU ``device`` names (None for a CPU device): ``cuda:N`` is
    the Nth of ``CUDA_VISIBLE_DEVICES`` when that lists indices, else N."""
    name, _, index = device.partition(":")
    if name != "cuda":
        return None
    ordinal = int(index) if index.isdigit() else 0
    entries = [entry.strip() for entry in (visible or "").split(",") if entry.strip()]
    if ordinal < len(entries) and entries[ordinal].isdigit():
        return int(entries[ordinal])
    return ordinal


def plan_cpus(configured: tuple[int, ...], device: str, allowed: set[int] | None,
              visible: str | None = None) -> CpuPlan:
    """The CPUs for a replica given ``runtime.cpus``, its model's device and the CPUs the
    process may use (None where the platform has no affinity)."""
    if allowed is None:
        if configured:
            raise ConfigError("runtime.cpus needs CPU affinity, which this platform does not offer")
        return CpuPlan(None, None, "no CPU affinity on this platform")
    ordered = sorted(allowed)
    if configured:
        outside = [cpu for cpu in configured if cpu not in allowed]
        if outside:
            raise ConfigError(f"runtime.cpus {list(configured)}: CPU(s) {outside} are not among those this "
                              f"process may use ({_ranges(ordered)})")
        return CpuPlan(frozenset(configured), configured[0], f"runtime.cpus = {list(configured)}")
    gpu = gpu_ordinal(device, visible)
    if gpu is not None:
        cpu = ordered[gpu % len(ordered)]
        return CpuPlan(None, cpu, f"GPU {gpu} of this box: CPU {cpu}, of {_ranges(ordered)}")
    return CpuPlan(None, ordered[0], f"the lowest CPU this process may use, of {_ranges(ordered)}")


def plan_for(configured: tuple[int, ...], device: str) -> CpuPlan:
    """``plan_cpus`` for this process, now."""
    getter = getattr(os, "sched_getaffinity", None)
    allowed = set(getter(0)) if getter is not None else None
    return plan_cpus(configured, device, allowed, os.environ.get("CUDA_VISIBLE_DEVICES"))


def _ranges(cpus: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2,5``."""
    parts: list[str] = []
    i = 0
    while i < len(cpus):
        j = i
        while j + 1 < len(cpus) and cpus[j + 1] == cpus[j] + 1:
            j += 1
        parts.append(str(cpus[i]) if i == j else f"{cpus[i]}-{cpus[j]}")
        i = j + 1
    return ",".join(parts) or "none"


def confine(cpus: frozenset[int] | None) -> set[int] | None:
    """Keep the process to ``cpus``: every thread it has (on Linux, read from /proc: numpy's
    BLAS starts its pool at import) and, by inheritance, every thread started from now on.
    Returns the calling thread's previous CPU set, for ``restore``."""
    if cpus is None:
        return None
    previous = set(os.sched_getaffinity(0))
    try:
        threads = [int(tid) for tid in os.listdir("/proc/self/task")]
    except OSError:
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:  # ended since it was listed
            pass
    os.sched_setaffinity(0, cpus)
    return previous


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
