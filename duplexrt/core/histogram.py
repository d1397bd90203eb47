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
#: record_many's values wait in a list until this many, then numpy counts them into buckets.
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

    ``record`` is a handful of integer operations: cheap enough for every frame.
    """

    __slots__ = ("_counts", "_pending", "count", "total", "max", "min")

    def __init__(self) -> None:
        self._counts = [0] * ((_MAX_EXPONENT + 2) << _SUB_BITS)
        self._pending: list[int] = []  # record_many's values, not yet in _counts
        self.count = 0
        self.total = 0
        self.max = 0
        self.min = -1

    def record(self, value: int) -> None:
        if value < 0:
            value = 0
        if value < _SUB:
            self._counts[value] += 1
        else:
            shift = value.bit_length() - _SUB_BITS - 1
            self._counts[(shift << _SUB_BITS) + (value >> shift)] += 1  # _bucket_of, folded
        self.count += 1
        self.total += value
        if value > self.max:
            self.max = value
        if value < self.min or self.min < 0:
            self.min = value

    def record_many(self, values: list[int], total: int | None = None, high: int | None = None) -> None:
        """``record`` each of ``values``: a writer's whole batch in one call.

        The moments (count, total, max, min) are kept at once, with the builtins over the list;
        the values themselves wait in a list and are counted into their buckets by numpy, a few
        thousand at a time or when the buckets are read.  So the per-value work on the caller's
        thread is one list append in C, where ``record`` costs a few hundred nanoseconds of
        Python: that is what stage timing costs per frame.  The buckets are then only exact on
        the thread that writes, so a histogram fed this way is read on that thread (the frame
        histograms are: both sides are the trio thread).  A caller that has summed the values
        or found their largest already (a session's own totals) passes ``total`` and ``high``.
        """
        if not values:
            return
        low = min(values)
        if low < 0:
            values = [value if value > 0 else 0 for value in values]
            low = 0
            total = high = None  # the caller's were over the negative values
        self._pending.extend(values)
        if len(self._pending) >= _FOLD_AT:
            self._fold()
        self.count += len(values)
        self.total += sum(values) if total is None else total
        if high is None:
            high = max(values)
        if high > self.max:
            self.max = high
        if low < self.min or self.min < 0:
            self.min = low

    def _fold(self) -> None:
        """Count the values ``record_many`` left waiting into their buckets (``_bucket_of``,
        vectorised)."""
        if not self._pending:
            return
        values = np.array(self._pending, dtype=np.int64)
        self._pending = []
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
        copy.count = sum(copy._counts)
        copy.total = self.total
        copy.max = self.max
        copy.min = self.min
        return copy

    def minus(self, earlier: Histogram) -> Histogram:
        """What was recorded since ``earlier`` (a snapshot of this histogram).  Max and min are
        known only to their bucket: the bucket's bounds, kept within the whole history's."""
        self._fold()
        earlier._fold()
        diff = Histogram()
        diff._counts = [a - b for a, b in zip(self._counts, earlier._counts)]
        diff.count = sum(diff._counts)
        diff.total = self.total - earlier.total
        used = [i for i, n in enumerate(diff._counts) if n]
        if used:
            diff.max = min(self.max, _lower_bound(used[-1] + 1) - 1)
            diff.min = max(self.min, _lower_bound(used[0]))
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
