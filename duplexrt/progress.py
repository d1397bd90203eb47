"""A progress line on stderr, redrawn by a trio task: no hidden thread, no extra dependency."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TextIO

import trio

_WIDTH = 30


def render(label: str, done: int, total: int, elapsed: float) -> str:
    fraction = min(1.0, done / total) if total else 1.0
    filled = int(fraction * _WIDTH)
    bar = "#" * filled + "-" * (_WIDTH - filled)
    return f"\r{label} [{bar}] {done}/{total} frames {elapsed:6.1f}s"


async def show_progress(label: str, done: Callable[[], int], total: int, *,
                        interval: float = 0.25, stream: TextIO | None = None) -> None:
    """Redraw until cancelled, then leave a final line."""
    stream = stream or sys.stderr
    start = trio.current_time()
    try:
        while True:
            stream.write(render(label, done(), total, trio.current_time() - start))
            stream.flush()
            await trio.sleep(interval)
    finally:
        stream.write(render(label, done(), total, trio.current_time() - start) + "\n")
        stream.flush()
