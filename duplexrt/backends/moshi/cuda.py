"""The backend's own uses of ``torch.cuda``: which GPU, and the one wait per step.

* **Which GPU.**  ``device = "cuda:N"`` makes N the scheduler thread's current device
  (``torch.cuda.set_device``) before anything is built.  The package names no device when it
  captures its CUDA graphs (``torch.cuda.graph`` captures on the current device's stream), and a
  new event records on the current stream: without it, on a GPU other than 0, graph capture and
  the events would use cuda:0's stream while the kernels run on N (empty graphs, a wait that waits
  for nothing).  A bare ``"cuda"`` keeps the current device (``set_device`` refuses a device
  without an index); every event below also names its stream's device.
* **The wait.**  Each step ends in one host synchronisation, on the event recorded after its last
  kernel.  CUDA's default wait busy-spins a CPU for the whole step (20-90 ms for Moshi 7B), and
  that CPU is the one the trio thread shares with this thread (``runtime.pin_host_threads``).
  Events made with ``blocking=True`` put the waiting thread to sleep in the driver until the GPU
  gets there instead.
"""

from __future__ import annotations

from typing import Any


def device_index(device: str) -> int | None:
    """N for ``"cuda:N"``; None for ``"cuda"`` or ``"cpu"``."""
    name, _, index = device.partition(":")
    return int(index) if name == "cuda" and index.isdigit() else None


def select_device(cuda: Any, device: str) -> None:
    """Make ``device``'s GPU this thread's current one, when it names one (``cuda`` is
    ``torch.cuda``, or a stand-in that records what is called)."""
    index = device_index(device)
    if index is not None:
        cuda.set_device(index)


class StepClock:
    """``marks`` blocking CUDA events, recorded between a step's stages on the current stream of
    ``device`` (a ``torch.device``); the last one is what the step waits on."""

    def __init__(self, cuda: Any, device: Any, marks: int) -> None:
        self._cuda = cuda
        self._device = device
        self._events = [cuda.Event(enable_timing=True, blocking=True) for _ in range(marks)]

    def mark(self, index: int) -> None:
        self._events[index].record(self._cuda.current_stream(self._device))

    def wait(self) -> None:
        """Sleep until the GPU has passed the last mark."""
        self._events[-1].synchronize()

    def elapsed_ns(self) -> list[int]:
        """Device time between consecutive marks, in nanoseconds (after ``wait``)."""
        events = self._events
        return [int(events[i].elapsed_time(events[i + 1]) * 1e6) for i in range(len(events) - 1)]
