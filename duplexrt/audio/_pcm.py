"""Float <-> 16-bit linear PCM conversion shared by the s16 and G.711 codecs.

Both codecs need exactly the same float -> int16 step (clip, scale, round to
nearest) and keeping it in one place guarantees they quantise identically.
"""

from __future__ import annotations

import numpy as np

__all__ = ["INT16_SCALE", "float_to_int16", "int16_to_float"]

#: Full scale of signed 16-bit PCM: int16 value v means v / 32768 in float.
INT16_SCALE = 32768.0

_SCALE = np.float32(INT16_SCALE)
_INV_SCALE = np.float32(1.0 / INT16_SCALE)
_LOW = np.float32(-32768.0)
_HIGH = np.float32(32767.0)


def float_to_int16(samples: np.ndarray) -> np.ndarray:
    """Quantise float samples (nominally in [-1, 1)) to native int16.

    Scaling first and clipping on the int16 scale means +1.0 maps to 32767
    rather than wrapping to -32768, and rounding to nearest (not truncation)
    halves the quantisation error and keeps the mapping symmetric around zero.
    Works in place on one temporary so a call costs two allocations.  NaN is
    not sanitised (that would cost another pass); numpy warns on the cast.
    """
    scaled = np.multiply(samples, _SCALE)  # float32 in -> float32 temporary
    np.rint(scaled, out=scaled)
    np.clip(scaled, _LOW, _HIGH, out=scaled)
    return scaled.astype(np.int16)


def int16_to_float(linear: np.ndarray) -> np.ndarray:
    """Map int16 samples to float32 in [-1, 1) in one pass (no int->float temp).

    int16 times a float32 scalar promotes to float32, not float64.
    """
    return np.multiply(linear, _INV_SCALE)
