"""The two private entry points the Realtime VAD calls, and the checks that make them safe.

Per 80 ms append the VAD asks WebRTC's VAD about four windows and takes one real FFT; the public
calls wrap each in Python (``Vad.is_speech``'s argument checks, ``np.fft.rfft``'s normalisation
and axis handling) that costs more than the work itself at these sizes (the VAD's share of a
frame: ``benchmarks/profile_server.py`` on ``/v1/realtime``).  So this module calls
what they wrap: webrtcvad-wheels' C ``process`` with the ``Vad`` object's handle, and numpy's
``rfft_n_even`` ufunc.  Neither is promised by its package, so each is used only if, at import,
it answers exactly as the public call does on a fixed input; otherwise the public call serves,
with the same results.  This is the one module that reads them (tests/test_private_reads.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import webrtcvad

__all__ = ["rfft_rows", "speech_test"]

try:
    from _webrtcvad import process as _process
except ImportError:  # pragma: no cover - another packaging of webrtcvad
    _process = None

try:  # numpy >= 2
    from numpy.fft._pocketfft_umath import rfft_n_even as _rfft_n_even
except ImportError:  # pragma: no cover - numpy 1.x
    _rfft_n_even = None

#: ``(window bytes, rate, samples) -> speech?`` for one ``webrtcvad.Vad``.
SpeechTest = Callable[[memoryview | bytes, int, int], bool]


def speech_test(vad: webrtcvad.Vad) -> SpeechTest:
    """The cheapest call that answers ``vad.is_speech(window, rate)`` for 16-bit mono windows."""
    process = _process
    if process is not None and _C_PROCESS_AGREES:
        handle = vad._vad
        return lambda window, rate, samples: process(handle, rate, window, samples)
    return lambda window, rate, samples: vad.is_speech(window, rate)


def rfft_rows(rows: np.ndarray) -> np.ndarray:
    """``np.fft.rfft(rows, axis=1)`` for a C-contiguous float32 matrix, bit for bit."""
    size = rows.shape[1]
    if _rfft_n_even is None or size % 2 or not _UFUNC_AGREES:
        return np.fft.rfft(rows, axis=1)
    return _rfft_n_even(rows, 1, out=np.empty((rows.shape[0], size // 2 + 1), dtype=np.complex64))


def _c_process_agrees() -> bool:
    if _process is None:
        return False
    try:
        vad = webrtcvad.Vad(3)
        noise = (np.random.default_rng(7).standard_normal(160) * 8000).astype(np.int16)
        for window in (np.zeros(160, np.int16).tobytes(), noise.tobytes()):
            if bool(_process(vad._vad, 8000, window, 160)) != vad.is_speech(window, 8000):
                return False
    except Exception:  # noqa: BLE001 - whatever went wrong, the public call serves
        return False
    return True


def _ufunc_agrees() -> bool:
    if _rfft_n_even is None:
        return False
    try:
        rows = np.random.default_rng(7).standard_normal((2, 240)).astype(np.float32)
        ours = _rfft_n_even(rows, 1, out=np.empty((2, 121), dtype=np.complex64))
        return bool(np.array_equal(ours, np.fft.rfft(rows, axis=1)))
    except Exception:  # noqa: BLE001 - whatever went wrong, the public call serves
        return False


_C_PROCESS_AGREES = _c_process_agrees()
_UFUNC_AGREES = _ufunc_agrees()
