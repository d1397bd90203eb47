"""Steps sized to the active calls: the smallest bucket of rows that covers them, over the batch's
own state.

The fixed batch steps every row it was built with, masked or not, so one caller on a server
sized for forty pays for forty rows.  Here a step runs over the first ``b`` rows only, ``b`` the
smallest of a few bucket sizes (``sizes``) that covers the highest active row; the backend keeps
its calls in the lowest rows (a leaving call below the top is replaced by the top one, with the
exact row move of ``rows``).

**One storage, views per bucket.**  Nothing is copied per step and no second state is allocated:
each bucket has its own state object for every streaming module (``ViewStates``), a shallow copy of
the batch's whose per-row tensors are views of their first ``b`` rows (``rows.ROW_FIELDS`` says
which dimension is the row), whose ``batch_size`` is ``b``, and whose CUDA-graph holders are its
own (so each bucket captures its own graphs, against addresses that never change).  A step
installs its bucket's state objects on the modules and puts the batch's own back after it, so
everything else the backend does between steps (resets, row moves, prompts, wipes) sees the batch
as it always was.

**What the package reassigns.**  Most of the package's state updates are in place, which a view
carries into the storage by itself.  A few are reassignments (``LMGen``'s ``offsets``, a step
count kept as a Python integer): after each step, a field that no longer holds its view is copied
into the storage and given its view back, and the step counts are carried across (``leave``).
The check is an identity test per field, so a field the package starts reassigning in a later
version is carried too, not silently lost.

**Exactness.**  A row's arithmetic is the same in every bucket except for rounding: the kernels
pick their blocking by batch size, so a call's samples can differ by about one float32 ulp
(1e-7 on this CPU; about one bfloat16 ulp on a GPU) with the number of neighbours, which at a
near-tie can pick another, equally likely token.  That is the default, as in every production
LLM server; ``backend.options.batch = "fixed"`` keeps the fixed masked batch, where a call's
output is bit for bit its own whoever shares the step.

**Hysteresis** (``BucketChooser``): a bucket grows at once when a call needs a higher row and
shrinks only after ``SHRINK_AFTER_STEPS`` steps that a smaller one would have covered, so that a
call hanging up and another ringing do not flip the bucket (on a GPU, each bucket is a set of CUDA
graphs, all captured at load).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from duplexrt.backends.moshi.internals import STREAMING_STATE, attributes, streaming_state, streaming_state_holder
from duplexrt.backends.moshi.rows import MACHINERY_FIELDS, NESTED_FIELDS, ROW_FIELDS, SCALAR_FIELDS, SHARED_TENSORS

#: Steps a smaller bucket must have covered every active row before the step shrinks to it
#: (25 steps of 80 ms: two seconds).
SHRINK_AFTER_STEPS = 25

#: Plain values every row advances alike (a step count): carried between the batch's own state
#: and the bucket's across each step.
_STEP_COUNTS = frozenset({"offset_cpu"})


class BucketsUnsupported(RuntimeError):
    """The batch's state holds something a view of its first rows cannot stand for (a guided
    model's two rows per call, a field no table places): the backend keeps the fixed batch."""


def sizes(slots: int) -> tuple[int, ...]:
    """The bucket sizes for a batch of ``slots`` rows: 1, 2, 4, 8, 16, then about 1.5x apart (24,
    32, 48, 64, 96...), and ``slots`` itself last.  A step pays for at most
    about half as many rows again as it uses, with few buckets (each a set of CUDA graphs)."""
    if slots < 1:
        raise ValueError(f"a batch has at least one row, got {slots}")
    found: list[int] = []
    size = 1
    while size < slots:
        found.append(size)
        if size < 16:
            size *= 2
        elif size & (size - 1) == 0:  # a power of two: half as much again
            size += size // 2
        else:  # 1.5 times a power of two: on to the next power
            size = size // 3 * 4
    found.append(slots)
    return tuple(found)


class BucketChooser:
    """Which bucket a step runs: the smallest covering the active rows, grown at once, shrunk
    after ``shrink_after`` steps a smaller one would have covered."""

    def __init__(self, bucket_sizes: tuple[int, ...], shrink_after: int = SHRINK_AFTER_STEPS) -> None:
        self.sizes = bucket_sizes
        self.shrink_after = shrink_after
        self.current = bucket_sizes[0]
        self._smaller_for = 0
        #: Bucket changes so far (each a switch of CUDA graphs on a GPU).
        self.changes = 0

    def covering(self, rows: int) -> int:
        """The smallest bucket holding ``rows`` rows."""
        for size in self.sizes:
            if size >= rows:
                return size
        raise ValueError(f"{rows} rows is more than the batch's {self.sizes[-1]}")

    def choose(self, rows: int) -> int:
        """The bucket for a step whose highest active row is ``rows - 1``."""
        needed = self.covering(max(rows, 1))
        if needed > self.current:
            self.current = needed
            self._smaller_for = 0
            self.changes += 1
        elif needed < self.current:
            self._smaller_for += 1
            if self._smaller_for >= self.shrink_after:
                self.current = needed
                self._smaller_for = 0
                self.changes += 1
        else:
            self._smaller_for = 0
        return self.current

    def restart(self) -> None:
        """Back to the smallest bucket (every row let go)."""
        self.current = self.sizes[0]
        self._smaller_for = 0


def time_buckets(step: Callable[[np.ndarray, int, np.ndarray, np.ndarray], None], bucket_sizes: Sequence[int],
                 frame_size: int, *, unsettled: int, steady: int) -> dict[int, float]:
    """Each bucket stepped full on silence, ``unsettled + steady`` times (its kernels chosen and,
    on a GPU, its CUDA graphs captured at load, not on a caller's frame): the median of its
    steady steps, in seconds, by bucket size.  ``step(rows, size, inputs, outputs)`` steps
    ``rows`` over the first ``size`` rows."""
    costs: dict[int, float] = {}
    for size in bucket_sizes:
        rows = np.arange(size, dtype=np.int64)
        silence = np.zeros((size, frame_size), dtype=np.float32)
        out = np.empty_like(silence)
        timed = []
        for _ in range(unsettled + steady):
            started = time.perf_counter()
            step(rows, size, silence, out)
            timed.append(time.perf_counter() - started)
        settled = sorted(timed[unsettled:])
        costs[size] = settled[len(settled) // 2]
    return costs


class _Bucket:
    """One bucket's state objects and what ``leave`` checks after its step."""

    __slots__ = ("size", "installs", "views", "counts")

    def __init__(self, size: int) -> None:
        self.size = size
        #: (the module's attribute dictionary, this bucket's state for it)
        self.installs: list[tuple[dict[str, Any], Any]] = []
        #: (the state object holding the field, the field's name, its view of the batch's tensor)
        self.views: list[tuple[Any, str, Any]] = []
        #: (the batch's state, this bucket's copy) of every state with a step count
        self.counts: list[tuple[Any, Any]] = []


def _graph_holder(value: Any) -> Any:
    """A fresh holder of the same kind for a bucket (its own CUDA graph, captured on its own
    steps), for the package's ``CUDAGraphed``; anything else of the machinery is shared."""
    if type(value).__name__ == "CUDAGraphed":
        return type(value)(value.func, disable=value.disable)
    return value


class ViewStates:
    """Per-bucket state objects for every streaming module under ``roots`` (streaming already),
    whose per-row tensors are views of the batch's first rows.  Raises ``BucketsUnsupported``
    where that cannot stand for the batch."""

    def __init__(self, roots: Mapping[str, Any], slots: int, bucket_sizes: tuple[int, ...], *,
                 row_fields: Mapping[str, int] | None = None) -> None:
        from moshi.modules.streaming import StreamingModule

        self.slots = slots
        table = ROW_FIELDS if row_fields is None else row_fields
        modules: list[tuple[Any, Any]] = []
        seen: set[int] = set()
        for root in roots.values():
            for _, module in root.named_modules():
                state = streaming_state(module)
                if isinstance(module, StreamingModule) and state is not None and id(state) not in seen:
                    seen.add(id(state))
                    modules.append((module, state))
        self._own = [(streaming_state_holder(module), state) for module, state in modules]
        self.buckets = {size: self._build(size, modules, table) for size in bucket_sizes}
        self._entered: _Bucket | None = None

    def _build(self, size: int, modules: list[tuple[Any, Any]], table: Mapping[str, int]) -> _Bucket:
        bucket = _Bucket(size)
        for module, state in modules:
            clone = self._clone(state, size, table, bucket, "")
            bucket.installs.append((streaming_state_holder(module), clone))
            if any(name in _STEP_COUNTS for name in attributes(state)):
                bucket.counts.append((state, clone))
        return bucket

    def _clone(self, state: Any, size: int, table: Mapping[str, int], bucket: _Bucket, prefix: str) -> Any:
        import torch

        clone = copy.copy(state)
        for name, value in attributes(state).items():
            field = prefix + name
            if name in NESTED_FIELDS and value is not None and not prefix:
                setattr(clone, name, self._clone(value, size, table, bucket, f"{name}."))
            elif isinstance(value, torch.Tensor):
                if field in table:
                    dim = table[field]
                    rows = value.shape[dim] if value.dim() > dim else None
                    if rows is None or (rows == 1 < self.slots):
                        continue  # broadcast over the rows (or one value for all): shared as it is
                    if rows != self.slots:
                        raise BucketsUnsupported(f"{field} holds {rows} rows for a batch of {self.slots} (a guided "
                                                 "model runs two per call)")
                    view = value.narrow(dim, 0, size)
                    setattr(clone, name, view)
                    bucket.views.append((clone, name, view))
                elif field not in SHARED_TENSORS:
                    raise BucketsUnsupported(f"the streaming state's {field} is a tensor no table places")
            elif field == "batch_size":
                setattr(clone, name, size)
            elif field == "_set_exec_mask_graphed":
                setattr(clone, name, None)  # made on first use, for this bucket's states
            elif field in MACHINERY_FIELDS:
                setattr(clone, name, _graph_holder(value))
            elif value is not None and field not in SCALAR_FIELDS and not callable(value):
                raise BucketsUnsupported(f"the streaming state's {field} ({type(value).__name__}) is in no table")
        return clone

    def enter(self, size: int) -> None:
        """Bucket ``size``'s states on their modules, its step counts the batch's: for one step,
        ``leave`` after it however it ends."""
        bucket = self.buckets[size]
        for state, clone in bucket.counts:
            clone.offset_cpu = state.offset_cpu
        for holder, clone in bucket.installs:
            holder[STREAMING_STATE] = clone
        self._entered = bucket

    def leave(self) -> None:
        """The batch's own states back on their modules; what the step reassigned (not updated
        in place) copied into the storage, and its step counts carried back."""
        bucket = self._entered
        if bucket is None:
            return
        self._entered = None
        for holder, name, view in bucket.views:
            value = getattr(holder, name)
            if value is not view:
                view.copy_(value)
                setattr(holder, name, view)
        for state, clone in bucket.counts:
            state.offset_cpu = clone.offset_cpu
        for holder, state in self._own:
            holder[STREAMING_STATE] = state


__all__ = ["SHRINK_AFTER_STEPS", "BucketChooser", "BucketsUnsupported", "ViewStates", "sizes", "time_buckets"]
