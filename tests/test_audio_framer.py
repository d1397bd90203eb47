"""Framer: exact framing under any chunking, zero-copy views, carry, flush."""

from __future__ import annotations

import numpy as np
import pytest

from duplexrt.audio import Framer

FRAME = 1920


def signal(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize("seed", range(5))
def test_random_chunking_yields_the_signal_cut_in_frames(seed: int) -> None:
    rng = np.random.default_rng(seed)
    data = signal(50_000, seed)
    framer = Framer(FRAME)
    frames: list[np.ndarray] = []
    pos = 0
    while pos < len(data):
        # Mix tiny, frame-sized and multi-frame chunks.
        size = int(rng.choice([rng.integers(0, 50), rng.integers(0, 2 * FRAME), rng.integers(0, 6 * FRAME)]))
        frames += framer.push(data[pos : pos + size])
        pos += size
    whole, rest = divmod(len(data), FRAME)
    assert len(frames) == whole
    for frame in frames:
        assert frame.shape == (FRAME,) and frame.dtype == np.float32
    assert np.array_equal(np.concatenate(frames), data[: whole * FRAME])
    assert framer.pending == rest

    last = framer.flush()
    assert last is not None and last.shape == (FRAME,)
    assert np.array_equal(last[:rest], data[whole * FRAME :])
    assert not last[rest:].any()
    assert framer.pending == 0


def test_whole_frames_without_carry_are_zero_copy_views() -> None:
    chunk = signal(3 * FRAME)
    frames = Framer(FRAME).push(chunk)
    assert len(frames) == 3
    for i, frame in enumerate(frames):
        assert np.shares_memory(frame, chunk)
        assert np.array_equal(frame, chunk[i * FRAME : (i + 1) * FRAME])


def test_single_frame_chunk_is_a_view() -> None:
    chunk = signal(FRAME)
    (frame,) = Framer(FRAME).push(chunk)
    assert np.shares_memory(frame, chunk)


def test_read_only_chunks_are_fine() -> None:
    chunk = signal(2 * FRAME + 5)
    chunk.flags.writeable = False
    framer = Framer(FRAME)
    frames = framer.push(chunk)
    assert len(frames) == 2 and framer.pending == 5


def test_carried_samples_complete_the_next_frame() -> None:
    data = signal(2 * FRAME)
    framer = Framer(FRAME)
    assert framer.push(data[:1000]) == []
    assert framer.pending == 1000
    frames = framer.push(data[1000 : 1000 + FRAME])
    assert framer.pending == 1000
    assert len(frames) == 1
    assert np.array_equal(frames[0], data[:FRAME])
    assert not np.shares_memory(frames[0], data)


def test_frames_with_carry_are_fresh_and_survive_later_pushes() -> None:
    data = signal(10 * FRAME, seed=3)
    framer = Framer(FRAME)
    kept: list[np.ndarray] = []
    # Chunks that never align with frames force every frame through the carry.
    for start in range(0, len(data), 700):
        kept += framer.push(data[start : start + 700].copy())
    assert len(kept) == 10
    for i, frame in enumerate(kept):
        assert np.array_equal(frame, data[i * FRAME : (i + 1) * FRAME])
    # Pushing more must not disturb frames already handed out.
    framer.push(signal(5 * FRAME + 123, seed=4))
    assert np.array_equal(np.concatenate(kept), data)
    fresh = [f for f in kept if not np.shares_memory(f, data)]
    for a in fresh:
        for b in fresh:
            if a is not b:
                assert not np.shares_memory(a, b)


def test_zero_copy_frames_follow_a_carried_frame() -> None:
    data = signal(4 * FRAME + 50)
    framer = Framer(FRAME)
    framer.push(data[:100])
    chunk = data[100:]  # completes the carried frame, then 3 whole frames + 50
    frames = framer.push(chunk)
    assert len(frames) == 4
    assert not np.shares_memory(frames[0], chunk)
    assert all(np.shares_memory(f, chunk) for f in frames[1:])
    assert np.array_equal(np.concatenate(frames), data[: 4 * FRAME])
    assert framer.pending == 50


def test_flush_pads_with_zeros() -> None:
    framer = Framer(8)
    framer.push(np.arange(1, 12, dtype=np.float32))
    assert framer.pending == 3
    last = framer.flush()
    assert last is not None
    assert last.tolist() == [9, 10, 11, 0, 0, 0, 0, 0]
    assert framer.pending == 0
    assert framer.flush() is None


def test_flush_with_nothing_pending() -> None:
    framer = Framer(4)
    assert framer.flush() is None
    framer.push(np.ones(8, dtype=np.float32))
    assert framer.flush() is None


def test_clear_drops_the_carry() -> None:
    framer = Framer(4)
    framer.push(np.ones(3, dtype=np.float32))
    framer.clear()
    assert framer.pending == 0
    frames = framer.push(np.arange(4, dtype=np.float32))
    assert frames[0].tolist() == [0, 1, 2, 3]


def test_empty_push() -> None:
    framer = Framer(4)
    assert framer.push(np.zeros(0, dtype=np.float32)) == []
    assert framer.pending == 0


def test_float64_input_is_converted() -> None:
    frames = Framer(4).push(np.arange(8, dtype=np.float64))
    assert [f.dtype for f in frames] == [np.float32, np.float32]


def test_rejects_multidimensional_input() -> None:
    with pytest.raises(ValueError, match="1-D"):
        Framer(4).push(np.zeros((2, 4), dtype=np.float32))


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_rejects_bad_frame_size(bad: object) -> None:
    with pytest.raises(ValueError, match="frame_size"):
        Framer(bad)  # type: ignore[arg-type]


def test_every_frame_is_float32_carried_or_not() -> None:
    """The model's buffers are float32: a frame completed from a carried remainder must be too,
    not numpy's float64 default."""
    framer = Framer(4)
    frames = framer.push(np.arange(6, dtype=np.float32)) + framer.push(np.arange(6, dtype=np.float32))
    assert len(frames) == 3
    assert [f.dtype for f in frames] == [np.float32] * 3
    last = framer.flush()
    assert last is None or last.dtype == np.float32


def test_a_frame_of_one_sample_is_allowed() -> None:
    framer = Framer(1)
    assert [f.tolist() for f in framer.push(np.array([0.5, -0.5], dtype=np.float32))] == [[0.5], [-0.5]]
