"""A fixed-size log-linear histogram of non-negative integers (nanoseconds, sizes).

Per-frame figures (latency, delivery delay) must cost constant work and constant memory however
long a session runs, so samples are never kept: each lands in one of a fixed set of buckets whose
width grows with the value, keeping relative error under ``1 / 2**sub_bits`` (3% by default).
"""

from __future__ import annotations

import attrs
import numpy as np

_SUB_BITS = 5
_SUB = 1 << _SUB_BITS
_MAX_EXPONENT = 48  # values up to 2**53 ns (over 100 days) stay exact in their bucket
#: add's values wait in a list until this many, then numpy counts them into buckets.
_FOLD_AT = 4096


@attrs.frozen
class Summary:
    """Percentiles of a histogram, in the histogram's unit."""

    count: int
    mean: float
    p50: float
    p99: float
    max: float
    min: float

    def scaled(self, divisor: float) -> Summary:
        return Summary(self.count, self.mean / divisor, self.p50 / divisor, self.p99 / divisor,
                       self.max / divisor, self.min / divisor)


def _bucket_of(value: int) -> int:
    if value < _SUB:
        return value
    shift = value.bit_length() - _SUB_BITS - 1
    return ((shift + 1) << _SUB_BITS) + (value >> shift) - _SUB


def _lower_bound(bucket: int) -> int:
    if bucket < _SUB:
        return bucket
    shift = (bucket >> _SUB_BITS) - 1
    return ((bucket & (_SUB - 1)) + _SUB) << shift


class Histogram:
    """Counts of values in log-linear buckets.  Written by one thread; read by any.

    ``record`` is a handful of integer operations: cheap enough for every frame.  ``add`` and
    ``add_many`` cost less still on the writer's thread (see ``add``), for a histogram that is
    read where it is written.
    """

    __slots__ = ("_counts", "_pending", "_count", "_total", "_max", "_min")

    def __init__(self) -> None:
        self._counts = [0] * ((_MAX_EXPONENT + 2) << _SUB_BITS)
        self._pending: list[int] = []  # add's values, not yet in _counts or the moments
        self._count = 0
        self._total = 0
        self._max = 0
        self._min = -1

    # The moments of every value so far; those ``add`` left waiting are counted in first.

    @property
    def count(self) -> int:
        self._fold()
        return self._count

    @property
    def total(self) -> int:
        self._fold()
        return self._total

    @property
    def max(self) -> int:
        self._fold()
        return self._max

    @property
    def min(self) -> int:
        self._fold()
        return self._min

    def record(self, value: int) -> None:
        if value < 0:
            value = 0
        if value < _SUB:
            self._counts[value] += 1
        else:
            shift = value.bit_length() - _SUB_BITS - 1
            self._counts[(shift << _SUB_BITS) + (value >> shift)] += 1  # _bucket_of, folded
        self._count += 1
        self._total += value
        if value > self._max:
            self._max = value
        if value < self._min or self._min < 0:
            self._min = value

    def add(self, value: int) -> None:
        """``record``, deferred: the value waits in a list, and numpy counts a few thousand at a
        time into the buckets and the moments, or whatever waits when the histogram is read.

        The per-value work on the caller's thread is one list append and a length test, where
        ``record`` costs a few hundred nanoseconds of Python; for stage timing, that is what
        collection costs per frame.  What waits is only exact on the thread that writes, so a
        histogram fed this way is read on that thread (the frame histograms are: both sides are
        the trio thread).
        """
        pending = self._pending
        pending.append(value)
        if len(pending) >= _FOLD_AT:
            self._fold()

    def add_many(self, values: list[int]) -> None:
        """``add`` each of ``values``: a writer's whole batch in one call."""
        pending = self._pending
        pending.extend(values)
        if len(pending) >= _FOLD_AT:
            self._fold()

    def _fold(self) -> None:
        """Count the values ``add`` left waiting into their buckets (``_bucket_of``, vectorised)
        and the moments."""
        if not self._pending:
            return
        values = np.array(self._pending, dtype=np.int64)
        self._pending.clear()  # in place: a writer may hold the list
        np.maximum(values, 0, out=values)
        self._count += int(values.size)
        self._total += int(values.sum())
        high, low = int(values.max()), int(values.min())
        if high > self._max:
            self._max = high
        if low < self._min or self._min < 0:
            self._min = low
        # bit_length through the float exponent: exact below 2**53, and one too high at most
        # above it (rounding up to the next power of two), which the second line takes back.
        length = np.frexp(values.astype(np.float64))[1].astype(np.int64)
        length -= (values >> np.maximum(length - 1, 0)) == 0
        shift = np.maximum(length - _SUB_BITS - 1, 0)
        buckets = np.where(values < _SUB, values, (shift << _SUB_BITS) + (values >> shift))
        counts = self._counts
        added = np.bincount(buckets)
        for bucket in np.flatnonzero(added).tolist():
            counts[bucket] += int(added[bucket])

    def snapshot(self) -> Histogram:
        """A copy, safe to take while another thread records (each field is read once)."""
        self._fold()
        copy = Histogram()
        copy._counts = list(self._counts)
        copy._count = sum(copy._counts)
        copy._total = self._total
        copy._max = self._max
        copy._min = self._min
        return copy

    def minus(self, earlier: Histogram) -> Histogram:
        """What was recorded since ``earlier`` (a snapshot of this histogram).  Max and min are
        known only to their bucket: the bucket's bounds, kept within the whole history's."""
        self._fold()
        earlier._fold()
        diff = Histogram()
        diff._counts = [a - b for a, b in zip(self._counts, earlier._counts)]
        diff._count = sum(diff._counts)
        diff._total = self._total - earlier._total
        used = [i for i, n in enumerate(diff._counts) if n]
        if used:
            diff._max = min(self._max, _lower_bound(used[-1] + 1) - 1)
            diff._min = max(self._min, _lower_bound(used[0]))
        return diff

    def cumulative(self, bounds: list[int]) -> list[int]:
        """How many values were at most each of ``bounds`` (ascending), to bucket resolution:
        for exporting in formats with fixed bucket edges (Prometheus)."""
        self._fold()
        counts = self._counts
        result = []
        total = 0
        bucket = 0
        for bound in bounds:
            while bucket < len(counts) and _lower_bound(bucket) <= bound:
                total += counts[bucket]
                bucket += 1
            result.append(total)
        return result

    def percentile(self, q: float) -> float:
        """Value at quantile ``q`` (0..1): the midpoint of the bucket holding it, capped at max."""
        self._fold()
        if self.count == 0:
            return 0.0
        rank = max(1, int(q * self.count + 0.999999))
        seen = 0
        for bucket, n in enumerate(self._counts):
            if not n:
                continue
            seen += n
            if seen >= rank:
                low = _lower_bound(bucket)
                high = _lower_bound(bucket + 1)
                return float(min(self.max, max(self.min, (low + high - 1) / 2)))
        return float(self.max)

    def summary(self) -> Summary:
        if self.count == 0:
            return Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return Summary(
            count=self.count,
            mean=self.total / self.count,
            p50=self.percentile(0.5),
            p99=self.percentile(0.99),
            max=float(self.max),
            min=float(self.min),
        )
