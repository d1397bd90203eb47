"""G.711 mu-law / A-law: standard code points, round trips, and audioop as a reference."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from duplexrt.audio import g711

ALL_CODES = np.arange(256, dtype=np.uint8)
ALL_INT16 = np.arange(-32768, 32768, dtype=np.int32).astype(np.int16)
# Every int16 value as a float that the encoder maps back to exactly that int16.
ALL_INT16_AS_FLOAT = (ALL_INT16 / 32768.0).astype(np.float32)

LAWS = {
    "ulaw": (g711.ulaw_encode, g711.ulaw_decode),
    "alaw": (g711.alaw_encode, g711.alaw_decode),
}


def as_int16(samples: np.ndarray) -> np.ndarray:
    linear = samples * 32768.0
    assert np.array_equal(linear, np.round(linear)), "decoded value is not on the int16 grid"
    return linear.astype(np.int32)


@pytest.mark.parametrize(
    ("code", "linear"),
    [(0xFF, 0), (0x7F, 0), (0x00, -32124), (0x80, 32124), (0xFE, 8), (0x7E, -8)],
)
def test_ulaw_known_codes(code: int, linear: int) -> None:
    decoded = g711.ulaw_decode(np.array([code], dtype=np.uint8))
    assert decoded.dtype == np.float32
    assert as_int16(decoded)[0] == linear


@pytest.mark.parametrize(
    ("code", "linear"),
    [(0xD5, 8), (0x55, -8), (0xAA, 32256), (0x2A, -32256), (0xD4, 24), (0x54, -24)],
)
def test_alaw_known_codes(code: int, linear: int) -> None:
    decoded = g711.alaw_decode(np.array([code], dtype=np.uint8))
    assert decoded.dtype == np.float32
    assert as_int16(decoded)[0] == linear


def test_ulaw_encodes_zero_and_extremes() -> None:
    codes = g711.ulaw_encode(np.array([0.0, 1.0, -1.0, 5.0, -5.0], dtype=np.float32))
    assert codes.tolist() == [0xFF, 0x80, 0x00, 0x80, 0x00]


def test_alaw_encodes_zero_and_extremes() -> None:
    codes = g711.alaw_encode(np.array([0.0, 1.0, -1.0, 5.0, -5.0], dtype=np.float32))
    assert codes.tolist() == [0xD5, 0xAA, 0x2A, 0xAA, 0x2A]


@pytest.mark.parametrize("law", LAWS)
def test_decode_range_and_dtype(law: str) -> None:
    _, decode = LAWS[law]
    decoded = decode(ALL_CODES)
    assert decoded.dtype == np.float32
    assert decoded.shape == (256,)
    assert decoded.min() >= -1.0 and decoded.max() < 1.0


def test_ulaw_every_code_round_trips() -> None:
    back = g711.ulaw_encode(g711.ulaw_decode(ALL_CODES))
    expected = ALL_CODES.copy()
    expected[0x7F] = 0xFF  # "negative zero" has no float of its own
    assert np.array_equal(back, expected)


def test_alaw_every_code_round_trips() -> None:
    back = g711.alaw_encode(g711.alaw_decode(ALL_CODES))
    assert np.array_equal(back, ALL_CODES)


@pytest.mark.parametrize("law", LAWS)
def test_encoding_is_monotonic(law: str) -> None:
    encode, decode = LAWS[law]
    sweep = np.linspace(-1.2, 1.2, 100_001, dtype=np.float32)
    reconstructed = decode(encode(sweep))
    assert np.all(np.diff(reconstructed) >= 0)
    # Both signs and every code magnitude are reachable.
    assert len(np.unique(reconstructed)) >= 255


@pytest.mark.parametrize("law", LAWS)
def test_round_trip_error_bound(law: str) -> None:
    encode, decode = LAWS[law]
    sweep = np.linspace(-1.0, 1.0, 200_001, dtype=np.float32)
    error = np.abs(decode(encode(sweep)) - sweep)
    # Logarithmic segments: half a step is at most 1/32 of the magnitude;
    # the absolute term covers the linear segment(s) around zero and the
    # dropped low bits.  Beyond the top decision level the codec saturates.
    inside = np.abs(sweep) < 0.97
    assert np.all(error[inside] <= np.abs(sweep[inside]) / 32 + 16 / 32768)
    assert error.max() < 0.025


@pytest.mark.parametrize("law", LAWS)
def test_encode_clips_out_of_range(law: str) -> None:
    encode, _ = LAWS[law]
    _, decode = LAWS[law]
    big = np.array([1.0, 1.5, 1e9, np.inf], dtype=np.float32)
    levels = decode(np.arange(256, dtype=np.uint8))
    # Out of range saturates at the code of the largest magnitude, not merely at some one code.
    np.testing.assert_array_equal(decode(encode(big)), np.full(4, levels.max(), np.float32))
    np.testing.assert_array_equal(decode(encode(-big)), np.full(4, levels.min(), np.float32))


@pytest.mark.parametrize("law", LAWS)
def test_decode_rejects_non_byte_codes(law: str) -> None:
    _, decode = LAWS[law]
    with pytest.raises(TypeError, match="uint8"):
        decode(np.array([1, 2, 300], dtype=np.int32))


@pytest.mark.parametrize("law", LAWS)
def test_encode_accepts_float64(law: str) -> None:
    encode, _ = LAWS[law]
    samples = np.linspace(-1, 1, 1001)
    assert np.array_equal(encode(samples), encode(samples.astype(np.float32)))


# --- audioop: an independent C implementation shipped with CPython <= 3.12 --

@pytest.fixture(scope="module")
def audioop():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pytest.importorskip("audioop")


@pytest.mark.parametrize(
    ("law", "reference"), [("ulaw", "lin2ulaw"), ("alaw", "lin2alaw")]
)
def test_encode_matches_audioop_for_every_int16(audioop, law: str, reference: str) -> None:
    encode, _ = LAWS[law]
    expected = np.frombuffer(
        getattr(audioop, reference)(ALL_INT16.astype("<i2").tobytes(), 2), dtype=np.uint8
    )
    assert np.array_equal(encode(ALL_INT16_AS_FLOAT), expected)


@pytest.mark.parametrize(
    ("law", "reference"), [("ulaw", "ulaw2lin"), ("alaw", "alaw2lin")]
)
def test_decode_matches_audioop_for_every_code(audioop, law: str, reference: str) -> None:
    _, decode = LAWS[law]
    expected = np.frombuffer(getattr(audioop, reference)(ALL_CODES.tobytes(), 2), dtype="<i2")
    assert np.array_equal(as_int16(decode(ALL_CODES)), expected)
