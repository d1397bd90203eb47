"""What one small numpy call costs where the runtime makes it, beside the C builtins that can stand
in for it: warm in a loop, after other Python work, and with a second thread that wants the GIL.

The server's hot path runs numpy between a lot of other Python (trio, the WebSocket layer, the
session), with the scheduler thread beside it.  A tight loop says a reduction over a 160 ms
message costs a microsecond or two; under load it cost ten times that (thread-CPU timers around
the calls in a running server, docs/benchmarks.md "Hot path, seventh pass").  This reproduces the
two effects apart, on a 15,360-byte payload (160 ms of float32 at 24 kHz):

- ``after work``: some Python runs between calls (a dict filled, as a request's handling would),
  so numpy's large dispatch path is no longer in the caches when it is called;
- ``contended``: as ``after work``, with a thread that sleeps 0.5 ms and then runs Python,
  as the scheduler thread wakes for its cycle.  numpy lets the GIL go for arrays over a few
  hundred elements; when the other thread is waiting, each call hands the GIL over and back.
  ``--pin`` keeps both threads on one CPU, as ``runtime.pin_host_threads`` does.

The figure is the median thread CPU time of the call (``time.thread_time_ns`` around it), so a
thread waiting for the GIL is not counted, only what the handoffs themselves cost.

Usage: python benchmarks/numpy_call_cost.py [--calls 3000] [--pin]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Callable

import numpy as np

try:
    from websockets.speedups import apply_mask
except ImportError:  # websockets without its C extension
    apply_mask = None

SAMPLES = 3840  # 160 ms at 24 kHz


def _python_work() -> None:
    table: dict[int, tuple[int, str]] = {}
    for i in range(300):
        table[i % 97] = (i, str(i))


class _GilWanter:
    """A thread that wakes every 0.5 ms and runs about 100 µs of Python."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            time.sleep(0.0005)
            total = 0
            for i in range(2000):
                total += i

    def __enter__(self) -> _GilWanter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def median_us(call: Callable[[], object], calls: int, between: Callable[[], None] | None) -> float:
    spent = []
    clock = time.thread_time_ns
    for _ in range(calls):
        if between is not None:
            between()
        started = clock()
        call()
        spent.append(clock() - started)
    spent.sort()
    return spent[len(spent) // 2] / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--pin", action="store_true", help="both threads on this process's lowest CPU")
    args = parser.parse_args()
    if args.pin:
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    samples = (np.random.default_rng(0).random(SAMPLES, dtype=np.float32) - 0.5)
    payload = samples.tobytes()
    target = np.empty_like(samples)
    target_bytes = memoryview(target).cast("B")
    source_bytes = memoryview(samples).cast("B")
    minimum, maximum = np.minimum.reduce, np.maximum.reduce
    rows: list[tuple[str, Callable[[], object]]] = [
        ("numpy: min and max (range check)", lambda: (minimum(samples), maximum(samples))),
        ("numpy: copy into an array", lambda: np.copyto(target, samples)),
        ("numpy: concatenate two", lambda: np.concatenate([samples, samples])),
        ("C builtin: memoryview copy", lambda: target_bytes.__setitem__(slice(None), source_bytes)),
        ("C builtin: bytes join of two", lambda: b"".join([samples, samples])),
    ]
    if apply_mask is not None:
        rows.append(("websockets: apply_mask", lambda: apply_mask(payload, b"\x11\x22\x33\x44")))
    results = {name: [median_us(call, args.calls, None), median_us(call, args.calls, _python_work)]
               for name, call in rows}
    with _GilWanter():
        for name, call in rows:
            results[name].append(median_us(call, args.calls, _python_work))
    pinned = " (both threads on one CPU)" if args.pin else ""
    print(f"median thread CPU per call, µs, {SAMPLES} float32 samples{pinned}")
    print(f"{'call':<36} {'warm':>8} {'after work':>11} {'contended':>10}")
    for name, (warm, after, contended) in results.items():
        print(f"{name:<36} {warm:>8.2f} {after:>11.2f} {contended:>10.2f}")


if __name__ == "__main__":
    main()
