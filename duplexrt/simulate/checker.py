"""The guards: every session's output complete, in order, and with the expected content.

While the run is timed, a receiver only cuts the byte stream into wire frames and keeps a CRC of
each (cheap, and constant memory however long the run), so checking weighs
little on the measurement.  Afterwards the checker rebuilds what each session should have
received — the client's messages, decoded and framed as the server does, run through the
backend's known function, encoded as the server encodes — and compares frame by frame.  Opus output, which has no fixed bytes per frame, is kept
whole and compared after decoding.
"""

from __future__ import annotations

import zlib

import attrs
import numpy as np

from duplexrt.audio import AudioFormat, AudioSpec, Framer, make_decoder, make_encoder
from duplexrt.backends.synthetic import expected_output, marker_tones
from duplexrt.client.protocols import Buffer
from duplexrt.config import Config
from duplexrt.simulate.workload import Workload


def wire_frame_bytes(spec: AudioSpec, model_rate: int, frame_size: int) -> int | None:
    """Bytes one model frame takes on the wire, or None when that is not a fixed number."""
    width = spec.format.bytes_per_sample
    if width is None:
        return None
    samples = frame_size * spec.sample_rate / model_rate
    return int(samples) * width if samples == int(samples) else None


class OutputRecord:
    """What one virtual session received, reduced to a CRC per wire frame (4 bytes a frame, so
    long runs stay small; its CPU is inside what ``benchmarks/core.py`` reports, load generator
    included).  Opus output, which has no
    fixed bytes per frame, is kept whole: it is small."""

    __slots__ = ("frame_bytes", "crcs", "count", "_carry", "chunks", "received_bytes")

    def __init__(self, frame_bytes: int | None, frames: int) -> None:
        self.frame_bytes = frame_bytes
        #: One CRC per whole wire frame (none kept for Opus, which is kept whole in ``chunks``).
        self.crcs = np.zeros(frames + 8 if frame_bytes else 0, dtype=np.uint32)
        self.count = 0
        self._carry = b""
        self.chunks: list[Buffer] = []
        self.received_bytes = 0

    def add(self, data: Buffer) -> int:
        """Take one audio message; returns how many whole wire frames it completed."""
        self.received_bytes += len(data)
        size = self.frame_bytes
        if size is None:
            self.chunks.append(data)
            return 0
        if len(data) == size and not self._carry:  # nearly every message: one whole frame
            count = self.count
            if count < len(self.crcs):
                self.crcs[count] = zlib.crc32(data)
                self.count = count + 1
                return 1
        if self._carry:
            data = self._carry + data
        whole = len(data) // size
        crcs = self.crcs
        base = self.count
        if base + whole > len(crcs):
            crcs = self.crcs = np.concatenate([crcs, np.zeros(base + whole, dtype=np.uint32)])
        view = memoryview(data)
        for j in range(whole):
            crcs[base + j] = zlib.crc32(view[j * size:(j + 1) * size])
        self.count = base + whole
        self._carry = bytes(view[whole * size:]) if len(data) > whole * size else b""
        return whole

    @property
    def tail(self) -> bytes:
        """Bytes after the last whole wire frame."""
        return self._carry


@attrs.frozen
class CheckResult:
    sessions: int
    failures: list[str]

    @property
    def ok(self) -> bool:
        return not self.failures


class Checker:
    """Knows what the configured backend must return, for backends whose output is a known
    function of their input (``echo`` and ``synthetic``); for any other it checks counts only."""

    def __init__(self, config: Config, workload: Workload, input_spec: AudioSpec, output_spec: AudioSpec) -> None:
        self.config = config
        self.workload = workload
        self.input_spec = input_spec
        self.output_spec = output_spec
        self.model_rate = config.audio.sample_rate
        self.frame_size = config.audio.frame_size
        self.frame_bytes = wire_frame_bytes(output_spec, self.model_rate, self.frame_size)
        backend = config.backend
        self.checks_content = backend.name in ("echo", "synthetic")
        if backend.name == "echo":
            self._delay = int(backend.options.get("delay_frames", 2))
        if backend.name == "synthetic":
            self._tones = marker_tones(self.model_rate, self.frame_size)
        self._shared_inputs: list[np.ndarray] | None = None

    def new_record(self) -> OutputRecord:
        return OutputRecord(self.frame_bytes, self.workload.frames)

    def model_inputs(self, session: int) -> list[np.ndarray]:
        """The frames the model saw, decoded and framed exactly as the server does it."""
        if self.input_spec.format is AudioFormat.OPUS and self._shared_inputs is not None:
            return self._shared_inputs
        decoder = make_decoder(self.input_spec, self.model_rate)
        framer = Framer(self.frame_size)
        frames: list[np.ndarray] = []
        for message in self.workload.messages(session):
            frames.extend(np.array(f) for f in framer.push(decoder.decode(message)))
        frames.extend(np.array(f) for f in framer.push(decoder.flush()))
        last = framer.flush()
        if last is not None:
            frames.append(last)
        if self.input_spec.format is AudioFormat.OPUS:
            self._shared_inputs = frames
        return frames

    def model_outputs(self, session_id: int, inputs: list[np.ndarray]) -> list[np.ndarray]:
        name = self.config.backend.name
        if name == "echo":
            silence = np.zeros(self.frame_size, dtype=np.float32)
            return [inputs[k - self._delay] if k >= self._delay else silence for k in range(len(inputs))]
        return [expected_output(frame, session_id, k, self._tones) for k, frame in enumerate(inputs)]

    def expected_wire(self, outputs: list[np.ndarray]) -> bytes:
        encoder = make_encoder(self.output_spec, self.model_rate)
        return b"".join(encoder.encode(frame) for frame in outputs) + encoder.flush()

    def check_session(self, session: int, session_id: int, record: OutputRecord,
                      frames_out: int | None) -> list[str]:
        """Problems with one session's output; empty when it is exactly right."""
        label = f"session {session_id}"
        expected_frames = self.workload.frames
        problems: list[str] = []
        inputs = self.model_inputs(session)
        if len(inputs) != expected_frames:
            problems.append(f"{label}: the client sent {len(inputs)} frames, expected {expected_frames}")
        if frames_out is None:
            problems.append(f"{label}: never reported the end of the session")
        elif frames_out != len(inputs):
            problems.append(f"{label}: server reported {frames_out} frames out for {len(inputs)} in")
        if not self.checks_content:
            return problems
        wire = self.expected_wire(self.model_outputs(session_id, inputs))
        if self.frame_bytes is None:
            problems.extend(self._compare_decoded(label, b"".join(record.chunks), wire))
            return problems
        if self.frame_bytes is None:
            problems.extend(self._compare_decoded(label, b"".join(record.chunks), wire))
            return problems
        size = self.frame_bytes
        whole = len(wire) // size
        view = memoryview(wire)
        expected = np.fromiter((zlib.crc32(view[j * size:(j + 1) * size]) for j in range(whole)),
                               dtype=np.uint32, count=whole)
        if record.count != whole or record.tail != wire[whole * size:]:
            problems.append(
                f"{label}: received {record.received_bytes} bytes of audio "
                f"({record.received_bytes / size:.2f} frames), expected {len(wire)} ({len(wire) / size:.2f} frames)"
            )
        common = min(record.count, whole)
        bad = np.flatnonzero(record.crcs[:common] != expected[:common])
        if bad.size:
            problems.append(
                f"{label}: {bad.size} output frame(s) differ from the expected content, "
                f"first at frame {int(bad[0])} (wrong content, order or session)"
            )
        return problems

    def _compare_decoded(self, label: str, received: bytes, wire: bytes) -> list[str]:
        """Encoded streams may differ in framing details (an Ogg serial number): compare what
        they decode to."""
        got = make_decoder(self.output_spec, self.model_rate)
        want = make_decoder(self.output_spec, self.model_rate)
        a = np.concatenate([got.decode(received), got.flush()])
        b = np.concatenate([want.decode(wire), want.flush()])
        if a.shape != b.shape:
            return [f"{label}: decoded output has {a.size} samples, expected {b.size}"]
        if not np.array_equal(a, b):
            first = int(np.flatnonzero(a != b)[0])
            return [f"{label}: decoded output differs from the expected audio from sample {first}"]
        return []
