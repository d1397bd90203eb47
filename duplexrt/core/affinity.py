"""Which CPUs a replica runs on, and keeping its two GIL-bound threads on one of them.

The trio thread and the scheduler thread take turns on the GIL; they never run Python at the same
time.  On two cores every handoff of the GIL wakes a thread on the other core, which costs far
more than the handoff itself.  Pinning only these two threads keeps handoffs on one core; the
model's own worker threads (a torch thread pool on CPU) are created before the scheduler thread
pins itself, so they keep every core the process has.

Pinning must never put two replicas' host threads on one core: that costs far more than not
pinning (a Kubernetes node's pods, each seeing its GPU as ``cuda:0`` and every CPU of the shared
pool, once all took the pool's lowest CPU: up to 16 busy threads on one core).  So, in order:

1. ``runtime.cpus``: the process keeps to those CPUs (threads started from then on inherit them),
   and its host threads share the first.  What an operator gives to put each replica on the CPUs
   near its GPU (``nvidia-smi topo -m``).
2. ``runtime.pin_host_threads = "auto"`` (the default) pins only on CPUs this process has to
   itself: a set of CPUs *given* to it, narrower than the box's online CPUs (``taskset``, a
   cpuset, ``docker run --cpuset-cpus``; in a Kubernetes Pod only a Guaranteed one with whole CPUs
   under the static CPU manager, whose CPU quota equals its set: a Burstable Pod's set is the
   node's shared pool).  Within that set the CPU at the GPU's position (by its index on the box,
   ``cuda:N`` through ``CUDA_VISIBLE_DEVICES`` when that lists indices) is taken, or the next one
   no other replica that can see this one has claimed (``claim_cpu``: processes in one container
   or on one host network see each other's claims).  A process that may use every CPU of the box
   shares them with whatever else runs there, and is not pinned: the log says so, and how to pin.
3. ``runtime.pin_host_threads = true``: pinned whatever the set, at the GPU's position or the
   lowest CPU allowed (for a replica alone on its box).

Every CPU chosen is one ``os.sched_getaffinity(0)`` allows: a container's or a cgroup's limits hold.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import attrs

from duplexrt.config import ConfigError

log = logging.getLogger("duplexrt.affinity")


@attrs.frozen
class CpuPlan:
    """Where this replica runs."""

    #: The CPUs the process keeps to (None: every one it may use, as it started).
    process: frozenset[int] | None
    #: The CPU the trio and scheduler threads share (None: not pinned).
    host: int | None
    #: Why, for the log.
    reason: str
    #: What holds ``host`` against the other replicas that can see this one (``claim_cpu``), for
    #: the life of the plan; None where nothing was claimed.
    claim: Any = attrs.field(default=None, eq=False, repr=False)

    def release(self) -> None:
        """Let the claimed CPU go (it goes anyway when the process ends)."""
        if self.claim is not None:
            self.claim.close()


@attrs.frozen
class Box:
    """What this process is placed on, as far as pinning cares."""

    #: The box's online CPUs (None: unknown).
    online: frozenset[int] | None
    #: The CPU quota of this process's cgroup, in CPUs (None: none, or unknown).
    quota_cpus: float | None = None
    #: Whether this runs in a Kubernetes Pod (``KUBERNETES_SERVICE_HOST`` is set in every one).
    kubernetes: bool = False


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


def exclusive(allowed: set[int], box: Box | None) -> tuple[bool, str]:
    """Whether ``allowed`` is a set of CPUs given to this process (not a share of the whole box
    or of a Kubernetes node's shared pool), and why."""
    mine = _ranges(sorted(allowed))
    if box is None or box.online is None:
        return False, f"the box's online CPUs are unknown, so CPUs {mine} may be shared"
    if not allowed < box.online:
        return False, f"this process may use every CPU of the box ({mine}), shared with whatever else runs on it"
    if box.kubernetes:
        if box.quota_cpus is not None and abs(box.quota_cpus - len(allowed)) < 0.01:
            return True, (f"CPUs {mine}, a Kubernetes container's own (whole CPUs under the static CPU "
                          "manager: its quota is its set)")
        quota = "no CPU limit" if box.quota_cpus is None else f"a quota of {box.quota_cpus:g} CPUs"
        return False, (f"CPUs {mine} are a Kubernetes node's shared pool ({quota}; a Guaranteed Pod with whole "
                       "CPUs under the static CPU manager gets CPUs of its own)")
    return True, f"CPUs {mine} given to this process, of the box's {_ranges(sorted(box.online))}"


def claim_cpu(cpu: int) -> socket.socket | None:
    """Claim ``cpu`` for this replica's host threads against every other replica that can see
    this one (an abstract Unix socket: one network namespace, so one container or one host's
    processes); None when another holds it.  Released when the socket closes or the process ends."""
    holder = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        holder.bind(f"\0duplexrt-host-cpu-{cpu}")
    except OSError:
        holder.close()
        return None
    return holder


def plan_cpus(configured: tuple[int, ...], device: str, allowed: set[int] | None,
              visible: str | None = None, *, pin: bool | str = True, box: Box | None = None,
              claim: Any = claim_cpu) -> CpuPlan:
    """The CPUs for a replica given ``runtime.cpus``, its model's device, the CPUs the process may
    use (None where the platform has no affinity) and ``runtime.pin_host_threads`` (``pin``:
    true, false or ``"auto"``, which also needs the ``box``)."""
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
    if pin is False:
        return CpuPlan(None, None, "runtime.pin_host_threads = false")
    gpu = gpu_ordinal(device, visible)
    first = gpu % len(ordered) if gpu is not None else 0
    where = f"GPU {gpu} of this box" if gpu is not None else "the lowest CPU this process may use"
    if pin != "auto":
        cpu = ordered[first]
        return CpuPlan(None, cpu, f"{where}: CPU {cpu}, of {_ranges(ordered)}")
    given, why = exclusive(allowed, box)
    if not given:
        return CpuPlan(None, None, f"host threads not pinned: {why}; set runtime.cpus to pin them (or "
                                   "runtime.pin_host_threads = true for a replica alone on its box)")
    for cpu in ordered[first:] + ordered[:first]:  # the GPU's own CPU first, then the next free one
        holder = claim(cpu)
        if holder is not None:
            taken = "" if cpu == ordered[first] else f" (CPU {ordered[first]} is another replica's)"
            return CpuPlan(None, cpu, f"{why}: {where}, CPU {cpu}{taken}", holder)
    return CpuPlan(None, None, f"host threads not pinned: {why}, and every one of them is another replica's; "
                               "set runtime.cpus to place each replica")


def online_cpus() -> frozenset[int] | None:
    """The box's online CPUs (``/sys/devices/system/cpu/online``; else ``os.cpu_count()``)."""
    try:
        with open("/sys/devices/system/cpu/online") as handle:
            return frozenset(parse_ranges(handle.read()))
    except (OSError, ValueError):
        count = os.cpu_count()
        return frozenset(range(count)) if count else None


def parse_ranges(text: str) -> list[int]:
    """``"0-2,5"`` as ``[0, 1, 2, 5]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if part:
            low, _, high = part.partition("-")
            cpus.extend(range(int(low), int(high or low) + 1))
    return cpus


def cpu_quota(root: str = "/sys/fs/cgroup") -> float | None:
    """This process's cgroup CPU quota in CPUs (cgroup v2 ``cpu.max``, else v1's CFS quota), or
    None where there is none or it cannot be read."""
    candidates = [f"{root}/cpu.max"]
    try:
        with open("/proc/self/cgroup") as handle:
            for line in handle:
                if line.startswith("0::"):
                    candidates.append(f"{root}{line.split('::', 1)[1].strip().rstrip('/')}/cpu.max")
    except OSError:
        pass
    for path in candidates:
        try:
            with open(path) as handle:
                quota, _, period = handle.read().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period or 100000)
        except (OSError, ValueError):
            continue
    for folder in (f"{root}/cpu", f"{root}/cpu,cpuacct"):
        try:
            with open(f"{folder}/cpu.cfs_quota_us") as handle:
                quota_us = int(handle.read())
            with open(f"{folder}/cpu.cfs_period_us") as handle:
                period_us = int(handle.read())
        except (OSError, ValueError):
            continue
        return None if quota_us < 0 else quota_us / period_us
    return None


def this_box() -> Box:
    return Box(online_cpus(), cpu_quota(), kubernetes="KUBERNETES_SERVICE_HOST" in os.environ)


def plan_for(configured: tuple[int, ...], device: str, pin: bool | str = True) -> CpuPlan:
    """``plan_cpus`` for this process, now."""
    getter = getattr(os, "sched_getaffinity", None)
    allowed = set(getter(0)) if getter is not None else None
    box = this_box() if pin == "auto" and not configured else None
    return plan_cpus(configured, device, allowed, os.environ.get("CUDA_VISIBLE_DEVICES"), pin=pin, box=box)


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
