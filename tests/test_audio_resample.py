"""StreamResampler: continuity across calls, frequency preservation, lengths."""

from __future__ import annotations

import numpy as np
import pytest

from duplexrt.audio import StreamResampler

INPUT_RATES = (8000, 16000, 44100, 48000)


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def random_cuts(rng: np.random.Generator, length: int, max_chunk: int) -> list[tuple[int, int]]:
    cuts = [0]
    while cuts[-1] < length:
        cuts.append(min(length, cuts[-1] + int(rng.integers(0, max_chunk))))
    return list(zip(cuts[:-1], cuts[1:]))


def run_whole(resampler: StreamResampler, signal: np.ndarray) -> np.ndarray:
    return np.concatenate([resampler.process(signal), resampler.flush()])


def run_chunked(resampler: StreamResampler, signal: np.ndarray, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    parts = [resampler.process(signal[a:b]) for a, b in random_cuts(rng, len(signal), 3000)]
    return np.concatenate([*parts, resampler.flush()])


def sine_fit_residual(samples: np.ndarray, freq: float, rate: int) -> float:
    """Relative energy left after removing the best-fitting sine of ``freq``.

    Fitting both sin and cos makes the check independent of the filter delay.
    """
    t = np.arange(len(samples)) / rate
    basis = np.stack([np.sin(2 * np.pi * freq * t), np.cos(2 * np.pi * freq * t)], axis=1)
    coef, *_ = np.linalg.lstsq(basis, samples.astype(np.float64), rcond=None)
    residual = samples - basis @ coef
    return float(np.sum(residual**2) / np.sum(samples.astype(np.float64) ** 2))


@pytest.mark.parametrize(
    ("in_rate", "out_rate"),
    [(8000, 24000), (16000, 24000), (44100, 24000), (48000, 24000), (24000, 8000), (24000, 44100)],
)
def test_chunked_output_is_identical_to_whole(in_rate: int, out_rate: int) -> None:
    signal = np.random.default_rng(1).standard_normal(in_rate).astype(np.float32) * 0.1
    whole = run_whole(StreamResampler(in_rate, out_rate), signal)
    chunked = run_chunked(StreamResampler(in_rate, out_rate), signal, seed=in_rate + out_rate)
    # soxr keeps its full state between calls: the result is bit-identical.
    assert np.array_equal(chunked, whole)


@pytest.mark.parametrize("in_rate", INPUT_RATES)
def test_sine_stays_a_sine_at_24k(in_rate: int) -> None:
    out = run_whole(StreamResampler(in_rate, 24000), sine(1000, in_rate, 1.0))
    assert out.dtype == np.float32
    # Length after flush is the exact ratio, give or take rounding.
    assert abs(len(out) - 24000) <= 2

    steady = out[1200:-1200]  # skip filter warm-up and tail
    spectrum = np.abs(np.fft.rfft(steady * np.hanning(len(steady))))
    peak_hz = np.argmax(spectrum) * 24000 / len(steady)
    assert abs(peak_hz - 1000) < 2
    assert sine_fit_residual(steady, 1000, 24000) < 1e-4
    assert np.max(np.abs(steady)) == pytest.approx(0.5, abs=0.01)


@pytest.mark.parametrize(("in_rate", "out_rate"), [(24000, 8000), (24000, 16000), (48000, 24000)])
def test_downsampling_rejects_content_above_new_nyquist(in_rate: int, out_rate: int) -> None:
    # A tone between the two Nyquist frequencies must be filtered out, not
    # folded back into the audible band.
    tone = sine((in_rate + out_rate) / 4, in_rate, 0.5)
    out = run_whole(StreamResampler(in_rate, out_rate), tone)
    steady = out[out_rate // 20 : -out_rate // 20]
    assert np.sqrt(np.mean(steady**2)) < 1e-3


@pytest.mark.parametrize(("in_rate", "out_rate"), [(24000, 8000), (24000, 48000), (16000, 44100)])
def test_output_length_matches_ratio(in_rate: int, out_rate: int) -> None:
    resampler = StreamResampler(in_rate, out_rate)
    for seconds in (0.33, 1.0):
        n = int(in_rate * seconds)
        out = run_chunked(resampler, np.zeros(n, dtype=np.float32), seed=n)
        assert abs(len(out) - n * out_rate / in_rate) <= 2


def test_identity_rate_passes_input_through() -> None:
    resampler = StreamResampler(24000, 24000)
    samples = np.ones(100, dtype=np.float32)
    assert resampler.is_identity
    assert resampler.process(samples) is samples
    assert resampler.flush().size == 0
    assert resampler.delay == 0.0


def test_identity_rate_still_returns_float32() -> None:
    out = StreamResampler(16000, 16000).process(np.ones(10, dtype=np.float64))
    assert out.dtype == np.float32


def test_float64_input_is_accepted() -> None:
    signal = sine(440, 16000, 0.2)
    a = run_whole(StreamResampler(16000, 24000), signal)
    b = run_whole(StreamResampler(16000, 24000), signal.astype(np.float64))
    assert b.dtype == np.float32
    assert np.array_equal(a, b)


def test_flush_resets_for_a_new_stream() -> None:
    resampler = StreamResampler(16000, 24000)
    signal = sine(440, 16000, 0.2)
    first = run_whole(resampler, signal)
    second = run_whole(resampler, signal)
    assert np.array_equal(first, second)


def test_empty_chunks_are_harmless() -> None:
    resampler = StreamResampler(8000, 24000)
    assert resampler.process(np.zeros(0, dtype=np.float32)).size == 0
    signal = sine(300, 8000, 0.1)
    with_empties = np.concatenate(
        [resampler.process(signal[:400]), resampler.process(signal[:0]),
         resampler.process(signal[400:]), resampler.flush()]
    )
    assert np.array_equal(with_empties, run_whole(StreamResampler(8000, 24000), signal))


@pytest.mark.parametrize("bad", [0, -8000, 16000.0, True, "16000"])
def test_invalid_rates_raise(bad: object) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        StreamResampler(bad, 24000)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive integer"):
        StreamResampler(24000, bad)  # type: ignore[arg-type]
