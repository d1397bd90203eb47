"""One session's per-frame stage timing, kept apart from the session's own work.

It exists only with ``metrics.collect_stage_metrics``: a session without one reads no clock for
timing and records nothing, and its usage (frames, seconds, finish reason) is exact either way,
since that is counted by the session itself.  With one, the figures go into the runtime's
histograms (``FrameMetrics``) and a constant-size summary of this session for its log line.

What it costs per frame is what collection costs, so each figure is taken as rarely as its
percentiles allow: the decode of one message in four and the submit of one frame in eight are
timed (both cost the same message after message), and a batch that was sent is recorded with
one histogram call for all its frames, not one per frame; the time from step to send and the
send jitter are taken from one batch in four.  Every value goes in through ``Histogram.add``: a
list append here, counted into buckets by numpy thousands at a time.  Frame latency and the
late count are exact: every frame is recorded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from duplexrt.core.metrics import FrameMetrics

_now = time.perf_counter_ns


class StageMeter:
    """Stage timing of one session: read on the trio thread only, so plain ints are exact."""

    __slots__ = ("_metrics", "_frame_ns", "_opened_ns", "_messages", "_batches", "_latency_sum_ns",
                 "_latency_max_ns", "_late", "_first_audio_ns")

    def __init__(self, metrics: FrameMetrics, frame_seconds: float) -> None:
        self._metrics = metrics
        #: One frame period: a frame slower than this from submit to sent is late, and a send
        #: this long after the previous one is on time (jitter is the difference).
        self._frame_ns = int(frame_seconds * 1e9)
        self._opened_ns = 0
        self._messages = 0
        self._batches = 0
        self._latency_sum_ns = 0
        self._latency_max_ns = 0
        self._late = 0
        self._first_audio_ns = 0

    def opened(self) -> None:
        """The session has its slot: time to first audio counts from here."""
        self._opened_ns = _now()

    def message_started(self) -> int:
        """A stamp for timing this message's decode and framing, or 0 when this one is not timed
        (three in four)."""
        self._messages += 1
        return 0 if self._messages & 3 else _now()

    def message_framed(self, started: int) -> None:
        self._metrics.preprocess.add(_now() - started)

    #: Frames whose submit is timed: the session calls ``frame_submitted`` only for a frame
    #: number with none of these bits set (one in eight), so the others cost no call.
    SUBMIT_SAMPLE_MASK = 7

    def frame_submitted(self, started: int) -> None:
        """A sampled frame (see ``SUBMIT_SAMPLE_MASK``) went into the inbox, its submit begun at
        ``started``."""
        self._metrics.enqueue.add(_now() - started)

    def batch_sent(self, items: Sequence[tuple[Any, Any, int, int]], now: int, last_sent_ns: int) -> None:
        """A batch of the session's outbox items, ``(audio, text, submitted_ns, stepped_ns)``,
        was handed to the transport at ``now``; the previous batch went at ``last_sent_ns``."""
        metrics = self._metrics
        self._batches += 1
        if len(items) == 1:  # the usual batch: one frame, no list to build and reduce
            latency = now - items[0][2]
            metrics.latency.add(latency)
            self._latency_sum_ns += latency
            if latency > self._latency_max_ns:
                self._latency_max_ns = latency
            if latency > self._frame_ns:
                self._late += 1
                metrics.late_frames += 1
            frames = 1
        else:
            latencies = [now - item[2] for item in items]
            metrics.latency.add_many(latencies)
            self._latency_sum_ns += sum(latencies)
            longest = max(latencies)
            if longest > self._latency_max_ns:
                self._latency_max_ns = longest
            frame_ns = self._frame_ns
            if longest > frame_ns:
                late = sum(1 for value in latencies if value > frame_ns)
                self._late += late
                metrics.late_frames += late
            frames = len(items)
        if self._batches & 3 != 1:  # one batch in four (the first, the fifth, ...) is timed
            return
        # The frames of one batch were stepped together or just before.
        metrics.step_to_sent.add(now - items[0][3])
        if self._first_audio_ns:
            # Jitter: how far this send strays from one frame period per frame after the previous one.
            metrics.jitter.add(abs(now - last_sent_ns - self._frame_ns * frames))
        else:
            self._first_audio_ns = now
            metrics.first_audio.add(now - self._opened_ns)

    def describe(self, frames_out: int) -> str:
        """The session's timing for its log line ("" when it sent nothing)."""
        if not frames_out:
            return ""
        mean_ms = self._latency_sum_ns / frames_out / 1e6
        first = (self._first_audio_ns - self._opened_ns) / 1e6 if self._first_audio_ns else float("nan")
        return (f"; first audio after {first:.1f} ms, frame latency mean {mean_ms:.1f} ms "
                f"max {self._latency_max_ns / 1e6:.1f} ms, {self._late} late")
