"""``synthetic``: checkable output at a chosen cost, for measuring the runtime itself.

Each output frame is a function of the session, the frame's index in the session and its input, so
a load generator can verify every frame it gets back: content, order and completeness.  The cost of
a step (``step_ms`` plus ``slot_us`` for each row) is spent sleeping with the GIL released, which
is how a host thread waiting on a GPU kernel spends it.  ``host_ms`` adds host work per step spent
running Python, holding the GIL as a real model's dispatch and sampling code does, so that the
contention between the scheduler thread and the trio thread can be measured.  ``rows = "fixed"``
charges every step for all the slots whatever the rows, as a fixed-batch model (Moshi) does.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from duplexrt.backends.base import Backend, BackendInfo, SlotSession, number_option, take_options
from duplexrt.config import ConfigError

DEFAULTS = {"step_ms": 0.0, "slot_us": 0.0, "host_ms": 0.0, "rows": "active"}
ROWS = ("active", "fixed")

#: How many distinct marker tones tag the output frames.
MARKER_COUNT = 61
INPUT_GAIN = np.float32(0.5)


def marker_tones(sample_rate: int, frame_size: int) -> np.ndarray:
    """The table of quiet tones added to outputs: ``(MARKER_COUNT, frame_size)`` float32."""
    t = np.arange(frame_size, dtype=np.float64) / sample_rate
    freqs = 200.0 + 40.0 * np.arange(MARKER_COUNT)
    return (0.25 * np.sin(2 * np.pi * freqs[:, None] * t[None, :])).astype(np.float32)


def marker_index(session_id: np.ndarray | int, frame_index: np.ndarray | int) -> np.ndarray | int:
    """Which marker tone tags ``frame_index`` of ``session_id``: differs between neighbouring
    frames and neighbouring sessions, so a swapped or shifted frame shows."""
    return (session_id * 7 + frame_index) % MARKER_COUNT


def expected_output(frame: np.ndarray, session_id: int, frame_index: int, tones: np.ndarray) -> np.ndarray:
    """The output the backend gives for one input frame, computed the same way, bit for bit."""
    return frame * INPUT_GAIN + tones[marker_index(session_id, frame_index)]


class SyntheticBackend(Backend):
    def __init__(self, info: BackendInfo, options: Mapping[str, Any]) -> None:
        super().__init__(info)
        opts = take_options("synthetic", options, DEFAULTS)
        self.step_seconds = number_option("synthetic", opts, "step_ms", 0, 60_000) / 1e3
        self.slot_seconds = number_option("synthetic", opts, "slot_us", 0, 1e6) / 1e6
        self.host_seconds = number_option("synthetic", opts, "host_ms", 0, 60_000) / 1e3
        if opts["rows"] not in ROWS:
            raise ConfigError(f"backend.options.rows for synthetic must be one of {', '.join(ROWS)}, "
                              f"got {opts['rows']!r}")
        self.fixed_rows = opts["rows"] == "fixed"
        self.tones = marker_tones(info.sample_rate, info.frame_size)
        self._session_ids = np.zeros(info.slots, dtype=np.int64)
        self._frame_index = np.zeros(info.slots, dtype=np.int64)
        self._marker_rows = np.empty((info.slots, info.frame_size), dtype=np.float32)

    def load(self) -> None:
        # Its cost is what its options say: the capacity estimate starts from that, at one row
        # and at a full batch, as it would from a real model's warm-up.
        slots = self.info.slots
        self.warmup_costs = ((1, self.cost(1)), (slots, self.cost(slots)))

    def cost(self, rows: int) -> float:
        """Seconds a step of ``rows`` rows takes, host work included."""
        charged = self.info.slots if self.fixed_rows else rows
        return self.host_seconds + self.step_seconds + self.slot_seconds * charged

    def open_slot(self, slot: int, session: SlotSession) -> None:
        self._session_ids[slot] = session.session_id
        self._frame_index[slot] = 0

    def close_slot(self, slot: int) -> None:
        self._frame_index[slot] = 0

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> None:
        n = len(rows)
        if self.host_seconds:
            # Python running on this thread: it holds the GIL, but for the interpreter's switch
            # interval, as host-side model code does.
            until = time.perf_counter() + self.host_seconds
            while time.perf_counter() < until:
                pass
        cost = self.step_seconds + self.slot_seconds * (self.info.slots if self.fixed_rows else n)
        if cost > 0:
            time.sleep(cost)
        markers = marker_index(self._session_ids[rows], self._frame_index[rows])
        np.take(self.tones, markers, axis=0, out=self._marker_rows[:n])
        np.multiply(inputs, INPUT_GAIN, out=outputs)
        np.add(outputs, self._marker_rows[:n], out=outputs)
        self._frame_index[rows] += 1
        return None
