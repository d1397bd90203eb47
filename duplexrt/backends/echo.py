"""``echo``: each session hears its own input again, a fixed number of frames later.

The default backend: it needs no download, and its output is trivially checkable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from duplexrt.backends.base import Backend, BackendInfo, SlotSession, number_option, take_options

DEFAULTS = {"delay_frames": 2}


class EchoBackend(Backend):
    def __init__(self, info: BackendInfo, options: Mapping[str, Any]) -> None:
        super().__init__(info)
        opts = take_options("echo", options, DEFAULTS)
        self.delay_frames = int(number_option("echo", opts, "delay_frames", 0, 1000, integer=True))
        depth = max(self.delay_frames, 1)
        # One delay line per slot, allocated once: stepping allocates nothing.
        self._lines = np.zeros((info.slots, depth, info.frame_size), dtype=np.float32)
        self._line_bytes = self._lines.data.cast("B")
        self._frame_bytes = info.frame_size * self._lines.itemsize
        self._position = [0] * info.slots

    def open_slot(self, slot: int, session: SlotSession) -> None:
        self._lines[slot] = 0.0
        self._position[slot] = 0

    def close_slot(self, slot: int) -> None:
        self._position[slot] = 0

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> None:
        if self.delay_frames == 0:
            outputs[...] = inputs
            return None
        # Two plain copies per row through memoryviews: a handful of rows (paced load) costs a
        # few microseconds, where numpy's fancy indexing costs its call overhead several times.
        size = self._frame_bytes
        stride = self.delay_frames * size
        lines = self._line_bytes
        out = outputs.data.cast("B")
        given = inputs.data.cast("B")
        position = self._position
        last = self.delay_frames - 1
        at = 0
        for row in rows.tolist():
            p = position[row]
            start = row * stride + p * size
            out[at:at + size] = lines[start:start + size]
            lines[start:start + size] = given[at:at + size]
            position[row] = p + 1 if p < last else 0
            at += size
        return None
