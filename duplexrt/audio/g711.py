"""ITU-T G.711 mu-law and A-law, vectorised with numpy lookup tables.

Telephony gateways (SIP trunks, Twilio-style media streams) speak 8 kHz G.711,
so every such session runs these on every message.  Both directions are a
single ``take`` on a table that is computed once at import:

* decoding indexes a 256-entry table of float32 samples by the 8-bit code;
* encoding first quantises floats to int16 and then indexes a 65536-entry
  table of codes by the int16 bit pattern.  64 KiB per law is cheap, and it
  turns the segment search of the standard into one memory lookup per sample.

The tables themselves are built with vectorised integer arithmetic that
follows the segment/mantissa layout of G.711.  The standard defines mu-law on
14-bit and A-law on 13-bit linear samples; 16-bit input is reduced by an
arithmetic right shift (dropping the low bits), as the classic reference
implementations do; the tests check that our codes match CPython's
``audioop`` for every int16 input.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ._pcm import INT16_SCALE, float_to_int16

__all__ = ["alaw_decode", "alaw_encode", "ulaw_decode", "ulaw_encode"]

_CODES = np.arange(256, dtype=np.int32)
# Every int16 value, in the order of its uint16 bit pattern, so that the
# encoding tables can be indexed with ``int16_array.view(np.uint16)``.
_ALL_INT16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.int16).astype(np.int32)

# --- mu-law ---------------------------------------------------------------
_ULAW_BIAS = 0x84  # 132: offset that makes the segments exact powers of two
_ULAW_CLIP = 8159  # largest 14-bit magnitude the code space represents
# Upper bound (inclusive) of each segment for biased 14-bit magnitudes.
_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])


def _ulaw_code_to_int16(codes: np.ndarray) -> np.ndarray:
    # Codes are transmitted with all bits inverted (keeps idle lines busy).
    inverted = ~codes & 0xFF
    segment = (inverted >> 4) & 0x07
    mantissa = inverted & 0x0F
    magnitude = (((mantissa << 3) + _ULAW_BIAS) << segment) - _ULAW_BIAS
    return np.where(inverted & 0x80, -magnitude, magnitude)


def _int16_to_ulaw_code(linear: np.ndarray) -> np.ndarray:
    value = linear >> 2  # 16 -> 14 bit
    negative = value < 0
    magnitude = np.minimum(np.abs(value), _ULAW_CLIP) + (_ULAW_BIAS >> 2)
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    mantissa = (magnitude >> (segment + 1)) & 0x0F
    # A clipped magnitude lands just past the last segment: use the top code.
    overflow = segment > 7
    segment = np.where(overflow, 7, segment)
    mantissa = np.where(overflow, 0x0F, mantissa)
    mask = np.where(negative, 0x7F, 0xFF)
    return (((segment << 4) | mantissa) ^ mask).astype(np.uint8)


# --- A-law ----------------------------------------------------------------
# Upper bound (inclusive) of each segment for 13-bit magnitudes.
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _alaw_code_to_int16(codes: np.ndarray) -> np.ndarray:
    # Even bits are inverted on the wire (0x55), and the sign bit set = positive.
    toggled = codes ^ 0x55
    segment = (toggled >> 4) & 0x07
    mantissa = toggled & 0x0F
    # Reconstruct at the middle of the quantisation interval (the "+1").
    magnitude = np.where(
        segment == 0,
        ((mantissa << 1) + 1) << 3,
        ((mantissa << 1) + 1 + 32) << (segment + 2),
    )
    return np.where(toggled & 0x80, magnitude, -magnitude)


def _int16_to_alaw_code(linear: np.ndarray) -> np.ndarray:
    value = linear >> 3  # 16 -> 13 bit
    negative = value < 0
    # One's complement magnitude keeps the two halves of the scale symmetric.
    magnitude = np.where(negative, -value - 1, value)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)
    shift = np.where(segment < 2, 1, segment)
    mantissa = (magnitude >> shift) & 0x0F
    mask = np.where(negative, 0x55, 0xD5)
    return (((segment << 4) | mantissa) ^ mask).astype(np.uint8)


def _decode_table(code_to_int16: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    table = (code_to_int16(_CODES) / INT16_SCALE).astype(np.float32)
    table.flags.writeable = False
    return table


def _encode_table(int16_to_code: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    table = int16_to_code(_ALL_INT16)
    table.flags.writeable = False
    return table


_ULAW_TO_FLOAT = _decode_table(_ulaw_code_to_int16)
_ALAW_TO_FLOAT = _decode_table(_alaw_code_to_int16)
_INT16_TO_ULAW = _encode_table(_int16_to_ulaw_code)
_INT16_TO_ALAW = _encode_table(_int16_to_alaw_code)


def _check_codes(codes: np.ndarray) -> None:
    # Any other integer dtype could index past the 256-entry table (or wrap
    # silently for negatives), so insist on bytes rather than guess.
    if codes.dtype != np.uint8:
        raise TypeError(f"G.711 codes must be a uint8 array, got dtype {codes.dtype}")


def ulaw_decode(codes: np.ndarray) -> np.ndarray:
    """Decode mu-law bytes (uint8 array) to float32 samples in [-1, 1)."""
    _check_codes(codes)
    return _ULAW_TO_FLOAT.take(codes)


def ulaw_encode(samples: np.ndarray) -> np.ndarray:
    """Encode float samples to mu-law bytes (uint8); input beyond [-1, 1) is clipped."""
    return _INT16_TO_ULAW.take(float_to_int16(samples).view(np.uint16))


def alaw_decode(codes: np.ndarray) -> np.ndarray:
    """Decode A-law bytes (uint8 array) to float32 samples in [-1, 1)."""
    _check_codes(codes)
    return _ALAW_TO_FLOAT.take(codes)


def alaw_encode(samples: np.ndarray) -> np.ndarray:
    """Encode float samples to A-law bytes (uint8); input beyond [-1, 1) is clipped."""
    return _INT16_TO_ALAW.take(float_to_int16(samples).view(np.uint16))
