"""Admission by cost: the step-cost fit and the capacity it gives, from scripted step costs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import backend_info
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.core.capacity import REFIT_AFTER_MS, CapacityEstimator, fit_line, sessions_within
from duplexrt.server import Server
from conftest import http_get

FRAME_S = 0.080


def gpu_like(n: int) -> float:
    """The issue's synthetic curve: 28 ms a step plus 1.3 ms a row (seconds)."""
    return 0.028 + 0.0013 * n


def true_edge(cost, slots: int) -> int:
    """The most sessions whose step fits in one frame period."""
    return max(n for n in range(1, slots + 1) if cost(n) <= FRAME_S)


def _bounds_hold(estimate: int, edge: int) -> None:
    # Never admits past the edge; refuses below it by at most one session in ten.
    assert estimate <= edge
    assert edge - estimate <= math.ceil(edge / 10)


def test_the_warm_up_alone_gives_an_estimate_within_a_tenth_of_the_edge():
    estimator = CapacityEstimator(128, FRAME_S, margin=0.05)
    assert estimator.estimate.source == "none" and estimator.estimate.limit == 128
    estimator.seed([(1, gpu_like(1)), (128, gpu_like(128))])
    estimate = estimator.estimate
    assert estimate.source == "warm-up"
    assert estimate.base_ms == pytest.approx(28.0) and estimate.per_session_ms == pytest.approx(1.3)
    assert estimate.sessions == 36  # floor((76 - 28) / 1.3)
    _bounds_hold(estimate.sessions, true_edge(gpu_like, 128))


def test_steps_as_a_ramp_sees_them_refine_the_estimate_despite_noise():
    rng = np.random.default_rng(7)
    estimator = CapacityEstimator(128, FRAME_S, margin=0.05, refit_every=8)
    # No warm-up: sessions arrive one by one and the batch grows, with 0.5 ms of jitter per step.
    for batch in range(1, 37):
        for _ in range(20):
            cost = gpu_like(batch) + rng.uniform(0, 0.0005)
            estimator.record(batch, int(cost * 1e9))
    estimate = estimator.estimate
    assert estimate.source == "steps" and estimate.batch_sizes == 36
    assert estimate.per_session_ms == pytest.approx(1.3, abs=0.05)
    _bounds_hold(estimate.sessions, true_edge(gpu_like, 128))


def test_a_steady_batch_does_not_drown_the_warm_up_points():
    estimator = CapacityEstimator(128, FRAME_S, margin=0.05, refit_every=1)
    estimator.seed([(1, gpu_like(1)), (128, gpu_like(128))])
    for _ in range(5000):  # hours at one batch size
        estimator.record(30, int(gpu_like(30) * 1e9))
    assert estimator.estimate.sessions == 36


def test_one_batch_size_alone_is_read_as_all_per_session_cost_so_it_never_admits_past_the_edge():
    estimator = CapacityEstimator(128, FRAME_S, margin=0.0, refit_every=1)
    estimator.record(10, int(gpu_like(10) * 1e9))  # 41 ms at 10 rows: 4.1 ms a row, as far as known
    assert estimator.estimate.sessions == 19  # below the true edge of 40: early, never late
    assert estimator.estimate.sessions <= true_edge(gpu_like, 128)


def test_a_fixed_batch_costs_the_same_for_any_rows_so_every_slot_fits_or_one():
    fits = CapacityEstimator(8, FRAME_S, margin=0.05)
    fits.seed([(1, 0.030), (8, 0.030)])
    assert (fits.estimate.sessions, fits.estimate.per_session_ms) == (8, 0.0)
    too_slow = CapacityEstimator(8, FRAME_S, margin=0.05)
    too_slow.seed([(1, 0.120), (8, 0.120)])
    assert too_slow.estimate.sessions == 1  # it still serves one session, and says it is slow


def test_bucketed_steps_price_a_session_count_at_the_bucket_that_carries_it():
    """Buckets of 1, 2, 4, 8, 16, 24, 32 rows, each step costing its bucket's rows on the GPU-like
    curve: the line runs through the buckets, and the estimate admits no count whose bucket's
    step is over the budget (the line at the count itself would: 25 sessions ride a 32-row step)."""
    from duplexrt.backends.moshi.buckets import BucketChooser, sizes

    chooser = BucketChooser(sizes(32))

    def staircase(n: int) -> float:
        return 0.040 + 0.0013 * chooser.covering(n)

    estimator = CapacityEstimator(32, FRAME_S, margin=0.05, refit_every=1, paid_rows=chooser.covering)
    estimator.seed([(b, staircase(b)) for b in sizes(32)])
    for n in (3, 5, 11, 20, 2, 30):  # each step recorded under the bucket it ran, as the scheduler does
        estimator.record(chooser.covering(n), int(staircase(n) * 1e9))
    edge = true_edge(staircase, 32)  # 24: a 32-row step is 81.6 ms
    assert estimator.estimate.sessions == edge == 24
    assert 0.040 + 0.0013 * 25 <= 0.076  # the line at 25 itself would have admitted it
    assert sessions_within(40.0, 1.3, 76.0, 32) == 27 and sessions_within(40.0, 1.3, 76.0, 32, chooser.covering) == 24


def test_a_batch_size_seen_over_the_budget_caps_the_estimate_whatever_the_line_says():
    # A fixed 64-row batch (tiny Moshi on a 2-core CPU) whose warm-up fits a line under the
    # budget, then steps of 89 ms at one row: the steps' own cost brings the estimate down.
    estimator = CapacityEstimator(64, FRAME_S, margin=0.05, refit_every=1)
    estimator.seed([(n, 0.0698 + 0.00016 * n) for n in (1, 2, 4, 8, 16, 32, 64)])
    assert estimator.estimate.sessions == 38  # the warm-up's line
    for _ in range(64):
        estimator.record(1, 89_000_000)
    assert estimator.estimate.sessions == 1  # the least it says: it still serves one, and slowly
    fits = CapacityEstimator(64, FRAME_S, margin=0.05, refit_every=1)
    fits.seed([(1, gpu_like(1)), (64, gpu_like(64))])
    for _ in range(64):
        fits.record(30, int(gpu_like(30) * 1e9))
    assert fits.estimate.sessions == 36  # steps within the budget change nothing


def test_max_sessions_pins_the_limit_and_slots_stay_the_cap():
    estimator = CapacityEstimator(16, FRAME_S, margin=0.05, max_sessions=12)
    estimator.seed([(1, gpu_like(1)), (16, gpu_like(16))])
    assert (estimator.estimate.sessions, estimator.estimate.limit, estimator.estimate.source) == (16, 12, "pinned")
    assert CapacityEstimator(16, FRAME_S, margin=0.05, max_sessions=99).estimate.limit == 16


def test_the_fit_keeps_both_terms_non_negative():
    sizes = np.array([1.0, 2.0, 3.0])
    assert fit_line(sizes, np.array([5.0, 4.0, 3.0]), np.ones(3)) == (4.0, 0.0)  # falling: flat
    base, slope = fit_line(sizes, np.array([1.0, 3.0, 5.0]), np.ones(3))  # would cross below zero
    assert base == 0.0 and slope > 0
    assert sessions_within(28.0, 1.3, 76.0, 128) == 36
    assert sessions_within(28.0, 1.3, 76.0, 20) == 20


# -- admission on a real server ----------------------------------------------------------------------


class ScriptedCostEcho(EchoBackend):
    """FAKE (a test hook on the real echo model): its warm-up reports scripted step costs, 40 ms a
    step plus 10 ms a row, so the capacity estimate is known: 3 sessions in an 80 ms frame less 5 %."""

    def load(self) -> None:
        super().load()
        slots = self.info.slots
        self.warmup_costs = ((1, 0.040 + 0.010), (slots, 0.040 + 0.010 * slots))


async def _ready(port: int) -> tuple[int, dict]:
    status, _, body = await http_get(port, "/readyz")
    return status, json.loads(body)


async def test_admission_flips_to_at_capacity_and_back_as_sessions_come_and_go(nursery):
    config = load_config(None, ["server.port=0", "runtime.slots=8", "backend.options.delay_frames=0"])
    server = Server(config, ScriptedCostEcho(backend_info(config, "echo"), config.backend.options))
    await nursery.start(server.run)
    port = server.ports[0]
    url = f"ws://127.0.0.1:{port}/v1/duplex"
    status, ready = await _ready(port)
    assert status == 200 and ready["capacity"]["limit"] == 3 and ready["capacity"]["source"] == "warm-up"
    async with trio_websocket.open_websocket_url(url) as first, \
            trio_websocket.open_websocket_url(url) as second:
        await first.get_message()
        await second.get_message()
        assert (await _ready(port))[0] == 200
        async with trio_websocket.open_websocket_url(url) as third:
            await third.get_message()
            status, ready = await _ready(port)
            assert (status, ready["reason"], ready["admitted"]) == (503, "at_capacity", 3)
            assert ready["free_slots"] == 5  # slots are free: it is time that is not
            with pytest.raises(trio_websocket.ConnectionRejected) as refused:
                async with trio_websocket.open_websocket_url(url):
                    pass
            assert refused.value.status_code == 503 and refused.value.body.startswith(b"at_capacity")
            _, _, metrics = await http_get(port, "/metrics")
            assert b"duplexrt_capacity_limit 3.0" in metrics
            assert b'duplexrt_connections_refused_total{reason="at_capacity"} 1.0' in metrics
        # The third session gone: ready again, and a new session is admitted.
        with trio.fail_after(5):
            while (await _ready(port))[0] != 200:
                await trio.sleep(0.01)
        async with trio_websocket.open_websocket_url(url) as again:
            await again.get_message()
    assert server.refused["at_capacity"] == 1 and server.refused["no_free_slot"] == 0


async def test_max_sessions_pins_admission_below_the_slots(nursery):
    config = load_config(None, ["server.port=0", "runtime.slots=4", "runtime.max_sessions=1",
                                "backend.options.delay_frames=0"])
    server = Server(config)
    await nursery.start(server.run)
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex"
    async with trio_websocket.open_websocket_url(url) as first:
        await first.get_message()
        status, ready = await _ready(server.ports[0])
        assert (status, ready["reason"], ready["capacity"]["source"]) == (503, "at_capacity", "pinned")
        with pytest.raises(trio_websocket.ConnectionRejected) as refused:
            async with trio_websocket.open_websocket_url(url):
                pass
        assert refused.value.status_code == 503


def test_synthetic_warm_up_seeds_its_configured_cost_and_fixed_rows_make_a_flat_line():
    from duplexrt.backends.synthetic import SyntheticBackend
    from duplexrt.config import ConfigError

    config = load_config(None, ["runtime.slots=16"])
    active = SyntheticBackend(backend_info(config), {"step_ms": 28, "slot_us": 1300, "host_ms": 2})
    active.load()
    assert active.warmup_costs == (pytest.approx((1, 0.0313)), pytest.approx((16, 0.0508)))
    fixed = SyntheticBackend(backend_info(config), {"step_ms": 28, "slot_us": 1300, "rows": "fixed"})
    fixed.load()
    assert fixed.warmup_costs[0][1] == fixed.warmup_costs[1][1] == pytest.approx(0.0488)
    estimator = CapacityEstimator(16, FRAME_S, margin=0.05)
    estimator.seed(fixed.warmup_costs)
    assert (estimator.estimate.sessions, estimator.estimate.per_session_ms) == (16, 0.0)
    with pytest.raises(ConfigError, match="backend.options.rows"):
        SyntheticBackend(backend_info(config), {"rows": "some"})


def test_synthetic_with_host_work_and_fixed_rows_gives_the_same_checkable_output():
    from duplexrt.backends.base import SlotSession
    from duplexrt.backends.synthetic import SyntheticBackend, expected_output, marker_tones

    config = load_config(None, ["runtime.slots=2"])
    backend = SyntheticBackend(backend_info(config), {"host_ms": 1, "rows": "fixed"})
    backend.load()
    backend.open_slot(0, SlotSession(session_id=5))
    frame = np.full((1, 1920), 0.25, dtype=np.float32)
    out = np.empty_like(frame)
    backend.step(np.array([0]), frame, out)
    tones = marker_tones(24000, 1920)
    np.testing.assert_array_equal(out[0], expected_output(frame[0], 5, 0, tones))


SEVEN_B = Path(__file__).resolve().parent.parent / "configs" / "moshi-7b-random.toml"


def test_the_7b_random_config_chooses_the_full_architecture_and_nothing_to_download():
    from duplexrt.backends import create_backend
    from duplexrt.config import ConfigError

    config = load_config(SEVEN_B, ['backend.options.device="cpu"'])
    backend = create_backend(config)  # built, not loaded: 7B on this CPU would take minutes a step
    assert backend.settings.random == "moshi-7b" and not backend.settings.tiny and not backend.settings.checkpoint
    with pytest.raises(ConfigError, match="set only one"):
        create_backend(load_config(SEVEN_B,
                                   ['backend.options.device="cpu"', "backend.options.tiny=true"]))
    with pytest.raises(ConfigError, match="backend.options.random"):
        create_backend(load_config(SEVEN_B,
                                   ['backend.options.device="cpu"', 'backend.options.random="gpt"']))


def test_cheap_steps_refit_once_enough_step_time_is_recorded_and_dear_ones_every_few_steps():
    """A refit costs far more than an echo step: after the first fit from steps, cheap steps
    wait for ``REFIT_AFTER_MS`` of themselves; a step dearer than that share refits as before."""
    cheap = CapacityEstimator(128, FRAME_S, margin=0.05, refit_every=16)
    for _ in range(16):
        cheap.record(4, 15_000)  # 15 µs, as echo steps cost
    first = cheap.estimate
    assert first.source == "steps" and first.samples == 16  # the first fit comes as ever
    steps_for_the_budget = math.ceil(REFIT_AFTER_MS / 0.015)
    for _ in range(steps_for_the_budget - 1):
        cheap.record(4, 15_000)
    assert cheap.estimate is first  # 16 steps and more since, but under REFIT_AFTER_MS of them
    cheap.record(4, 15_000)
    assert cheap.estimate is not first and cheap.estimate.samples == 16 + steps_for_the_budget
    dear = CapacityEstimator(128, FRAME_S, margin=0.05, refit_every=16)
    fits = []
    for step in range(64):
        dear.record(30, int(gpu_like(30) * 1e9))
        fits.append(dear.estimate)
    assert len({id(estimate) for estimate in fits}) == 5  # none, then one fit per 16 steps

