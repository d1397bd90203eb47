"""One virtual client, shared by both paths: it drives a ``duplexrt.client.Conversation`` over a
transport, keeps a CRC per output frame for the guards and, paced, measures each frame's lag.
"""

from __future__ import annotations

import math
from functools import partial

import numpy as np
import sphn

from duplexrt.audio import AudioSpec
from duplexrt.client.connection import ConnectError
from duplexrt.client.conversation import Conversation
from duplexrt.client.pacer import Pacer
from duplexrt.client.protocols import Buffer, ClientProtocol
from duplexrt.core.histogram import Histogram, Summary
from duplexrt.reasons import FinishReason
from duplexrt.simulate.checker import OutputRecord
from duplexrt.simulate.workload import Workload
from duplexrt.wire.transport import Transport

#: Paced virtual clients share one ``Pacer`` that wakes at most once per this many seconds: a
#: message goes out at most this much after its time (its lag is counted from when it went, so
#: the figures stay exact); trio's own timers are only as fine as epoll's millisecond anyway.
PACING_TICK = 0.002


class LagMeter:
    """Paced mode: how long after its input was sent each output frame arrived."""

    def __init__(self, workload: Workload, late_ms: float, *, keep_samples: bool = False) -> None:
        self.workload = workload
        self.histogram = Histogram()
        self.late_ns = int(late_ms * 1e6)
        self.late = 0
        #: With keep_samples: each frame's arrival time (perf_counter seconds) and lag (ns).
        self.times: list[float] | None = [] if keep_samples else None
        self.lags: list[int] = []

    def record(self, send_times: list[float], first_frame: int, count: int, now: float) -> None:
        if count == 1 and self.times is None:  # the usual case, inline
            value = int((now - send_times[min(self.workload.message_completing_frame(first_frame),
                                               len(send_times) - 1)]) * 1e9)
            self.histogram.record(value)
            if value > self.late_ns:
                self.late += 1
            return
        completing = self.workload.message_completing_frame
        histogram = self.histogram
        last = len(send_times) - 1
        for frame in range(first_frame, first_frame + count):
            value = int((now - send_times[min(completing(frame), last)]) * 1e9)
            histogram.record(value)
            if value > self.late_ns:
                self.late += 1
            if self.times is not None:
                self.times.append(now)
                self.lags.append(value)

    def samples(self, start: float) -> tuple[np.ndarray, np.ndarray] | None:
        """(seconds since ``start``, lag in ms) of every frame, when kept."""
        if self.times is None:
            return None
        return (np.asarray(self.times) - start, np.asarray(self.lags, dtype=np.float64) / 1e6)


class OpusFrames:
    """Counts the model frames of an Ogg Opus stream as it arrives (decoding it), for clients
    that must know when they have heard everything and, paced, when each frame arrived."""

    def __init__(self, spec: AudioSpec, model_rate: int, frame_size: int) -> None:
        self._reader = sphn.OpusStreamReader(spec.sample_rate)
        self._frame_samples = frame_size * spec.sample_rate / model_rate
        self._samples = 0
        self.frames = 0

    def add(self, data: Buffer) -> int:
        self._samples += len(self._reader.append_bytes(bytes(data)))
        frames = int(self._samples // self._frame_samples)
        completed = frames - self.frames
        self.frames = frames
        return completed


class VirtualClient:
    """One virtual session's client side: its conversation, what it received (reduced for the
    guards), and, paced, the lag of each frame."""

    __slots__ = ("index", "record", "meter", "counter", "conversation", "error", "first_audio")

    def __init__(self, index: int, record: OutputRecord, meter: LagMeter | None,
                 counter: OpusFrames | None = None) -> None:
        self.index = index
        self.record = record
        self.meter = meter
        #: Counts frames where the record cannot (Opus), when the count matters while running.
        self.counter = counter
        self.conversation: Conversation | None = None
        #: --url: why the connection failed, if it did.
        self.error: ConnectError | None = None
        #: When the first audio came back (perf_counter seconds): the output stream's start.
        self.first_audio: float | None = None

    @property
    def frames_heard(self) -> int:
        return self.counter.frames if self.counter is not None else self.record.count

    def on_audio(self, data: Buffer, now: float) -> None:
        if self.first_audio is None:
            self.first_audio = now
        record = self.record
        counter = self.counter
        if counter is None:
            before = record.count
            completed = record.add(data)
        else:
            record.add(data)
            before = counter.frames
            completed = counter.add(data)
        meter = self.meter
        conversation = self.conversation  # set before its first message can arrive
        if meter is not None and completed and conversation is not None:
            meter.record(conversation.send_times, before, completed, now)

    async def converse(self, transport: Transport, protocol: ClientProtocol, workload: Workload, *, paced: bool,
                       offset: float, caught_up_at: int | None = None,
                       idle_timeout: float | None = None, pacer: Pacer | None = None) -> Conversation:
        caught_up = None
        if caught_up_at is not None:
            caught_up = lambda: self.frames_heard >= caught_up_at  # noqa: E731
        conversation = Conversation(transport, protocol, on_audio=self.on_audio, caught_up=caught_up,
                                    idle_timeout=idle_timeout)
        self.conversation = conversation
        await conversation.run(workload.message_count, partial(workload.message, self.index),
                               interval=workload.message_seconds if paced else None, offset=offset,
                               pacer=pacer)
        return conversation


def end_failures(index: int, conversation: Conversation) -> list[str]:
    """What the server said went wrong with one session."""
    failures = [f"session {index + 1}: server sent error {error}" for error in conversation.errors]
    end = conversation.end
    if end is not None and end.reason != FinishReason.STOP:
        failures.append(f"session {index + 1}: ended with {end.reason!r}: {end.error}")
    return failures


def stream_real_time_factor(clients: list[VirtualClient], workload: Workload) -> float | None:
    """The output stream's duration over the input's, worst session: its first output to its last,
    over its first message's send to its last's.  1.0 when the model keeps up, whatever the lag;
    above 1 when output falls further behind as the run goes on (paced mode)."""
    span = (workload.message_count - 1) * workload.message_seconds
    ratios = [
        (c.conversation.last_output - c.first_audio) / span
        for c in clients
        if span > 0 and c.conversation is not None and c.first_audio is not None
        and c.conversation.last_output is not None
    ]
    return max(ratios) if ratios else None


def pacing(clients: list[VirtualClient], meter: LagMeter | None, frames: int,
           frame_seconds: float) -> tuple[Summary | None, int | None, float | None]:
    """Frame lag, late frames and real-time factor (paced mode; None for a burst)."""
    if meter is None:
        return None, None, None
    ratios = [
        (c.conversation.last_output - c.conversation.first_send) / (frames * frame_seconds)
        for c in clients
        if c.conversation is not None and c.conversation.first_send is not None
        and c.conversation.last_output is not None
    ]
    return meter.histogram.summary().scaled(1e6), meter.late, (max(ratios) if ratios else math.nan)
