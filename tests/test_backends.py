"""The echo and synthetic backends, stepped the way the scheduler thread steps them."""

from __future__ import annotations


import numpy as np
import pytest

from duplexrt.backends import BackendInfo, SlotSession
from duplexrt.backends.echo import EchoBackend
from duplexrt.backends.synthetic import SyntheticBackend, expected_output, marker_tones

SLOTS = 8
FRAME = 1920
RATE = 24000


def info(name: str) -> BackendInfo:
    return BackendInfo(name=name, sample_rate=RATE, frame_size=FRAME, slots=SLOTS)


class Stepper:
    """Steps a backend through preallocated batch buffers, as the scheduler thread does."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.rows = np.zeros(SLOTS, dtype=np.int64)
        self.inputs = np.zeros((SLOTS, FRAME), dtype=np.float32)
        self.outputs = np.zeros((SLOTS, FRAME), dtype=np.float32)
        # Garbage in the output buffer must never leak into a result.
        self.outputs[...] = np.nan

    def step(self, slots: list[int], frames: list[np.ndarray]) -> dict[int, np.ndarray]:
        n = len(slots)
        rows = self.rows[:n]
        rows[:] = slots
        for i, frame in enumerate(frames):
            self.inputs[i] = frame
        outputs = self.outputs[:n]
        result = self.backend.step(rows, self.inputs[:n], outputs)
        assert result is None
        return {slot: outputs[i].copy() for i, slot in enumerate(slots)}


def random_frame(rng: np.random.Generator) -> np.ndarray:
    return rng.uniform(-1.0, 1.0, FRAME).astype(np.float32)


def random_subset(rng: np.random.Generator, slots=range(SLOTS)) -> list[int]:
    slots = list(slots)
    size = int(rng.integers(1, len(slots) + 1))
    return sorted(int(s) for s in rng.choice(slots, size=size, replace=False))


ZEROS = np.zeros(FRAME, dtype=np.float32)


# -- echo ----------------------------------------------------------------------------------------


def echo(delay: int) -> tuple[EchoBackend, Stepper]:
    backend = EchoBackend(info("echo"), {"delay_frames": delay})
    for slot in range(SLOTS):
        backend.open_slot(slot, SlotSession(session_id=slot + 1))
    return backend, Stepper(backend)


@pytest.mark.parametrize("delay", [1, 2, 3, 5])
def test_echo_gives_delay_frames_of_silence_then_inputs_in_order(delay):
    rng = np.random.default_rng(delay)
    _, stepper = echo(delay)
    inputs = [random_frame(rng) for _ in range(delay + 6)]
    outputs = [stepper.step([3], [frame])[3] for frame in inputs]
    for out in outputs[:delay]:
        assert np.array_equal(out, ZEROS)
    for out, frame in zip(outputs[delay:], inputs):
        assert np.array_equal(out, frame)


def test_echo_default_delay_is_two_frames():
    rng = np.random.default_rng(0)
    backend = EchoBackend(info("echo"), {})
    backend.open_slot(0, SlotSession(1))
    stepper = Stepper(backend)
    first, second, third = (random_frame(rng) for _ in range(3))
    assert np.array_equal(stepper.step([0], [first])[0], ZEROS)
    assert np.array_equal(stepper.step([0], [second])[0], ZEROS)
    assert np.array_equal(stepper.step([0], [third])[0], first)


@pytest.mark.parametrize("delay", [1, 3])
def test_echo_slots_are_independent_across_random_subsets(delay):
    rng = np.random.default_rng(100 + delay)
    _, stepper = echo(delay)
    history: dict[int, list[np.ndarray]] = {slot: [] for slot in range(SLOTS)}
    for _ in range(60):
        slots = random_subset(rng)
        frames = [random_frame(rng) for _ in slots]
        outputs = stepper.step(slots, frames)
        for slot, frame in zip(slots, frames):
            past = history[slot]
            expected = past[-delay] if len(past) >= delay else ZEROS
            assert np.array_equal(outputs[slot], expected), (slot, len(past))
            past.append(frame)


def test_echo_interleaved_single_rows_do_not_disturb_each_other():
    rng = np.random.default_rng(1)
    _, stepper = echo(2)
    a = [random_frame(rng) for _ in range(4)]
    b = [random_frame(rng) for _ in range(4)]
    got_a, got_b = [], []
    # a, b, b, a, a, b, b, a: each slot advances only when it is stepped.
    for slot, frames, got in [(0, a, got_a), (5, b, got_b), (5, b, got_b), (0, a, got_a),
                              (0, a, got_a), (5, b, got_b), (5, b, got_b), (0, a, got_a)]:
        got.append(stepper.step([slot], [frames[len(got)]])[slot])
    for got, frames in [(got_a, a), (got_b, b)]:
        assert np.array_equal(got[0], ZEROS) and np.array_equal(got[1], ZEROS)
        assert np.array_equal(got[2], frames[0])
        assert np.array_equal(got[3], frames[1])


def test_echo_opening_a_slot_resets_only_that_slot():
    rng = np.random.default_rng(2)
    backend, stepper = echo(2)
    a = [random_frame(rng) for _ in range(6)]
    b = [random_frame(rng) for _ in range(6)]
    for i in range(3):
        stepper.step([1, 2], [a[i], b[i]])
    backend.open_slot(2, SlotSession(session_id=99))
    # Slot 1 carries on from its history; slot 2 starts again with silence.
    out = stepper.step([1, 2], [a[3], b[3]])
    assert np.array_equal(out[1], a[1])
    assert np.array_equal(out[2], ZEROS)
    out = stepper.step([1, 2], [a[4], b[4]])
    assert np.array_equal(out[1], a[2])
    assert np.array_equal(out[2], ZEROS)
    out = stepper.step([1, 2], [a[5], b[5]])
    assert np.array_equal(out[1], a[3])
    assert np.array_equal(out[2], b[3])


def test_echo_reopen_after_partial_delay_line_still_gives_full_silence():
    rng = np.random.default_rng(3)
    backend, stepper = echo(3)
    first = [random_frame(rng) for _ in range(2)]
    for frame in first:  # the delay line is partly filled and its position is mid-way
        stepper.step([4], [frame])
    backend.close_slot(4)
    backend.open_slot(4, SlotSession(session_id=7))
    fresh = [random_frame(rng) for _ in range(4)]
    outputs = [stepper.step([4], [frame])[4] for frame in fresh]
    for out in outputs[:3]:
        assert np.array_equal(out, ZEROS)
    assert np.array_equal(outputs[3], fresh[0])


def test_echo_delay_zero_is_identity():
    rng = np.random.default_rng(4)
    _, stepper = echo(0)
    for _ in range(10):
        slots = random_subset(rng)
        frames = [random_frame(rng) for _ in slots]
        outputs = stepper.step(slots, frames)
        for slot, frame in zip(slots, frames):
            assert np.array_equal(outputs[slot], frame)


def test_echo_writes_only_the_rows_it_steps():
    rng = np.random.default_rng(5)
    _, stepper = echo(1)
    stepper.outputs[...] = 7.0
    stepper.step([0, 6], [random_frame(rng), random_frame(rng)])
    assert np.all(stepper.outputs[2:] == 7.0)


# -- synthetic ---------------------------------------------------------------------------------------


def synthetic(session_ids: dict[int, int]) -> tuple[SyntheticBackend, Stepper]:
    backend = SyntheticBackend(info("synthetic"), {})
    for slot, session_id in session_ids.items():
        backend.open_slot(slot, SlotSession(session_id=session_id))
    return backend, Stepper(backend)


TONES = marker_tones(RATE, FRAME)


def test_synthetic_uses_the_published_marker_table():
    backend, _ = synthetic({})
    assert np.array_equal(backend.tones, TONES)
    assert backend.tones.dtype == np.float32


def test_synthetic_output_matches_expected_output_bit_for_bit_across_random_subsets():
    rng = np.random.default_rng(10)
    sessions = {slot: 1000 + 13 * slot for slot in range(SLOTS)}
    _, stepper = synthetic(sessions)
    frame_index = dict.fromkeys(sessions, 0)
    for _ in range(80):
        slots = random_subset(rng)
        frames = [random_frame(rng) for _ in slots]
        outputs = stepper.step(slots, frames)
        for slot, frame in zip(slots, frames):
            expected = expected_output(frame, sessions[slot], frame_index[slot], TONES)
            assert expected.dtype == np.float32
            assert np.array_equal(outputs[slot], expected), (slot, frame_index[slot])
            frame_index[slot] += 1


def test_synthetic_frame_index_counts_only_steps_of_that_slot():
    rng = np.random.default_rng(11)
    _, stepper = synthetic({0: 5, 3: 6})
    frames = [random_frame(rng) for _ in range(5)]
    # Slot 3 is stepped five times alone, then slot 0 gets its first frame.
    for i, frame in enumerate(frames):
        out = stepper.step([3], [frame])[3]
        assert np.array_equal(out, expected_output(frame, 6, i, TONES))
    out = stepper.step([0, 3], [frames[0], frames[0]])
    assert np.array_equal(out[0], expected_output(frames[0], 5, 0, TONES))
    assert np.array_equal(out[3], expected_output(frames[0], 6, 5, TONES))


def test_synthetic_reopening_a_slot_restarts_its_frame_index():
    rng = np.random.default_rng(12)
    backend, stepper = synthetic({2: 40, 5: 41})
    for _ in range(7):
        stepper.step([2, 5], [random_frame(rng), random_frame(rng)])
    backend.close_slot(2)
    backend.open_slot(2, SlotSession(session_id=77))
    frame = random_frame(rng)
    out = stepper.step([2, 5], [frame, frame])
    assert np.array_equal(out[2], expected_output(frame, 77, 0, TONES))
    assert np.array_equal(out[5], expected_output(frame, 41, 7, TONES))


def test_synthetic_reopening_without_close_also_restarts():
    rng = np.random.default_rng(13)
    backend, stepper = synthetic({1: 3})
    for _ in range(4):
        stepper.step([1], [random_frame(rng)])
    backend.open_slot(1, SlotSession(session_id=3))
    frame = random_frame(rng)
    assert np.array_equal(stepper.step([1], [frame])[1], expected_output(frame, 3, 0, TONES))


def test_synthetic_neighbouring_sessions_get_different_markers():
    _, stepper = synthetic({0: 1, 1: 2, 2: 3})
    out = stepper.step([0, 1, 2], [ZEROS, ZEROS, ZEROS])
    assert not np.array_equal(out[0], out[1])
    assert not np.array_equal(out[1], out[2])
    assert not np.array_equal(out[0], out[2])
    # With silent input, the output is the marker tone itself.
    for slot, session_id in ((0, 1), (1, 2), (2, 3)):
        assert np.array_equal(out[slot], expected_output(ZEROS, session_id, 0, TONES))
        assert np.any(out[slot] != 0)


def test_synthetic_neighbouring_frames_get_different_markers():
    _, stepper = synthetic({4: 9})
    first = stepper.step([4], [ZEROS])[4]
    second = stepper.step([4], [ZEROS])[4]
    assert not np.array_equal(first, second)


def test_synthetic_output_depends_on_input():
    rng = np.random.default_rng(14)
    _, stepper = synthetic({0: 1, 1: 1})
    frame = random_frame(rng)
    out = stepper.step([0, 1], [frame, ZEROS])
    # Same session id and frame index: the difference is the scaled input alone.
    assert np.allclose(out[0] - out[1], frame * 0.5, atol=1e-6)
    assert not np.array_equal(out[0], out[1])
