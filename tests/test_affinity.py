"""Each replica on a box gets its own CPU for its two host threads (``core/affinity.py``): from
``runtime.cpus``, else from its GPU's index, always among the CPUs the process may use.  Two
real ``duplexrt serve`` processes are checked from outside, through /proc, as an operator would."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from duplexrt.config import ConfigError, load_config
from duplexrt.core.affinity import gpu_ordinal, plan_cpus
from tests.conftest import ServeProcess


def test_each_gpu_of_a_box_gets_its_own_cpu_within_those_allowed():
    allowed = {4, 5, 6, 7, 12, 13}
    hosts = [plan_cpus((), f"cuda:{n}", allowed).host for n in range(6)]
    assert hosts == [4, 5, 6, 7, 12, 13]
    assert plan_cpus((), "cuda:7", allowed).host == 5  # more GPUs than CPUs: round the CPUs
    assert plan_cpus((), "cpu", allowed).host == 4 and plan_cpus((), "cpu", allowed).process is None


def test_cuda_visible_devices_maps_the_processes_cuda_n_to_the_boxs_gpu():
    assert gpu_ordinal("cuda:0", "3") == 3 and gpu_ordinal("cuda:1", "2,5") == 5
    assert gpu_ordinal("cuda", "6") == 6 and gpu_ordinal("cuda:0", None) == 0
    # Kubernetes names GPUs by UUID: no index to read, and every pod sees its GPU as cuda:0.
    assert gpu_ordinal("cuda:0", "GPU-5f1c0a2e-aaaa-bbbb-cccc-0123456789ab") == 0
    assert gpu_ordinal("cpu", "3") is None
    assert plan_cpus((), "cuda:0", {0, 1, 2, 3}, visible="2").host == 2


def test_explicit_cpus_confine_the_process_and_must_be_allowed():
    plan = plan_cpus((6, 7), "cuda:0", {4, 5, 6, 7})
    assert plan.process == {6, 7} and plan.host == 6
    with pytest.raises(ConfigError, match=r"CPU\(s\) \[9\] are not among those this process may use \(4-7\)"):
        plan_cpus((6, 9), "cpu", {4, 5, 6, 7})
    assert load_config(None, ['runtime.cpus="0-2,5"']).runtime.cpus == (0, 1, 2, 5)
    assert load_config(None, ["runtime.cpus=[3, 1]"]).runtime.cpus == (3, 1)
    with pytest.raises(ConfigError, match="runtime.cpus must"):
        load_config(None, ['runtime.cpus="a-b"'])
    with pytest.raises(ConfigError, match="distinct CPU numbers"):
        load_config(None, ["runtime.cpus=[1, 1]"])


def _cpus_of(pid: int) -> dict[int, set[int]]:
    """Each thread's allowed CPUs, by thread id, read from /proc as ``taskset -p`` would."""
    found: dict[int, set[int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        allowed = next(line.split(":", 1)[1].strip() for line in (task / "status").read_text().splitlines()
                       if line.startswith("Cpus_allowed_list"))
        cpus: set[int] = set()
        for part in allowed.split(","):
            low, _, high = part.partition("-")
            cpus.update(range(int(low), int(high or low) + 1))
        found[int(task.name)] = cpus
    return found


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may use")
def test_two_replicas_on_one_box_run_their_host_threads_on_different_cpus():
    first, second = sorted(os.sched_getaffinity(0))[:2]
    with ServeProcess("--set", f"runtime.cpus=[{first}]") as a, \
            ServeProcess("--set", f"runtime.cpus=[{second}]") as b:
        threads_a, threads_b = _cpus_of(a.proc.pid), _cpus_of(b.proc.pid)
    for threads, cpu in ((threads_a, first), (threads_b, second)):
        # The trio thread, the scheduler thread and whatever else the process runs: all on its CPU.
        assert len(threads) >= 2 and all(cpus == {cpu} for cpus in threads.values()), threads


def _claims(taken: set[int]):
    """FAKE ``claim_cpu``: the CPUs in ``taken`` are held by other replicas."""
    def claim(cpu: int):
        return None if cpu in taken else f"claim {cpu}"
    return claim


def test_auto_pins_only_on_cpus_given_to_this_process():
    from duplexrt.core.affinity import Box

    box = Box(frozenset(range(16)))
    # Every CPU of the box: shared with whatever else runs there, so not pinned, and the log says how to pin.
    shared = plan_cpus((), "cuda:0", set(range(16)), pin="auto", box=box, claim=_claims(set()))
    assert shared.host is None and shared.process is None
    assert "shared with whatever else runs on it" in shared.reason and "runtime.cpus" in shared.reason
    # A set given to it (taskset, a cpuset, docker --cpuset-cpus): pinned within it, the GPU's position first.
    given = plan_cpus((), "cuda:1", {4, 5, 6, 7}, pin="auto", box=box, claim=_claims(set()))
    assert given.host == 5 and "given to this process" in given.reason
    # Another replica that sees this one holds that CPU: the next free one; all held: not pinned.
    assert plan_cpus((), "cuda:1", {4, 5, 6, 7}, pin="auto", box=box, claim=_claims({5})).host == 6
    assert plan_cpus((), "cpu", {4, 5}, pin="auto", box=box, claim=_claims({4, 5})).host is None
    # Kubernetes: a Burstable Pod's set is the node's shared pool, even where it is narrower than the
    # node (other Pods hold CPUs of their own); a Guaranteed Pod's whole CPUs (quota = set) are its own.
    pool = set(range(2, 16))
    burstable = plan_cpus((), "cuda:0", pool, pin="auto", box=Box(frozenset(range(16)), None, kubernetes=True),
                          claim=_claims(set()))
    assert burstable.host is None and "shared pool" in burstable.reason
    limited = Box(frozenset(range(16)), 4.0, kubernetes=True)
    assert plan_cpus((), "cuda:0", pool, pin="auto", box=limited, claim=_claims(set())).host is None
    guaranteed = plan_cpus((), "cuda:0", {6, 7, 8, 9}, pin="auto", box=limited, claim=_claims(set()))
    assert guaranteed.host == 6 and "static CPU manager" in guaranteed.reason
    # true pins as before, whatever the set; false never; runtime.cpus always.
    assert plan_cpus((), "cuda:3", set(range(16)), pin=True, box=box).host == 3
    assert plan_cpus((), "cuda:3", set(range(16)), pin=False, box=box).host is None
    assert plan_cpus((2,), "cuda:3", set(range(16)), pin="auto", box=box).host == 2


def test_auto_is_the_default_and_claims_are_held_until_released():
    from duplexrt.core.affinity import claim_cpu

    assert load_config(None, []).runtime.pin_host_threads == "auto"
    assert load_config(None, ["runtime.pin_host_threads=true"]).runtime.pin_host_threads is True
    with pytest.raises(ConfigError, match='runtime.pin_host_threads must be true, false or "auto"'):
        load_config(None, ['runtime.pin_host_threads="maybe"'])
    cpu = 10_000 + os.getpid() % 1000  # a CPU number no real replica claims
    first = claim_cpu(cpu)
    assert first is not None and claim_cpu(cpu) is None
    first.close()
    again = claim_cpu(cpu)
    assert again is not None
    again.close()


def _pinned(threads: dict[int, set[int]]) -> set[int]:
    return {next(iter(cpus)) for cpus in threads.values() if len(cpus) == 1}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two CPUs this process may use")
def test_two_replicas_with_the_defaults_never_pin_to_one_cpu():
    """The issue's case on this box: two ``duplexrt serve`` with nothing set both took CPU 0."""
    with ServeProcess() as a, ServeProcess() as b:
        pinned_a, pinned_b = _pinned(_cpus_of(a.proc.pid)), _pinned(_cpus_of(b.proc.pid))
        logged = a.wait_for_line("CPUs: ")
    assert not pinned_a & pinned_b, (pinned_a, pinned_b)
    assert "CPUs: " in logged
