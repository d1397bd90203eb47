"""Real speech for the VAD tests, synthesised offline by espeak-ng at test time.

No recording is shipped: espeak-ng (GPL, a Debian package) is run when the tests are, and a test
that needs it is skipped, saying why, where it is absent.  ``.ci/run`` installs it in CI.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import wave

import numpy as np
import pytest

TEXT = "Hello there. How are you doing today? I would like to book a table for two."


def speech_24k() -> np.ndarray:
    """About four seconds of speech, int16 at 24 kHz."""
    import soxr

    if shutil.which("espeak-ng") is None:
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng; .ci/run installs it)")
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/speech.wav"
        subprocess.run(["espeak-ng", "-w", path, TEXT], check=True, timeout=60)
        with wave.open(path) as wav:
            rate = wav.getframerate()
            samples = np.frombuffer(wav.readframes(wav.getnframes()), dtype="<i2")
    resampled = soxr.resample(samples.astype(np.float32) / 32768, rate, 24000)
    return (np.clip(resampled, -1, 1) * 32767).astype("<i2")
