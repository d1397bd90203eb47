"""The log-linear histogram: percentile accuracy, exact moments, interval diffs, bucket bounds."""

from __future__ import annotations

import math
import random

import pytest

from duplexrt.core.histogram import _FOLD_AT, Histogram, Summary, _bucket_of, _lower_bound

#: The documented bound on relative error: 1 / 2**sub_bits with the default five sub-bucket bits.
RELATIVE_ERROR = 1 / 32


def recorded(values) -> Histogram:
    histogram = Histogram()
    for value in values:
        histogram.record(value)
    return histogram


def nearest_rank(values, q: float) -> int:
    """The q-quantile of ``values`` by the nearest-rank rule: the smallest value with at least
    ``q * n`` of the values at or below it."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q * len(ordered) - 1e-9))
    return ordered[rank - 1]


def assert_close(estimate: float, true: float) -> None:
    assert abs(estimate - true) <= RELATIVE_ERROR * true, f"{estimate} is not within 1/32 of {true}"


# -- percentiles -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("low", "high", "step"), [(1, 10_001, 1), (1_000, 2_000, 1), (0, 32, 1), (50_000_000, 51_000_000, 97)]
)
def test_percentiles_of_uniform_range_within_relative_error(low, high, step):
    values = list(range(low, high, step))
    summary = recorded(values).summary()
    assert_close(summary.p50, nearest_rank(values, 0.5))
    assert_close(summary.p99, nearest_rank(values, 0.99))


def test_percentiles_of_random_uniform_values_within_relative_error():
    rng = random.Random(20240611)
    values = [rng.randrange(0, 10**9) for _ in range(20_000)]
    histogram = recorded(values)
    for q in (0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 0.999):
        assert_close(histogram.percentile(q), nearest_rank(values, q))


def test_percentiles_of_log_spread_values_within_relative_error():
    rng = random.Random(7)
    values = [int(10 ** rng.uniform(0, 12)) for _ in range(20_000)]
    histogram = recorded(values)
    for q in (0.05, 0.5, 0.9, 0.99):
        assert_close(histogram.percentile(q), nearest_rank(values, q))


@pytest.mark.parametrize("value", [0, 1, 31, 32, 33, 1000, 123_456, 2**40 + 12345])
def test_constant_values_give_exact_figures(value):
    summary = recorded([value] * 1000).summary()
    assert summary == Summary(count=1000, mean=float(value), p50=float(value), p99=float(value),
                              max=float(value), min=float(value))


def test_small_values_are_exact():
    values = list(range(32)) * 3
    histogram = recorded(values)
    for q in (0.1, 0.5, 0.9, 1.0):
        assert histogram.percentile(q) == nearest_rank(values, q)


def test_bimodal_percentiles_land_in_the_right_mode():
    rng = random.Random(99)
    fast = [rng.randrange(1_900, 2_100) for _ in range(6_000)]
    slow = [rng.randrange(4_900_000, 5_100_000) for _ in range(4_000)]
    values = fast + slow
    rng.shuffle(values)
    histogram = recorded(values)
    summary = histogram.summary()
    assert 1_900 * (1 - RELATIVE_ERROR) <= summary.p50 <= 2_100 * (1 + RELATIVE_ERROR)
    assert_close(summary.p50, nearest_rank(values, 0.5))
    assert 4_900_000 * (1 - RELATIVE_ERROR) <= summary.p99 <= 5_100_000 * (1 + RELATIVE_ERROR)
    assert_close(summary.p99, nearest_rank(values, 0.99))
    # The boundary between the modes: 60% of the values are fast.
    assert histogram.percentile(0.6) < 2_200
    assert histogram.percentile(0.61) > 4_800_000


def test_percentile_never_leaves_the_recorded_range():
    values = [1000, 1001, 1002]
    histogram = recorded(values)
    for q in (0.0, 0.34, 0.5, 0.99, 1.0):
        assert 1000 <= histogram.percentile(q) <= 1002


def test_single_value_percentiles_are_that_value():
    histogram = recorded([987_654])
    assert histogram.percentile(0.0) == histogram.percentile(1.0) == 987_654


# -- exact figures ---------------------------------------------------------------------------------


def test_min_max_count_mean_are_exact():
    rng = random.Random(3)
    values = [rng.randrange(0, 10**12) for _ in range(5_000)]
    summary = recorded(values).summary()
    assert summary.count == len(values)
    assert summary.min == min(values)
    assert summary.max == max(values)
    assert summary.mean == sum(values) / len(values)


def test_count_and_total_attributes_track_records():
    histogram = recorded([5, 10, 15])
    assert histogram.count == 3
    assert histogram.total == 30
    assert histogram.max == 15
    assert histogram.min == 5


def test_negative_values_are_recorded_as_zero():
    summary = recorded([-5, 10]).summary()
    assert summary.min == 0
    assert summary.count == 2
    assert summary.mean == 5.0


def test_empty_histogram_summary_is_zeros():
    assert Histogram().summary() == Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0)
    assert Histogram().percentile(0.5) == 0.0


def test_summary_scaled_divides_every_figure():
    summary = recorded([1000, 2000, 3000]).summary()
    scaled = summary.scaled(1000)
    assert scaled.count == 3
    assert scaled.mean == pytest.approx(summary.mean / 1000)
    assert scaled.p50 == pytest.approx(summary.p50 / 1000)
    assert scaled.p99 == pytest.approx(summary.p99 / 1000)
    assert scaled.max == pytest.approx(3.0)
    assert scaled.min == pytest.approx(1.0)


# -- snapshots and intervals -----------------------------------------------------------------------


def test_snapshot_is_unaffected_by_later_records():
    histogram = recorded([10, 20, 30])
    snap = histogram.snapshot()
    before = snap.summary()
    histogram.record(10**9)
    assert snap.summary() == before
    assert histogram.summary().count == 4


def test_snapshot_has_the_same_summary():
    rng = random.Random(11)
    histogram = recorded(rng.randrange(0, 10**6) for _ in range(1000))
    assert histogram.snapshot().summary() == histogram.summary()


def test_minus_gives_only_what_was_recorded_in_between():
    rng = random.Random(5)
    histogram = recorded(rng.randrange(10, 500) for _ in range(1_000))
    earlier = histogram.snapshot()
    between = [rng.randrange(10_000, 20_000) for _ in range(3_000)]
    for value in between:
        histogram.record(value)
    diff = histogram.minus(earlier)
    summary = diff.summary()
    assert summary.count == len(between)
    assert summary.mean == sum(between) / len(between)
    assert_close(summary.p50, nearest_rank(between, 0.5))
    assert_close(summary.p99, nearest_rank(between, 0.99))
    # Min and max are known to their bucket, never outside the interval's own bucket bounds.
    assert min(between) * (1 - RELATIVE_ERROR) <= summary.min <= min(between)
    assert max(between) <= summary.max <= max(between) * (1 + RELATIVE_ERROR)


def test_minus_ignores_larger_values_recorded_before_the_snapshot():
    histogram = recorded(range(10_000, 20_000))
    earlier = histogram.snapshot()
    between = list(range(100, 201))
    for value in between:
        histogram.record(value)
    summary = histogram.minus(earlier).summary()
    assert summary.count == len(between)
    assert max(between) <= summary.max <= max(between) * (1 + RELATIVE_ERROR)
    assert min(between) * (1 - RELATIVE_ERROR) <= summary.min <= min(between)
    assert_close(summary.p99, nearest_rank(between, 0.99))


def test_minus_of_two_later_snapshots():
    histogram = Histogram()
    histogram.record(1)
    first = histogram.snapshot()
    for value in (40, 41, 42):
        histogram.record(value)
    second = histogram.snapshot()
    histogram.record(10**7)
    summary = second.minus(first).summary()
    assert summary.count == 3
    assert summary.mean == 41.0
    assert summary.min == 40 and summary.max == 42


def test_minus_with_nothing_in_between_is_empty():
    histogram = recorded([100, 200, 300])
    diff = histogram.minus(histogram.snapshot())
    assert diff.summary() == Summary(0, 0.0, 0.0, 0.0, 0.0, 0.0)


# -- bucket bounds ---------------------------------------------------------------------------------


def random_values(count: int, seed: int):
    """Values spread over every magnitude up to 2**53: a random bit length, then a random value."""
    rng = random.Random(seed)
    for _ in range(count):
        bits = rng.randrange(0, 54)
        yield rng.randrange(0, 2**bits) if bits else 0


def edge_values():
    for k in range(54):
        for v in (2**k - 1, 2**k, 2**k + 1):
            if 0 <= v < 2**53:
                yield v


def test_every_value_lies_within_its_bucket_bounds():
    for value in [*random_values(20_000, seed=1), *edge_values()]:
        bucket = _bucket_of(value)
        assert _lower_bound(bucket) <= value < _lower_bound(bucket + 1), value


def test_bucket_width_is_within_relative_error():
    for value in random_values(5_000, seed=2):
        if value < 32:
            continue
        bucket = _bucket_of(value)
        low, high = _lower_bound(bucket), _lower_bound(bucket + 1)
        assert high - low <= low * RELATIVE_ERROR, value


def test_buckets_are_ordered_like_values():
    values = sorted(random_values(5_000, seed=3))
    buckets = [_bucket_of(v) for v in values]
    assert buckets == sorted(buckets)


def test_small_values_have_their_own_bucket():
    assert [_bucket_of(v) for v in range(64)] == list(range(64))


# -- a batch of values at once -----------------------------------------------------------------------


BATCHES = [[5], [0, 31, 32, 33], [-4, 7], [54_000_000, 53_900_000, 110_000_000, 1],
           [2**53 - 1, 2**53, 2**53 + 1, 2**54 - 1, 2**54 - 2**40],  # where a float64 rounds up
           [2**k - 1 for k in range(1, 54)] + [2**k for k in range(54)]]


@pytest.mark.parametrize("values", BATCHES)
def test_add_many_is_record_one_by_one(values):
    """A writer's batch goes in with one call (the per-frame cost of stage timing); once read,
    it must be exactly what recording the values one by one leaves."""
    one_by_one = recorded(values)
    at_once = Histogram()
    at_once.record(40)  # on top of what was there
    one_by_one.record(40)
    at_once.add_many(values)
    assert (at_once.count, at_once.total, at_once.max, at_once.min) == (
        one_by_one.count, one_by_one.total, one_by_one.max, one_by_one.min)
    assert at_once.snapshot()._counts == one_by_one._counts
    assert at_once.summary() == one_by_one.summary()
    assert at_once.cumulative([0, 40, 10**8]) == one_by_one.cumulative([0, 40, 10**8])


def test_add_many_of_many_batches_counts_each_value_once():
    rng = random.Random(7)
    values = [int(rng.lognormvariate(17, 1)) for _ in range(20_000)]  # past the fold size
    at_once = Histogram()
    for start in range(0, len(values), 8):
        at_once.add_many(values[start:start + 8])
    earlier = at_once.snapshot()
    at_once.add_many([123_456, 7])
    assert at_once.snapshot()._counts == recorded(values + [123_456, 7])._counts
    assert at_once.minus(earlier).count == 2


def test_add_many_of_nothing_changes_nothing():
    histogram = Histogram()
    histogram.add_many([])
    assert histogram.summary() == Histogram().summary() and histogram.min == -1


def test_add_is_record_once_read():
    """One value at a time, deferred: what a reader sees is what ``record`` leaves, negative
    values counted as 0 as there."""
    values = [5, -3, 900, 33, 70_000, 12, 2**40]
    deferred, recorded_now = Histogram(), Histogram()
    for value in values:
        deferred.add(value)
        recorded_now.record(value)
    assert (deferred.count, deferred.total, deferred.max, deferred.min) == (
        recorded_now.count, recorded_now.total, recorded_now.max, recorded_now.min)
    assert deferred.summary() == recorded_now.summary()


def test_values_left_waiting_stay_bounded_when_nobody_reads():
    """A server nobody scrapes must not keep every frame's latency."""
    histogram = Histogram()
    for value in range(3 * _FOLD_AT + 5):
        histogram.add(value)
    assert len(histogram._pending) < _FOLD_AT
    assert histogram.count == 3 * _FOLD_AT + 5
