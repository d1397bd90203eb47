"""Runtime-wide per-frame figures, kept in fixed-size histograms on the trio thread."""

from __future__ import annotations

from collections import Counter

import attrs

from duplexrt.core.histogram import Histogram, Summary


@attrs.frozen
class FrameStatistics:
    """Per-frame timings in microseconds, and the session counters."""

    sessions_opened: int
    sessions_active: int
    frames_in: int
    frames_out: int
    preprocess_us: Summary
    enqueue_us: Summary
    latency_us: Summary
    step_to_sent_us: Summary
    first_audio_us: Summary
    jitter_us: Summary
    late_frames: int
    text_pieces: int
    #: ``runtime.late_input = "fill"``: silence stepped for overdue input, and late input dropped.
    frames_filled: int = 0
    frames_dropped_late: int = 0
    #: Sessions resumed on a new connection after a drop (``runtime.resume_window_s``).
    sessions_resumed: int = 0
    #: Batches of output sent from the step delivery itself, with no writer task woken
    #: (the transport sends without yielding, and nothing was queued before them).
    direct_batches: int = 0
    #: Times a session's writer task woke: for output the delivery could not send itself,
    #: replies and errors, and a session's end.
    writer_wakeups: int = 0
    #: Sessions ended, by route (the path they were opened on; "" for one served without a
    #: route: a test's or ``simulate``'s) and finish reason.
    sessions_ended: dict[str, dict[str, int]] = attrs.field(factory=dict)
    #: Sessions being served now, by route (routes with none are left out).
    sessions_active_by_route: dict[str, int] = attrs.field(factory=dict)


class FrameMetrics:
    """Written only on the trio thread, so plain ints and histograms are exact."""

    def __init__(self) -> None:
        self.sessions_opened = 0
        self.sessions_active = 0
        self.frames_in = 0
        self.frames_out = 0
        #: Decode and framing of one message (nanoseconds; one message in four is timed).
        self.preprocess = Histogram()
        #: One frame's submit into the inbox (nanoseconds; one frame in eight is timed).
        self.enqueue = Histogram()
        #: Submitted to the inbox → handed to the transport (nanoseconds).
        self.latency = Histogram()
        #: The step that made a batch of output finished → the batch handed to the transport
        #: (nanoseconds; once per batch, for its oldest frame).
        self.step_to_sent = Histogram()
        #: Session opened → its first audio sent (nanoseconds).
        self.first_audio = Histogram()
        #: How far each send strays from one frame period after the previous (nanoseconds).
        self.jitter = Histogram()
        #: Frames whose submit → sent took longer than one frame period.
        self.late_frames = 0
        #: Pieces of model text sent.
        self.text_pieces = 0
        #: ``runtime.late_input = "fill"``: silence stepped for overdue input, and late input dropped.
        self.frames_filled = 0
        self.frames_dropped_late = 0
        #: Sessions resumed on a new connection after a drop.
        self.sessions_resumed = 0
        #: Output batches sent from the step delivery, and writer task wake-ups (see FrameStatistics).
        self.direct_batches = 0
        self.writer_wakeups = 0
        #: Sessions ended by (route, finish reason), and active by route.
        self.sessions_ended: Counter[tuple[str, str]] = Counter()
        self.active_by_route: Counter[str] = Counter()

    def statistics(self) -> FrameStatistics:
        return FrameStatistics(
            sessions_opened=self.sessions_opened,
            sessions_active=self.sessions_active,
            frames_in=self.frames_in,
            frames_out=self.frames_out,
            preprocess_us=self.preprocess.summary().scaled(1e3),
            enqueue_us=self.enqueue.summary().scaled(1e3),
            latency_us=self.latency.summary().scaled(1e3),
            step_to_sent_us=self.step_to_sent.summary().scaled(1e3),
            first_audio_us=self.first_audio.summary().scaled(1e3),
            jitter_us=self.jitter.summary().scaled(1e3),
            late_frames=self.late_frames,
            text_pieces=self.text_pieces,
            frames_filled=self.frames_filled,
            frames_dropped_late=self.frames_dropped_late,
            sessions_resumed=self.sessions_resumed,
            direct_batches=self.direct_batches,
            writer_wakeups=self.writer_wakeups,
            sessions_ended=_by_route(self.sessions_ended),
            sessions_active_by_route={route: count for route, count in self.active_by_route.items() if count},
        )


def _by_route(counts: Counter[tuple[str, str]]) -> dict[str, dict[str, int]]:
    """``{(route, reason): n}`` as ``{route: {reason: n}}``."""
    nested: dict[str, dict[str, int]] = {}
    for (route, reason), count in sorted(counts.items()):
        nested.setdefault(route, {})[reason] = count
    return nested
