"""Which row of the batch holds which slot's call.

The scheduler names a call by its slot, which it keeps for the whole call.  The fixed batch puts
slot ``s`` in row ``s``.  A step sized to the active calls (``buckets``) needs them in the lowest
rows instead, so that the first ``b`` rows cover them all: a joining call takes the lowest free
row, and a call leaving below the top has the top call moved into its row (one exact row move per
hang-up, none per step), so the rows in use stay ``0 .. active - 1``.
"""

from __future__ import annotations

import numpy as np


class RowMap:
    """Slot to row, and back.  ``dense``: rows ``0 .. active - 1`` in use; else row = slot."""

    def __init__(self, slots: int, *, dense: bool) -> None:
        self.dense = dense
        self._row_of = np.arange(slots, dtype=np.int64) if not dense else np.full(slots, -1, dtype=np.int64)
        self._slot_at = np.arange(slots, dtype=np.int64) if not dense else np.full(slots, -1, dtype=np.int64)
        #: Rows in use: in dense order, the highest is ``active - 1``.
        self.active = 0
        self._rows = np.zeros(slots, dtype=np.int64)

    def open(self, slot: int) -> int:
        """The row for ``slot``'s new call (the slot's own, or the lowest free one)."""
        if not self.dense:
            return slot
        if self._row_of[slot] >= 0:
            return int(self._row_of[slot])  # opened again before its close: the same row
        row = self.active
        self._row_of[slot] = row
        self._slot_at[row] = slot
        self.active += 1
        return row

    def row(self, slot: int) -> int:
        """The row holding ``slot``'s call."""
        row = int(self._row_of[slot])
        if row < 0:
            raise KeyError(f"slot {slot} holds no call")
        return row

    def close(self, slot: int) -> tuple[int, int | None]:
        """Let ``slot``'s row go: ``(its row, the row whose call moves into it)``, the second None
        where nothing moves (the fixed batch, the top row, a slot with no call)."""
        if not self.dense:
            return slot, None
        row = int(self._row_of[slot])
        if row < 0:
            return -1, None
        self._row_of[slot] = -1
        top = self.active - 1
        self.active = top
        if row == top:
            self._slot_at[top] = -1
            return row, None
        moved = int(self._slot_at[top])
        self._slot_at[row] = moved
        self._row_of[moved] = row
        self._slot_at[top] = -1
        return row, top

    def rows_of(self, slots: np.ndarray) -> np.ndarray:
        """The rows of ``slots`` (a view of a buffer, good until the next call)."""
        if not self.dense:
            return slots
        out = self._rows[:len(slots)]
        np.take(self._row_of, slots, out=out)
        if len(out) and out.min() < 0:
            raise KeyError(f"slots {slots[out < 0].tolist()} hold no call")
        return out

    def clear(self) -> None:
        """Every row let go (the backend's rows reset)."""
        if self.dense:
            self._row_of[:] = -1
            self._slot_at[:] = -1
            self.active = 0
