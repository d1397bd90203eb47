"""Steps sized to the active calls (``backend.options.batch = "buckets"``, the default): the bucket
choice and its hysteresis, the calls kept in the lowest rows, and on the tiny seeded Moshi each
call's words and audio against its solo run while others join and leave across every bucket
boundary.

A bucket rounds a row as its batch size does (about one float32 ulp here), so the audio is
compared within ``AUDIO_TOLERANCE`` and the text exactly: a different sampled token would change
the text or move the audio by far more than the tolerance.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.base import BackendInfo, SlotSession  # noqa: E402
from duplexrt.backends.moshi.buckets import BucketChooser, sizes  # noqa: E402
from duplexrt.backends.moshi.row_map import RowMap  # noqa: E402
from duplexrt.config import ConfigError  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

from duplexrt.backends.moshi import MoshiBackend, buckets, rows  # noqa: E402

FRAME = 1920
#: Rounding by batch size: ~1e-7 measured (see the module docstring); a changed token is ~1e-2.
AUDIO_TOLERANCE = 1e-5

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- the choice -------------------------------------------------------------------------------------


def test_bucket_sizes_grow_about_half_again_and_end_at_the_batch():
    assert sizes(1) == (1,)
    assert sizes(8) == (1, 2, 4, 8)
    assert sizes(32) == (1, 2, 4, 8, 16, 24, 32)
    assert sizes(40) == (1, 2, 4, 8, 16, 24, 32, 40)
    assert sizes(100) == (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 100)
    for slots in range(1, 300):
        found = sizes(slots)
        assert found[-1] == slots and list(found) == sorted(set(found))
        assert all(b <= 2 * a for a, b in zip(found, found[1:]))  # a step pays for at most twice its rows
    with pytest.raises(ValueError):
        sizes(0)


def test_the_bucket_grows_at_once_and_shrinks_only_after_a_quiet_spell():
    chooser = BucketChooser(sizes(32), shrink_after=5)
    assert chooser.choose(1) == 1
    assert chooser.choose(3) == 4  # grows on the step that needs it
    assert chooser.choose(17) == 24
    for _ in range(4):
        assert chooser.choose(2) == 24  # a hang-up does not shrink it at once
    assert chooser.choose(17) == 24  # nor does a caller coming back reset anything but the count
    for _ in range(4):
        assert chooser.choose(2) == 24
    assert chooser.choose(2) == 2  # five steps that 2 rows would have covered
    assert chooser.changes == 3
    # A call ringing and hanging up every other step: the bucket stays put, no flapping.
    chooser = BucketChooser(sizes(8), shrink_after=5)
    chooser.choose(4)
    for k in range(40):
        assert chooser.choose(3 if k % 2 else 2) == 4
    assert chooser.changes == 1
    with pytest.raises(ValueError):
        chooser.covering(9)


def test_calls_keep_the_lowest_rows_the_top_one_filling_a_hole():
    rows_ = RowMap(8, dense=True)
    assert [rows_.open(s) for s in (5, 2, 7)] == [0, 1, 2]
    assert rows_.close(5) == (0, 2)  # slot 7's call (row 2) moves into row 0
    assert rows_.row(7) == 0 and rows_.row(2) == 1 and rows_.active == 2
    assert rows_.close(2) == (1, None)  # the top row: nothing moves
    assert rows_.open(3) == 1
    assert rows_.rows_of(np.array([3, 7])).tolist() == [1, 0]
    assert rows_.close(4) == (-1, None)  # no call there: nothing happens
    with pytest.raises(KeyError):
        rows_.row(5)
    with pytest.raises(KeyError):
        rows_.rows_of(np.array([5]))
    fixed = RowMap(8, dense=False)
    assert fixed.open(5) == 5 and fixed.close(5) == (5, None)


# -- the backend ------------------------------------------------------------------------------------


def _backend(slots: int, **options) -> MoshiBackend:
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots), {"tiny": True, "warmup_steps": 1, **options})
    backend.load()
    return backend


def _signal(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


class Calls:
    """Calls on one backend: ``plan`` maps a session id to (slot, first step, its frames); the
    calls join and leave on their steps, and each one's audio and words are kept."""

    def __init__(self, backend: MoshiBackend) -> None:
        self.backend = backend
        self.got: dict[int, tuple[list[np.ndarray], list[str]]] = {}
        self.buckets: list[int] = []

    def run(self, plan: dict[int, tuple[int, int, np.ndarray]], skips: dict[int, set[int]] | None = None) -> None:
        skips = skips or {}
        last = max(start + len(frames) for _, start, frames in plan.values())
        for k in range(last + 1):
            for session, (slot, start, frames) in plan.items():
                if k == start + len(frames):
                    self.backend.close_slot(slot)
            for session, (slot, start, frames) in plan.items():
                if k == start:
                    self.backend.open_slot(slot, SlotSession(session))
                    self.got[session] = ([], [])
            feed = {slot: (session, frames[k - start]) for session, (slot, start, frames) in plan.items()
                    if start <= k < start + len(frames) and k - start not in skips.get(session, set())}
            if not feed:
                continue
            order = np.array(sorted(feed), dtype=np.int64)
            inputs = np.stack([feed[int(s)][1] for s in order])
            outputs = np.full_like(inputs, np.nan)
            texts = self.backend.step(order, inputs, outputs)
            self.buckets.append(self.backend._chooser.current)
            for i, slot in enumerate(order.tolist()):
                audio, words = self.got[feed[slot][0]]
                audio.append(outputs[i].copy())
                words.append(texts[i])


def _solo(backend: MoshiBackend, session: int, frames: np.ndarray, skips: set[int] | None = None):
    calls = Calls(backend)
    calls.run({session: (0, 0, frames)}, {session: skips or set()})
    return calls.got[session]


def _assert_same(got, want, what: str) -> float:
    assert got[1] == want[1], f"{what}: the words differ"
    assert len(got[0]) == len(want[0]), f"{what}: frames missing"
    worst = max((float(np.abs(x - y).max()) for x, y in zip(got[0], want[0])), default=0.0)
    assert worst <= AUDIO_TOLERANCE, f"{what}: the audio differs by {worst:.3g}"
    return worst


def test_buckets_are_the_default_and_each_is_warmed_and_timed():
    backend = _backend(8, warmup_steps=3)
    try:
        assert backend.description["batch"] == "buckets" and backend.description["buckets"] == [1, 2, 4, 8]
        assert [size for size, _ in backend.warmup_costs] == [1, 2, 4, 8]
        assert all(cost > 0 for _, cost in backend.warmup_costs)
        assert backend._row_map.active == 0 and backend._chooser.current == 1  # warm-up left nothing behind
    finally:
        backend.close()
    fixed = _backend(4, batch="fixed")
    try:
        assert fixed.description["batch"] == "fixed" and fixed.description["buckets"] == [4]
    finally:
        fixed.close()


def test_a_bad_batch_option_is_named():
    with pytest.raises(ConfigError, match="backend.options.batch"):
        MoshiBackend(BackendInfo("moshi", 24000, FRAME, 2), {"tiny": True, "batch": "dynamic"})


def test_a_guided_model_keeps_the_fixed_batch_and_says_why(caplog):
    backend = _backend(2, cfg_coef=3.0)
    try:
        assert backend.description["batch"] == "fixed"
        assert any("whole batch" in r.getMessage() for r in caplog.records)
    finally:
        backend.close()


def test_a_field_no_table_places_keeps_the_fixed_batch():
    """A per-row tensor the tables do not list (as a later package might add) is refused, not
    silently left whole in a bucket's view."""
    backend = _backend(2, batch="fixed")
    try:
        table = {k: v for k, v in rows.ROW_FIELDS.items() if k != "previous"}
        with pytest.raises(buckets.BucketsUnsupported, match="previous"):
            buckets.ViewStates({"mimi": backend._mimi, "lm_gen": backend._lm_gen}, 2, (1, 2), row_fields=table)
    finally:
        backend.close()


def test_calls_joining_and_leaving_across_every_bucket_boundary_each_hear_their_solo_run():
    """200 frames of A on 8 slots while seven others join (1 -> 2 -> 4 -> 8 rows) and leave, the
    top row and rows below it, one of them skipping steps; then the bucket shrinks back.  Every
    call's words are its solo run's and its audio within the rounding tolerance."""
    frames = 200
    backend = _backend(8, greedy=False)
    try:
        plan = {
            1: (3, 0, _signal(1, frames)),     # A: the whole time
            2: (0, 10, _signal(2, 60)),        # 2 rows
            3: (5, 20, _signal(3, 20)),        # 3 -> bucket 4; leaves first: below the top
            4: (6, 25, _signal(4, 90)),
            5: (1, 30, _signal(5, 30)),        # 5 -> bucket 8
            6: (2, 31, _signal(6, 5)),         # leaves at the top
            7: (4, 32, _signal(7, 40)),
            8: (7, 33, _signal(8, 12)),        # 8 rows: every row of the batch
        }
        skips = {4: {3, 4, 5, 40}}
        calls = Calls(backend)
        calls.run(plan, skips)
        assert {1, 2, 4, 8} <= set(calls.buckets), "the calls did not cross every bucket"
        assert calls.buckets[-1] < 8, "the bucket never shrank back"
        assert backend._row_map.active == 0
        worst = 0.0
        for session, (_, _, signal) in plan.items():
            solo = _solo(backend, session, signal, skips.get(session))
            worst = max(worst, _assert_same(calls.got[session], solo, f"call {session}"))
        print(f"largest audio difference against the solo runs: {worst:.3g}")
    finally:
        backend.close()


def test_a_storm_of_64_calls_joining_and_leaving_mixes_no_rows_and_holds_no_slot():
    """64 calls of 2-10 frames on 8 slots, ringing over 13 steps (one second of frames) and
    hanging up as they end: each one's words and audio are its solo run's, and afterwards every
    row is free and the next call is a fresh one."""
    rng = np.random.default_rng(64)
    backend = _backend(8)
    try:
        free = list(range(8))
        plan: dict[int, tuple[int, int, np.ndarray]] = {}
        ends: dict[int, list[int]] = {}
        session, step = 100, 0
        while session < 164:
            for slot in ends.pop(step, []):
                free.append(slot)
            while free and session < 164 and rng.random() < 0.8:
                slot = free.pop(int(rng.integers(len(free))))
                length = int(rng.integers(2, 11))
                plan[session] = (slot, step, _signal(session, length))
                ends.setdefault(step + length, []).append(slot)
                session += 1
            step += 1
        calls = Calls(backend)
        calls.run(plan)
        assert backend._row_map.active == 0
        for session, (_, _, signal) in plan.items():
            _assert_same(calls.got[session], _solo(backend, session, signal), f"call {session}")
        after = _signal(500, 4)
        fresh = _backend(8)
        try:
            _assert_same(_solo(backend, 500, after), _solo(fresh, 500, after), "the call after the storm")
        finally:
            fresh.close()
    finally:
        backend.close()


def test_ending_a_call_that_has_left_is_ignored():
    backend = _backend(2)
    try:
        backend.open_slot(1, SlotSession(3))
        backend.close_slot(1)
        backend.end_input(1)  # a flush mark racing the hang-up: nothing to end, no error
        assert not backend._ending.any()
        with pytest.raises(RuntimeError, match="lowest rows"):
            backend.move_row(1, 0)
    finally:
        backend.close()


def test_a_step_that_fails_inside_the_model_leaves_the_batch_s_own_state_on_the_modules(monkeypatch):
    """The model raises mid-step (as a device error would): the bucket's states come off the
    modules all the same, and the calls go on from the batch's own state."""
    backend = _backend(4)
    try:
        own = backend._lm_gen._streaming_state
        signal = _signal(3, 6)
        backend.open_slot(2, SlotSession(5))
        backend.open_slot(0, SlotSession(6))
        order = np.array([0, 2], dtype=np.int64)
        out = np.empty((2, FRAME), dtype=np.float32)
        backend.step(order, np.stack([signal[0], signal[0]]), out)

        def broken(codes):
            raise RuntimeError("device lost")

        monkeypatch.setattr(backend._lm_gen, "step", broken)
        with pytest.raises(RuntimeError, match="device lost"):
            backend.step(order, np.stack([signal[1], signal[1]]), out)
        monkeypatch.undo()
        assert backend._lm_gen._streaming_state is own
        assert backend._lm_gen.lm_model.transformer._streaming_state.batch_size == 4
        backend.step(order, np.stack([signal[1], signal[1]]), out)
        assert np.isfinite(out).all()
    finally:
        backend.close()


def test_buckets_whose_graphs_do_not_fit_leave_the_fixed_batch_serving(monkeypatch, caplog):
    """FAKE: no GPU here, so the out-of-memory a bucket's CUDA graphs would raise at load is
    raised by the warm-up itself.  The backend says so and serves every slot as the fixed batch."""

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (fake)")

    monkeypatch.setattr(buckets, "time_buckets", no_room)
    backend = _backend(4, warmup_steps=2)
    try:
        assert backend.description["batch"] == "fixed" and backend.description["buckets"] == [4]
        assert any("CUDA graphs do not fit" in r.getMessage() for r in caplog.records)
        assert backend.paid_rows(3) == 3 and backend.stepped_rows is None
        signal = _signal(9, 3)
        calls = Calls(backend)
        calls.run({1: (3, 0, signal), 2: (1, 1, signal)})
        assert len(calls.got[1][0]) == 3 and backend._row_map.row(3) == 3  # row = slot again
    finally:
        backend.close()
