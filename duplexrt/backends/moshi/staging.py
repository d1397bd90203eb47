"""Rows handed to the device between steps (a join's reset mask, the rows whose encoder starts
afresh) without the host waiting on the GPU."""

from __future__ import annotations

from typing import Any

import numpy as np


class StagedRows:
    """Rows for the device (a mask, their indices, a value per row), written into page-locked host
    buffers and copied without blocking: the host does not wait for the GPU's queued work (a
    pageable ``.to()`` would), and a later ``put`` waits only for this group's own last copy before
    writing the buffers again.  On a CPU the host buffers are the device's."""

    def __init__(self, torch: Any, slots: int, device: Any, host: Any) -> None:
        self._cuda = device.type == "cuda"
        self._mask_t = host((slots,), torch.bool)
        self._rows_t = host((slots,), torch.int64)
        self._values_t = host((slots,), torch.int64)
        self._mask, self._rows, self._values = self._mask_t.numpy(), self._rows_t.numpy(), self._values_t.numpy()
        if self._cuda:
            self._mask_dev = torch.zeros(slots, dtype=torch.bool, device=device)
            self._rows_dev = torch.zeros(slots, dtype=torch.int64, device=device)
            self._values_dev = torch.zeros(slots, dtype=torch.int64, device=device)
            self._copied = torch.cuda.Event()
        else:
            self._mask_dev, self._rows_dev, self._values_dev = self._mask_t, self._rows_t, self._values_t

    def put(self, rows: np.ndarray, values: np.ndarray | None = None) -> tuple[Any, Any, Any]:
        """``(mask, indices, values[rows])`` of ``rows`` on the device (views of this group's buffers,
        good until its next ``put``)."""
        count = len(rows)
        if self._cuda:
            self._copied.synchronize()  # the last copy from these buffers is done (long since, as a rule)
        self._mask[:] = False
        self._mask[rows] = True
        self._rows[:count] = rows
        if values is not None:
            self._values[:count] = values[rows]
        if self._cuda:
            self._mask_dev.copy_(self._mask_t, non_blocking=True)
            self._rows_dev[:count].copy_(self._rows_t[:count], non_blocking=True)
            if values is not None:
                self._values_dev[:count].copy_(self._values_t[:count], non_blocking=True)
            self._copied.record()
        return self._mask_dev, self._rows_dev[:count], self._values_dev[:count]
