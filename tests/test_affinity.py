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
