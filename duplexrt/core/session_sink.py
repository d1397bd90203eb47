"""A session's sink for the server's read hub: a client message taken where it was read.

Where the transport serves messages (``serve_messages``: ``NativeWebSocket`` on a ``ReadHub``),
the hub calls ``_take_nowait`` with each message as it reads it, while the reader task waits.
A message whose every step can be done without waiting (audio that decodes inline and fits the
credits left, the usual paced message) is parsed, decoded, framed and submitted right there,
and the reader is not woken for it.  Anything else is handed to the reader, parsed or not, and
the reader does the rest as if it had read the message itself, in order (``Taken`` in
``duplexrt/transport.py``).  So the sink is a shortcut for the common case, never a second way
of handling a message: every step it takes is the reader's own (``session_input.py``).

A mixin of ``Session``: the state it reads and writes is set up, and described, in
``Session.__init__``.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns as _perf_counter_ns

import numpy as np

from duplexrt.audio import AudioFormatError
from duplexrt.core.scheduler import SlotClosedError
from duplexrt.core.session_output import MAX_PENDING_BYTES
from duplexrt.protocols.events import AudioIn, Event, Ignored
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.transport import Message, Taken

log = logging.getLogger("duplexrt.session")


class SessionSink:
    """The read hub's way into a ``Session`` (see the module docstring)."""

    def _take_nowait(self, message: Message) -> Taken:
        """The reader's work for one message, done where the message was read, so that the
        reader task is not woken for it: audio that decodes inline and fits the credits left.
        Anything else is handed to the reader, parsed (``Taken.HELD``, in ``self._held``) or
        not (``Taken.LEFT``, when the reader must stop or wait first).  Runs while the reader
        waits for a message, so what it does is what the reader would do with it, in order."""
        if self._taking_no_more or self._queue_full() or self._pending_bytes > MAX_PENDING_BYTES:
            return Taken.LEFT
        try:
            event = self._protocol.parse(message)
            kind = type(event)
            if kind is AudioIn and self._take_audio_nowait(event.payload):
                if event.messages:
                    self._queue(event.messages)  # no wait since the parse: nothing came between
                # Frames past the credits, or a queue the client does not read: the reader
                # submits them, or waits for room, before the next message.
                if self._unsubmitted is not None or self._pending_bytes > MAX_PENDING_BYTES:
                    return self._hold(None)
                self._metrics.messages_taken_inline += 1
                return Taken.DONE
            if kind is Ignored:
                return Taken.DONE
            return self._hold(event)
        except Exception:
            log.exception("session %s failed", self.lease.session_id)
            self._finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)
            return Taken.DONE

    def _hold(self, event: Event | None) -> Taken:
        """Leave the rest of a message taken where it was read to the reader.  The reader is in
        the middle of that message from now on, as if it had read it itself: a stop lets it
        finish the message (``_stop_input``), and the fill loop does not fill under it."""
        self._held = event
        self._between_messages = False
        return Taken.HELD

    def _take_audio_nowait(self, payload: bytes | bytearray | memoryview) -> bool:
        """``_take_audio`` where nothing in it has to wait: PCM decoded inline, and credit for
        every frame the message can make.  False, with nothing done, otherwise."""
        decoder = self._decoder
        if decoder.is_encoded or self._always_offload or len(payload) > decoder.inline_bytes:
            return False
        frames_possible = (self._framer.pending + decoder.samples_at_most(len(payload))) // self._frame_size
        if (self._submitted - self._delivered + frames_possible > self._inbox_depth
                or self._in_flight + frames_possible > self._max_in_flight):
            return False
        meter = self._meter
        started = meter.message_started() if meter is not None else 0
        try:
            samples = decoder.decode(payload)
        except AudioFormatError as exc:
            self._refuse_audio(exc)
            return True
        frames = self._framer.push(samples)
        if started:
            meter.message_framed(started)
        for at, frame in enumerate(frames):
            if self._fill_debt:
                self._drop_filled()
            elif self._submitted - self._delivered < self._inbox_depth and self._in_flight < self._max_in_flight:
                self._submit_nowait(frame)
            else:  # more frames than the bound said: the reader submits the rest, waiting as it must
                self._unsubmitted = (frames[at:], len(frames))
                return True
        self._hold_for(len(frames))
        return True

    def _submit_nowait(self, frame: np.ndarray) -> None:
        """``_submit`` for a frame the caller has credit for (so its inbox has room)."""
        if self._at_frame_limit():
            return
        self._in_flight += 1
        started = _perf_counter_ns()
        try:
            queued = self.lease.submit_nowait(frame, started)
        except SlotClosedError:
            self._slot_gone()
            return
        if not queued:  # the credits say there is room: a broken promise, not backpressure
            self._in_flight -= 1
            raise RuntimeError("the inbox refused a frame the session had credit for")
        self._submitted_one(started)

    async def _submit_rest(self) -> None:
        """The frames ``_take_audio_nowait`` had no credit for, submitted waiting as ``_take_audio``
        would have."""
        rest, self._unsubmitted = self._unsubmitted, None
        if rest is not None:
            frames, count = rest
            for frame in frames:
                if self._fill_debt:
                    self._drop_filled()
                else:
                    await self._submit(frame)
            self._hold_for(count)

