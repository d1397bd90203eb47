"""The moshi backend's own CUDA calls (``backends/moshi/cuda.py``): ``cuda:N`` made the thread's
current device, events recorded on that device's stream, and a step's one wait blocking.

FAKE: no GPU exists on the machines these tests run on, so ``torch.cuda`` is replaced by a
stand-in that records what is called with what; the assertions are on those calls.  The same
functions run against the real ``torch.cuda`` in ``benchmarks/gpu.py`` when a GPU is lent.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.moshi.cuda import StepClock, device_index, select_device  # noqa: E402

torch = pytest.importorskip("torch")


class RecordingCuda:
    """FAKE ``torch.cuda``: what the backend calls, and on what."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def set_device(self, index) -> None:
        if isinstance(index, torch.device) and index.index is None:
            raise ValueError("Expected a cuda device with a specified index")  # as torch does
        self.calls.append(("set_device", index))

    def current_stream(self, device=None):
        self.calls.append(("current_stream", device))
        return ("stream", device)

    def Event(self, **kwargs):  # noqa: N802 - torch's name
        self.calls.append(("Event", kwargs))
        return RecordingEvent(self, len([c for c in self.calls if c[0] == "Event"]) - 1)


class RecordingEvent:
    def __init__(self, cuda: RecordingCuda, number: int) -> None:
        self.cuda = cuda
        self.number = number

    def record(self, stream=None) -> None:
        self.cuda.calls.append(("record", self.number, stream))

    def synchronize(self) -> None:
        self.cuda.calls.append(("synchronize", self.number))

    def elapsed_time(self, other: RecordingEvent) -> float:
        return float(other.number - self.number)  # ms


def test_cuda_n_becomes_the_threads_current_device_and_bare_cuda_is_left_alone():
    cuda = RecordingCuda()
    select_device(cuda, "cuda:3")
    select_device(cuda, "cuda")  # torch.cuda.set_device(torch.device("cuda")) would raise
    select_device(cuda, "cpu")
    assert cuda.calls == [("set_device", 3)]
    assert (device_index("cuda:12"), device_index("cuda"), device_index("cpu")) == (12, None, None)


def test_the_step_clock_blocks_its_wait_and_records_on_the_named_devices_stream():
    cuda = RecordingCuda()
    device = torch.device("cuda:1")
    clock = StepClock(cuda, device, 4)
    # Every event blocking (the thread sleeps in the driver instead of spinning a CPU), timed.
    assert cuda.calls == [("Event", {"enable_timing": True, "blocking": True})] * 4
    cuda.calls.clear()
    for mark in range(4):
        clock.mark(mark)
    clock.wait()
    assert cuda.calls == [call for mark in range(4)
                          for call in (("current_stream", device), ("record", mark, ("stream", device)))] \
        + [("synchronize", 3)]  # one wait a step, on the last mark
    assert clock.elapsed_ns() == [1_000_000, 1_000_000, 1_000_000]


def test_the_backend_selects_its_device_before_building_anything(monkeypatch):
    """``load`` calls ``select_device`` with ``torch.cuda`` first: a stand-in records the order
    (the model build is stopped right after, at the first call that would need a GPU)."""
    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import backend as moshi_backend
    from duplexrt.backends.moshi import model as moshi_model

    order: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # FAKE: the settings accept cuda:2
    monkeypatch.setattr(moshi_backend, "select_device", lambda cuda, device: order.append(f"select {device}"))

    def build(settings, models, torch_module):
        order.append("build")
        raise RuntimeError("no GPU here")

    monkeypatch.setattr(moshi_model, "load_weights", build)
    backend = moshi_backend.MoshiBackend(BackendInfo("moshi", 24000, 1920, 2), {"tiny": True, "device": "cuda:2"})
    with pytest.raises(RuntimeError, match="no GPU here"):
        backend.load()
    assert order == ["select cuda:2", "build"]


def test_warm_up_steps_that_are_not_steady_never_seed_the_capacity_estimate(monkeypatch):
    """The first step pays allocation and compilation; on a GPU the second captures the CUDA
    graphs.  Neither is what a step costs, so neither seeds the estimate."""
    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import MoshiBackend

    def backend(steps: int, device: str = "cpu") -> MoshiBackend:
        return MoshiBackend(BackendInfo("moshi", 24000, 1920, 2),
                            {"tiny": True, "warmup_steps": steps, "device": device})

    one = backend(1)
    one.load()
    assert one.warmup_costs == ()  # its only step was the first
    one.close()
    three = backend(3)
    three.load()
    # Each bucket (1 and 2 rows) timed on its own steady steps.
    assert [rows for rows, _ in three.warmup_costs] == [1, 2] and all(cost > 0 for _, cost in three.warmup_costs)
    three.close()
    fixed = MoshiBackend(BackendInfo("moshi", 24000, 1920, 2), {"tiny": True, "warmup_steps": 3, "batch": "fixed"})
    fixed.load()
    (rows, cost), (slots, same) = fixed.warmup_costs
    assert (rows, slots) == (1, 2) and cost == same > 0  # the fixed batch costs the same at any load
    fixed.close()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # FAKE: only the settings are read
    assert backend(3, "cuda:0")._unsettled_steps == 2 and backend(3)._unsettled_steps == 1
