"""What the virtual clients send: deterministic audio, encoded once before the clock starts.

Sending must cost the load generator next to nothing, or it would be measured as the runtime's
cost.  So each format's audio is encoded once into a pool, and a message is a zero-copy slice of
it: session ``s`` reads the pool from its own offset, so no two sessions send the same audio.
Opus is a stateful stream that cannot be sliced; all sessions send one shared, pre-encoded stream.
"""

from __future__ import annotations

import math

import numpy as np

from duplexrt.audio import AudioFormat, AudioSpec, make_encoder

_SESSION_STRIDE = 7919  # a prime: sessions start far apart in the pool


def _pool_signal(samples: int, sample_rate: int, seed: int) -> np.ndarray:
    """Speech-band noise at a moderate level: every codec carries it, and every frame differs."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal(samples + 64)
    kernel = np.hanning(max(3, sample_rate // 4000))
    smooth = np.convolve(noise, kernel / kernel.sum(), mode="same")[:samples]
    return (0.3 * smooth / np.max(np.abs(smooth))).astype(np.float32)


class Workload:
    """The messages each virtual session sends, in order."""

    def __init__(self, spec: AudioSpec, *, model_rate: int, frame_size: int, frames: int,
                 message_ms: float, seed: int = 20261129) -> None:
        self.spec = spec
        self.frames = frames
        wire_rate = spec.sample_rate
        self.total_samples = math.ceil(frames * frame_size * wire_rate / model_rate)
        self.message_samples = max(1, round(message_ms / 1000 * wire_rate))
        self.message_count = math.ceil(self.total_samples / self.message_samples)
        self.message_seconds = self.message_samples / wire_rate
        # A model-rate sample count per message, to find which message completes a frame.
        self.model_samples_per_message = self.message_samples * model_rate / wire_rate
        self.frame_size = frame_size
        self._shared: list[bytes] | None
        if spec.format is AudioFormat.OPUS:
            self._shared = self._encode_opus(seed)
            self.message_count = len(self._shared)
            self._pool = memoryview(b"")  # Opus messages are the shared ones, not pool slices
        else:
            self._shared = None
            # A pool that is not a whole number of frames long, so offsets fall mid-frame.
            self._period = wire_rate + wire_rate // 2 + 13
            signal = _pool_signal(self._period, wire_rate, seed)
            extended = np.concatenate([signal, signal[: self.message_samples]])
            # Encoded at its own rate: no resampling, just the wire representation.
            encoded = make_encoder(AudioSpec.create(spec.format, wire_rate, model_rate=wire_rate), wire_rate)
            self._pool = memoryview(encoded.encode(extended) + encoded.flush())
            width = spec.format.bytes_per_sample
            assert width is not None  # every format but Opus has fixed-size samples
            self._bytes_per_sample = width

    def _encode_opus(self, seed: int) -> list[bytes]:
        wire_rate = self.spec.sample_rate
        signal = _pool_signal(self.total_samples, wire_rate, seed)
        encoder = make_encoder(self.spec, wire_rate)
        messages = []
        for start in range(0, self.total_samples, self.message_samples):
            messages.append(encoder.encode(signal[start:start + self.message_samples]))
        messages.append(encoder.flush())
        return [m for m in messages if m]

    def phase(self, session: int, sessions: int) -> float:
        """Seconds after the start at which paced session ``session`` (of ``sessions``) sends its
        first message.  Live callers arrive at random phases, so the sessions' first messages are
        spread evenly over one message period: the server sees a steady stream, as it would in
        production.  Spread over one model frame instead, with messages of several frames, every
        message of a period would land in its first frame's worth of time, in bursts no real
        crowd of callers makes."""
        return session / sessions * self.message_seconds

    def message(self, session: int, index: int) -> memoryview | bytes:
        """Message ``index`` of session ``session``: a slice of the pool (no copy for PCM)."""
        if self._shared is not None:
            return self._shared[index]
        start_sample = index * self.message_samples
        count = min(self.message_samples, self.total_samples - start_sample)
        offset = (session * _SESSION_STRIDE + start_sample) % self._period
        width = self._bytes_per_sample
        return self._pool[offset * width:(offset + count) * width]

    def messages(self, session: int) -> list[memoryview | bytes]:
        return [self.message(session, i) for i in range(self.message_count)]

    def message_completing_frame(self, frame: int) -> int:
        """Index of the message whose arrival completes input frame ``frame``."""
        last_sample = (frame + 1) * self.frame_size - 1
        return min(self.message_count - 1, int(last_sample // self.model_samples_per_message))
