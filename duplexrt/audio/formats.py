"""Per-session conversion between wire messages and model-rate float32 samples.

A :class:`Decoder` turns each incoming message into float32 mono samples at
the model rate; an :class:`Encoder` does the reverse for outgoing audio.  Both
are built once per session by :func:`make_decoder` / :func:`make_encoder`,
which pick a specialised implementation so that the per-message path carries
no format dispatch and no validation beyond one length check (and for
``pcm_f32le``, the only format that can carry them, a range check):

* ``pcm_f32le`` at the model rate decodes with zero copies (a read-only view
  of the payload) and encodes with a single ``tobytes``.  A message with a NaN
  or infinite sample is refused (AudioFormatError); finite samples outside
  [-1, 1] are clipped, which costs a copy only for such a message;
* ``pcm_s16le`` and G.711 are one vectorised numpy pass each;
* any rate other than the model rate goes through a streaming resampler that
  keeps its state across messages;
* Opus (an Ogg Opus stream, split into messages anywhere) is decoded and
  encoded by sphn (libopus).  It costs one to two orders of magnitude more
  than the others, which is what ``is_encoded`` flags.  Note that sphn keeps
  the GIL while it works, so moving it to a worker thread does not let other
  Python code (the event loop) run in parallel with it.

Decoders and encoders are stateful and not thread-safe: one call at a time
per session, in stream order.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence

import numpy as np
import sphn

from . import g711
from ._pcm import float_to_int16, int16_to_float
from .errors import AudioFormatError, AudioTooLongError
from .framer import Framer
from .resample import StreamResampler
from .spec import (
    OPUS_RATES,
    SUPPORTED_INPUT_RATES,
    AudioFormat,
    AudioSpec,
    check_model_rate,
    check_rate,
)

__all__ = [
    "INLINE_DECODE_SECONDS",
    "OPUS_FRAME_SAMPLES",
    "OPUS_MAX_BYTES_PER_CALL",
    "OPUS_RATES",
    "SUPPORTED_INPUT_RATES",
    "AudioFormat",
    "AudioSpec",
    "Buffer",
    "Decoder",
    "Encoder",
    "make_decoder",
    "make_encoder",
]

Buffer = bytes | bytearray | memoryview

#: Samples per Opus packet we hand to sphn, at the wire rate.  sphn 0.2.1
#: buffers PCM and always encodes 960-sample packets whatever the rate
#: (20 ms at 48 kHz, 40 ms at 24 kHz, 120 ms at 8 kHz), and older sphn
#: releases insisted on exact Opus frame sizes; feeding exactly this size
#: satisfies both, and lets ``flush`` know how much padding completes a packet.
OPUS_FRAME_SAMPLES = 960

#: Largest piece of Ogg data handed to sphn in one call.  sphn 0.2.1 decodes
#: into a buffer of 5 s of PCM and fails ("opus_decode_float: invalid
#: argument", leaving the reader unusable) if one call completes more audio
#: than that, e.g. a client uploading a long recording in one message.  512
#: bytes stay well below 5 s even for silence at 8 kHz (~460 bytes/s) and
#: cost nothing for real-time clients, whose messages are about this size.
OPUS_MAX_BYTES_PER_CALL = 512

#: A PCM or G.711 message carrying more audio than this is worth a worker thread: decoding it
#: (conversion and resampling, numpy and soxr releasing the GIL) costs in proportion to its
#: length, 10-50 times what the 20-100 ms messages of real-time clients cost, and would hold up
#: every session on the trio thread meanwhile; those short messages stay inline.
INLINE_DECODE_SECONDS = 1.0

_LITTLE_ENDIAN = sys.byteorder == "little"
_F32LE = np.dtype("<f4")
_S16LE = np.dtype("<i2")
_U8 = np.dtype(np.uint8)
_EMPTY = np.zeros(0, dtype=np.float32)
_EMPTY.flags.writeable = False
_MIN = np.minimum.reduce
_MAX = np.maximum.reduce


# --- wire bytes -> float32 (payload length already checked) ----------------

#: The top byte of a little-endian float32 (its sign and the exponent's high seven bits) of every
#: value under 0.5 in magnitude, and of no other (0.5 is 0x3F000000; NaN and infinity 0x7F or 0xFF).
_UNDER_HALF = bytes(b for b in range(256) if b & 0x7F < 0x3F)


class _F32FromWire:
    """``pcm_f32le`` to float32 for one decoder: the samples as they are if every one is in
    [-1, 1]; clipped (a copy) if some finite ones are not; AudioFormatError if any is NaN or
    infinite.

    A model fed NaN or infinity keeps it in its state (a KV cache, a convolution buffer) for the
    rest of the session, so such a message is refused outright.  Numpy's reductions over more
    than 500 elements release the GIL and take it back, and each release wakes the scheduler
    thread if it waits for the GIL, only to find it taken again: a voluntary context switch
    (``duplexrt simulate`` reports them per frame; docs/benchmarks.md has the before and after).
    So each sample's top byte is read first, with bytes operations that keep the GIL: a message
    whose samples all stay under 0.5 in magnitude needs nothing more.  A louder one (one byte
    cannot tell 1.0 apart) takes two reductions over the view: min and max propagate NaN, and a
    NaN fails every comparison, so one test catches NaN, infinities and out-of-range values
    alike.  After a loud message the next goes straight to the reductions, until one says the
    audio fell under 0.5 again: a loud stream pays the reductions alone, not both.
    """

    __slots__ = ("_loud",)

    def __init__(self) -> None:
        self._loud = False

    def __call__(self, payload: Buffer) -> np.ndarray:
        # On little-endian hosts '<f4' is the native float32: a view, no copy.
        samples = np.frombuffer(payload, _F32LE)
        if not _LITTLE_ENDIAN:
            samples = samples.astype(np.float32)
        if not samples.size or not self._loud and _all_under_half(payload):
            return samples
        low, high = _MIN(samples), _MAX(samples)
        self._loud = not (-0.5 < low and high < 0.5)
        return samples if -1.0 <= low and high <= 1.0 else _refused_or_clipped(samples)


def _all_under_half(payload: Buffer) -> bool:
    """Whether every sample of a ``pcm_f32le`` payload is finite and under 0.5 in magnitude, from
    a slice and a ``translate`` of its bytes (which keep the GIL)."""
    data = payload if type(payload) is bytes or type(payload) is bytearray else bytes(payload)
    return not data[3::4].translate(None, _UNDER_HALF)


def _refused_or_clipped(samples: np.ndarray) -> np.ndarray:
    """AudioFormatError if a sample is NaN or infinite; else the samples clipped to [-1, 1]."""
    finite = np.isfinite(samples)
    if not finite.all():
        bad = int(samples.size - np.count_nonzero(finite))
        first = int(np.argmin(finite))
        raise AudioFormatError(
            f"pcm_f32le payload holds {bad} NaN or infinite sample{'s' if bad > 1 else ''} "
            f"(the first at sample {first}); samples must be finite, from -1 to 1"
        )
    return np.clip(samples, -1.0, 1.0)


def _s16_from_wire(payload: Buffer) -> np.ndarray:
    return int16_to_float(np.frombuffer(payload, _S16LE))


def _ulaw_from_wire(payload: Buffer) -> np.ndarray:
    return g711.ulaw_decode(np.frombuffer(payload, _U8))


def _alaw_from_wire(payload: Buffer) -> np.ndarray:
    return g711.alaw_decode(np.frombuffer(payload, _U8))


# --- float32 -> wire bytes ------------------------------------------------

def _f32_to_wire(samples: np.ndarray) -> bytes:
    if samples.dtype != _F32LE:
        samples = samples.astype(_F32LE)
    return samples.tobytes()


def _s16_to_wire(samples: np.ndarray) -> bytes:
    linear = float_to_int16(samples)
    return (linear if _LITTLE_ENDIAN else linear.astype(_S16LE)).tobytes()


def _ulaw_to_wire(samples: np.ndarray) -> bytes:
    return g711.ulaw_encode(samples).tobytes()


def _alaw_to_wire(samples: np.ndarray) -> bytes:
    return g711.alaw_encode(samples).tobytes()


_FROM_WIRE: dict[AudioFormat, Callable[[Buffer], np.ndarray]] = {
    AudioFormat.PCM_S16LE: _s16_from_wire,
    AudioFormat.G711_ULAW: _ulaw_from_wire,
    AudioFormat.G711_ALAW: _alaw_from_wire,
}

_TO_WIRE: dict[AudioFormat, Callable[[np.ndarray], bytes]] = {
    AudioFormat.PCM_F32LE: _f32_to_wire,
    AudioFormat.PCM_S16LE: _s16_to_wire,
    AudioFormat.G711_ULAW: _ulaw_to_wire,
    AudioFormat.G711_ALAW: _alaw_to_wire,
}


def _resampler_or_none(in_rate: int, out_rate: int) -> StreamResampler | None:
    # None (rather than an identity resampler) lets the hot path skip even
    # the method call when no conversion is needed.
    return None if in_rate == out_rate else StreamResampler(in_rate, out_rate)


def _validated(spec: AudioSpec, model_rate: int) -> AudioSpec:
    if not isinstance(spec, AudioSpec):
        raise TypeError(f"expected an AudioSpec, got {type(spec).__name__}")
    check_model_rate(model_rate)
    check_rate(spec.format, spec.sample_rate, model_rate)
    return spec


# --- decoding -------------------------------------------------------------

class Decoder:
    """Stateful converter of one session's incoming messages to model samples.

    ``decode`` returns float32 1-D samples at the model rate: possibly empty,
    and not necessarily the length the payload implies (resampler and Opus
    packet buffering hold samples back).  ``flush`` returns what is still
    held at the end of the stream.  Use :func:`make_decoder` to build one.

    With ``max_seconds``, a message carrying more audio than that raises
    AudioTooLongError, before any decoding where the size tells the length.
    """

    __slots__ = ("spec", "model_rate", "_resampler", "max_seconds", "max_samples", "max_bytes",
                 "inline_bytes")

    #: Whether decoding is expensive enough to belong off the event loop.
    is_encoded: bool = False

    def __init__(self, spec: AudioSpec, model_rate: int, max_seconds: float | None = None) -> None:
        self.spec = spec
        self.model_rate = model_rate
        self._resampler = _resampler_or_none(spec.sample_rate, model_rate)
        self.max_seconds = max_seconds
        #: Wire-rate samples one message may carry.
        self.max_samples = sys.maxsize if max_seconds is None else _samples_in(max_seconds, spec.sample_rate)
        #: Payload bytes one message may have (fixed-size samples only; Opus cannot tell).
        self.max_bytes = sys.maxsize
        #: Payloads up to this size are cheap to decode on the event loop (see INLINE_DECODE_SECONDS).
        self.inline_bytes = sys.maxsize

    def decode(self, payload: Buffer) -> np.ndarray:
        """Decode one message (any length, in stream order)."""
        raise NotImplementedError

    def flush(self) -> np.ndarray:
        """Return the samples still held back at the end of the stream."""
        resampler = self._resampler
        return _EMPTY if resampler is None else resampler.flush()

    def too_long(self, size: int) -> AudioTooLongError:
        """The error for a payload of ``size`` bytes over ``max_bytes``."""
        raise NotImplementedError(f"{type(self).__name__} cannot tell a message's length from its size")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec} -> {self.model_rate} Hz)"


class _PcmDecoder(Decoder):
    """Raw PCM and G.711: fixed-size samples, so messages decode independently."""

    __slots__ = ("_sample_bytes", "_from_wire")

    def __init__(self, spec: AudioSpec, model_rate: int, max_seconds: float | None = None) -> None:
        super().__init__(spec, model_rate, max_seconds)
        sample_bytes = spec.format.bytes_per_sample
        if sample_bytes is None:  # Opus: its decoder is _OpusDecoder
            raise ValueError(f"{spec.format.value} has no fixed sample size to decode by")
        self._sample_bytes = sample_bytes
        self._from_wire = _F32FromWire() if spec.format is AudioFormat.PCM_F32LE else _FROM_WIRE[spec.format]
        if max_seconds is not None:
            self.max_bytes = self.max_samples * self._sample_bytes
        inline = _samples_in(INLINE_DECODE_SECONDS, spec.sample_rate) * self._sample_bytes
        self.inline_bytes = min(self.max_bytes, inline)

    def decode(self, payload: Buffer) -> np.ndarray:
        """Decode one message.

        For ``pcm_f32le`` at the model rate the result is a read-only view of
        ``payload`` (zero copy) unless samples had to be clipped: do not modify
        a bytearray payload while the samples are in use.  A payload that is not
        a whole number of samples, or (``pcm_f32le``) holds a NaN or infinite
        sample, raises AudioFormatError and leaves the decoder state untouched.
        """
        # len() of a memoryview counts items, not bytes, if it has a format.
        size = payload.nbytes if type(payload) is memoryview else len(payload)
        if size % self._sample_bytes:
            raise self._length_error(size)
        if size > self.max_bytes:
            raise self.too_long(size)
        samples = self._from_wire(payload)
        resampler = self._resampler
        return samples if resampler is None else resampler.process(samples)

    def _length_error(self, size: int) -> AudioFormatError:
        unit = "byte" if size == 1 else "bytes"
        return AudioFormatError(
            f"{self.spec.format.value} payload of {size} {unit} is not a whole number "
            f"of {self._sample_bytes}-byte samples"
        )

    def too_long(self, size: int) -> AudioTooLongError:
        rate = self.spec.sample_rate
        seconds = size // self._sample_bytes / rate
        return AudioTooLongError(
            f"{self.spec.format.value} message of {size} bytes holds {seconds:.2f} s of audio at "
            f"{rate} Hz; at most {self.max_seconds:g} s per message (audio.max_message_seconds): "
            "send it in smaller pieces"
        )


class _OpusDecoder(Decoder):
    """Ogg Opus stream; message boundaries may fall anywhere, even mid-page."""

    __slots__ = ("_reader", "_failure")

    is_encoded = True

    def __init__(self, spec: AudioSpec, model_rate: int, max_seconds: float | None = None) -> None:
        super().__init__(spec, model_rate, max_seconds)
        self._reader = sphn.OpusStreamReader(spec.sample_rate)
        self._failure: str | None = None

    def decode(self, payload: Buffer) -> np.ndarray:
        """Feed the next piece of the stream; return whatever became decodable.

        A corrupt stream raises AudioFormatError.  An Ogg stream cannot be
        resynchronised without its headers, so the decoder then stays failed
        (every later call raises too) and the client must start a new stream.

        Opus packets say nothing of their length until decoded, and a few bytes
        may hold 120 ms: a message is decoded piece by piece, and one that passes
        ``max_seconds`` is stopped there (AudioTooLongError, ``stream_lost``),
        so neither the time nor the memory spent on it exceed the bound by more
        than one piece.  The stream is then failed, as for a corrupt one (unless
        the bound was only passed by the message's last piece: then its audio is
        dropped and the stream goes on).
        """
        if self._failure is not None:
            raise AudioFormatError(
                f"opus stream already failed ({self._failure}); start a new stream"
            )
        if type(payload) is not bytes:
            payload = bytes(payload)  # sphn only accepts bytes
        append = self._reader.append_bytes
        step = OPUS_MAX_BYTES_PER_CALL
        limit = self.max_samples
        stopped = False  # part of the message was never given to the reader
        try:
            if len(payload) <= step:
                samples = append(payload)
                total = samples.size
            else:
                parts = []
                total = 0
                for i in range(0, len(payload), step):
                    part = append(payload[i : i + step])
                    parts.append(part)
                    total += part.size
                    if total > limit:
                        stopped = i + step < len(payload)
                        break
                samples = np.concatenate(parts)
        except Exception as exc:  # sphn reports every stream error as ValueError
            self._failure = str(exc)
            raise AudioFormatError(f"corrupt Ogg Opus stream: {exc}") from exc
        if total > limit:
            too_long = (f"an Ogg Opus message decodes to more than {self.max_seconds:g} s of audio "
                        "(audio.max_message_seconds)")
            if not stopped:  # the reader took it all: the stream goes on without this audio
                raise AudioTooLongError(f"{too_long}; it was dropped: send audio in smaller messages")
            self._failure = "a message held too much audio"
            raise AudioTooLongError(f"{too_long}; decoding stopped there and the stream cannot go "
                                    "on: send audio in smaller messages", stream_lost=True)
        resampler = self._resampler
        return samples if resampler is None else resampler.process(samples)


def make_decoder(spec: AudioSpec, model_rate: int, max_seconds: float | None = None) -> Decoder:
    """Build the decoder for one session's incoming audio; ``max_seconds`` bounds one message."""
    _validated(spec, model_rate)
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"max_seconds must be positive, got {max_seconds!r}")
    if spec.format is AudioFormat.OPUS:
        return _OpusDecoder(spec, model_rate, max_seconds)
    return _PcmDecoder(spec, model_rate, max_seconds)


def _samples_in(seconds: float, rate: int) -> int:
    # The tolerance keeps a message of exactly ``seconds`` (say 10 s) on the right side.
    return math.floor(seconds * rate + 1e-6)


# --- encoding -------------------------------------------------------------

class Encoder:
    """Stateful converter of model-rate float32 samples to one session's wire format.

    ``encode`` accepts any number of samples and returns the bytes ready so
    far (possibly empty); ``flush`` ends the stream and returns the rest.
    Use :func:`make_encoder` to build one.
    """

    __slots__ = ("spec", "model_rate", "_resampler")

    #: Whether encoding is expensive enough to belong off the event loop.
    is_encoded: bool = False

    def __init__(self, spec: AudioSpec, model_rate: int) -> None:
        self.spec = spec
        self.model_rate = model_rate
        self._resampler = _resampler_or_none(model_rate, spec.sample_rate)

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode the next chunk of model-rate samples."""
        raise NotImplementedError

    def encode_rows(self, rows: Sequence[np.ndarray]) -> bytes:
        """Encode ``rows`` (frames of model output, in order) as one chunk: ``encode`` of them
        joined, without the join where the format allows."""
        return self.encode(rows[0] if len(rows) == 1 else np.concatenate(rows))

    def flush(self) -> bytes:
        """End the stream and return whatever is still held back."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.model_rate} Hz -> {self.spec})"


class _PcmEncoder(Encoder):
    __slots__ = ("_to_wire", "_as_is")

    def __init__(self, spec: AudioSpec, model_rate: int) -> None:
        super().__init__(spec, model_rate)
        self._to_wire = _TO_WIRE[spec.format]
        #: float32 at the model rate on a little-endian host: the wire bytes are the samples'.
        self._as_is = spec.format is AudioFormat.PCM_F32LE and self._resampler is None and _LITTLE_ENDIAN

    def encode_rows(self, rows: Sequence[np.ndarray]) -> bytes:
        if self._as_is:
            return b"".join([row.data for row in rows])  # one copy, where a join and then tobytes made two
        return super().encode_rows(rows)

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode; values outside [-1, 1) are clipped for the integer formats."""
        resampler = self._resampler
        if resampler is not None:
            samples = resampler.process(samples)
        return self._to_wire(samples)

    def flush(self) -> bytes:
        resampler = self._resampler
        return b"" if resampler is None else self._to_wire(resampler.flush())


class _OpusEncoder(Encoder):
    __slots__ = ("_writer", "_framer")

    is_encoded = True

    def __init__(self, spec: AudioSpec, model_rate: int) -> None:
        super().__init__(spec, model_rate)
        self._writer = sphn.OpusStreamWriter(spec.sample_rate)
        self._framer = Framer(OPUS_FRAME_SAMPLES)

    def _write(self, packets: list[np.ndarray]) -> bytes:
        append = self._writer.append_pcm
        if len(packets) == 1:
            return append(packets[0])
        return b"".join([append(packet) for packet in packets])

    def encode(self, samples: np.ndarray) -> bytes:
        """Encode; returns Ogg pages (the first ones carry the stream headers).

        Samples are held until a whole Opus packet is available, so this
        returns b"" until then.
        """
        resampler = self._resampler
        if resampler is not None:
            samples = resampler.process(samples)
        packets = self._framer.push(samples)
        return self._write(packets) if packets else b""

    def flush(self) -> bytes:
        """Encode what is held, zero-padding the last packet; ends the stream."""
        tail = _EMPTY if self._resampler is None else self._resampler.flush()
        packets = self._framer.push(tail)
        last = self._framer.flush()
        if last is not None:
            packets.append(last)
        return self._write(packets) if packets else b""


def make_encoder(spec: AudioSpec, model_rate: int) -> Encoder:
    """Build the encoder for one session's outgoing audio."""
    _validated(spec, model_rate)
    if spec.format is AudioFormat.OPUS:
        return _OpusEncoder(spec, model_rate)
    return _PcmEncoder(spec, model_rate)
