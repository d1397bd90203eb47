"""A session's input half: the reader task, and the steps from a client message to frames in the
slot.

The reader receives a message, has the translator parse it, decodes the audio (inline for PCM
and G.711, on a worker thread for encoded formats and for messages of more than a second), cuts
it into model frames and submits each one, waiting for credit first: a session has at most
``inbox_depth`` frames not yet stepped and ``inbox_depth + outbox_depth`` not yet sent, so the
inbox never fills and a client that stops reading stops only its own input.  A stop takes
effect between two messages, never inside one (``_between_messages``).  Control events
(formats, turns, clears) are handled here too, in order with the audio, and the end of input
submits what the decoder and framer still hold, then the model's flush frames.  With
``runtime.late_input = "fill"`` a second task steps silence for input that is overdue.

A mixin of ``Session``: the state it reads and writes is set up, and described, in
``Session.__init__``.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns as _perf_counter_ns
from collections.abc import Sequence

import numpy as np
import trio

from duplexrt.audio import (
    AudioFormatError,
    AudioSpec,
    AudioTooLongError,
    Decoder,
    Encoder,
    make_decoder,
    make_encoder,
)
from duplexrt.core.handoffs import HandoffKind
from duplexrt.core.scheduler import SlotClosedError
from duplexrt.core.session_output import MAX_PENDING_BYTES
from duplexrt.core.stage_meter import StageMeter
from duplexrt.core.state import SessionState
from duplexrt.protocols.events import (
    AudioIn,
    ClearInput,
    ClearOutput,
    EndTurn,
    Event,
    Ignored,
    InputEnd,
    ProtocolError,
    Reconfigure,
    Reply,
)
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message, TransportClosed, poller

log = logging.getLogger("duplexrt.session")


class SessionInput:
    """The reader's side of a ``Session``: client messages in, frames into the slot."""

    async def _read_loop(self) -> None:
        poll = poller(self._transport)
        protocol = self._protocol
        try:
            message = await self._receive()
            while True:
                event = protocol.parse(message)
                kind = type(event)
                if kind is AudioIn:
                    # What the translator said while reading it (the server VAD's events, a turn
                    # it opened) goes in the queue now, ahead of any output a step delivers while
                    # the audio waits for credit: a response's deltas never precede its creation.
                    if event.messages:
                        self._queue(event.messages)
                    await self._take_audio(event.payload)
                    if self._pending_bytes > MAX_PENDING_BYTES:  # errors for bad audio, unread
                        await self._wait_for_room()
                elif kind is InputEnd:
                    break
                elif kind is not Ignored:
                    await self._handle(event)
                    if self._queue_full():
                        await self._wait_for_room()
                if self._taking_no_more:
                    break  # every frame of every message taken is submitted; nothing after them
                message = poll()  # a backlog costs one wake-up, not one each
                if message is None:
                    message = await self._receive()
        except TransportClosed as closed:
            self._transport_closed(closed)
            return
        await self._end_input()

    async def _receive(self) -> Message:
        """Wait for the next message: the one place where a stop may cancel the reader."""
        if self._taking_no_more and self._reader_scope is not None:
            self._reader_scope.cancel()  # asked before the reader got here: a stop cancels only a waiter
        self._between_messages = True
        message = await self._transport.receive()
        self._between_messages = False
        return message

    async def _handle(self, event: Event) -> None:
        """Everything but audio: rare, so clarity over speed."""
        if isinstance(event, ProtocolError):
            self._reject(event)
        elif isinstance(event, Reply):
            self._queue(event.messages)  # before any wait: the translator's order is the client's
            if self._flush_frames and isinstance(event, EndTurn):  # else the input is one stream
                last = self._framer.flush()
                if last is not None:
                    await self._submit(last)
                await self._feed_flush()
        elif isinstance(event, Reconfigure):
            await self._reconfigure(event)
        elif isinstance(event, ClearInput):
            self._framer.clear()
            self._decoder = self._new_decoder(self._decoder.spec)
            self._queue(event.messages)
        elif isinstance(event, ClearOutput):
            dropped = len(self._outbox)
            self._outbox.clear()
            self._in_flight -= dropped
            self._dropped += dropped
            if self._credit:
                self._credit.unpark_all()
            self._queue(event.messages)
        else:
            raise AssertionError(f"unexpected event {event!r}")

    async def _reconfigure(self, event: Reconfigure) -> None:
        """New wire formats (the event's specs), announced by its ``messages``.

        Output: everything the client gets after the announcement is in the new format.  So the
        old encoder's tail is handed to the translator before it, audio the translator holds back
        is re-encoded, and the writer encodes every batch from now on, including those already
        waiting, with the new encoder.  Input: what the old decoder still held is model audio
        already, so it goes on into the framer."""
        protocol = self._protocol
        if event.output_spec != self._encoder.spec:
            while self._encoding:  # a batch on a worker thread, encoded with the old encoder
                await self._encoded.park()
            old = self._encoder
            new = self._encoder = make_encoder(event.output_spec, self._model_rate)
            tail = old.flush()
            if tail:
                self._queue(protocol.audio_out(tail, 0))
            protocol.recode_held(lambda payloads: self._recode(payloads, old.spec, new))
        self._queue(event.messages)
        if event.input_spec != self._decoder.spec:
            try:
                tail = self._decoder.flush()
            except AudioFormatError:
                tail = np.zeros(0, dtype=np.float32)
            self._decoder = self._new_decoder(event.input_spec)
            for frame in self._framer.push(tail):
                await self._submit(frame)

    def _recode(self, payloads: Sequence[bytes], old: AudioSpec, encoder: Encoder) -> list[bytes]:
        """Audio in ``old`` (the session's own output, so PCM or G.711 as the translators that
        hold audio speak) into ``encoder``'s format, as one stream.  Inline: rare, and bounded by
        what the translator may hold.  What cannot be decoded inline is dropped."""
        if old.is_encoded:
            return [b"" for _ in payloads]
        decoder = make_decoder(old, self._model_rate)
        try:
            out = [encoder.encode(decoder.decode(payload)) for payload in payloads]
            if out:
                out[-1] += encoder.encode(decoder.flush())
        except AudioFormatError:
            log.exception("session %s: held audio could not be re-encoded", self.lease.session_id)
            return [b"" for _ in payloads]
        return out

    def _new_decoder(self, spec: AudioSpec) -> Decoder:
        return make_decoder(spec, self._model_rate, self._max_message_seconds)

    async def _wait_for_room(self) -> None:
        """A client that stops reading but keeps sending control messages (or bad audio) must
        not grow the queue of replies without bound: its reader waits until the writer catches
        up."""
        if self._taking_no_more:
            return  # the reader stops now; its goodbye waits for the writer anyway
        self._between_messages = True  # the message that queued the replies is handled
        while self._queue_full():
            await self._credit.park()
        self._between_messages = False

    async def _take_audio(self, payload: bytes | bytearray | memoryview) -> None:
        meter = self._meter
        started = meter.message_started() if meter is not None else 0
        decoder = self._decoder
        try:
            if decoder.is_encoded:
                samples = await self._services.handoffs.offload(
                    HandoffKind.DECODE_OFFLOAD, decoder.decode, bytes(payload))
            elif self._always_offload:
                samples = await self._services.handoffs.offload(
                    HandoffKind.CONVERT_OFFLOAD, decoder.decode, bytes(payload))
            elif len(payload) <= decoder.inline_bytes:
                samples = decoder.decode(payload)
            elif len(payload) > decoder.max_bytes:
                raise decoder.too_long(len(payload))  # from its size: no thread hop to refuse it
            else:
                # Seconds of audio in one message: worth a thread hop, so that its conversion
                # (numpy releases the GIL over large arrays) does not hold up every other session.
                samples = await self._services.handoffs.offload(
                    HandoffKind.LARGE_DECODE_OFFLOAD, decoder.decode, bytes(payload))
        except AudioFormatError as exc:
            self._refuse_audio(exc)
            return
        frames = self._framer.push(samples)
        if started:
            meter.message_framed(started)
        for frame in frames:
            if self._fill_debt:  # this time was already filled with silence
                self._drop_filled()
                continue
            await self._submit(frame)
        self._hold_for(len(frames))

    def _refuse_audio(self, exc: AudioFormatError) -> None:
        if isinstance(exc, AudioTooLongError):
            # Fatal only when the decoder had to stop inside the message (an Ogg stream).
            self._reject(ProtocolError("audio_too_long", str(exc),
                                       close_code=CloseCode.MESSAGE_TOO_BIG, fatal=exc.stream_lost))
        else:
            self._reject(ProtocolError("invalid_audio", str(exc)))

    def _drop_filled(self) -> None:
        self._fill_debt -= 1
        self._frames_dropped_late += 1
        self._metrics.frames_dropped_late += 1

    def _hold_for(self, frames: int) -> None:
        if self._coalesce and frames > 1:
            # Set once every frame is in, never before: a hold over frames not yet submitted
            # could keep the credits the reader waits for.
            self._hold_until = self._submitted

    async def _submit(self, frame: np.ndarray) -> None:
        if self._at_frame_limit():
            return
        while (self._submitted - self._delivered >= self._inbox_depth
               or self._in_flight >= self._max_in_flight):
            await self._credit.park()
        self._in_flight += 1
        started = _perf_counter_ns()
        lease = self.lease
        try:
            # A frame that fits goes in with a plain call; only a full inbox (or offload =
            # "always") takes the awaited path, and its worker thread.
            if self._always_offload or not lease.submit_nowait(frame, started):
                await lease.submit(frame, started)
        except SlotClosedError:
            self._slot_gone()
            await trio.lowlevel.checkpoint()  # the cancellation just requested lands here...
            raise  # ... so this only runs if the reader was shielded: the slot is gone either way
        self._submitted_one(started)

    def _at_frame_limit(self) -> bool:
        if self._max_frames is not None and self._submitted >= self._max_frames:
            # The session has had all the audio it may have: answer what was taken, then end
            # with reason "length".  The rest of the message is skipped here, frame by frame,
            # and the reader stops at the end of it.
            self._stop_input(FinishReason.LENGTH, CloseCode.NORMAL_CLOSURE)
            return True
        return False

    def _slot_gone(self) -> None:
        self._in_flight -= 1
        self._finish(FinishReason.SHUTDOWN, "the runtime is stopping", CloseCode.GOING_AWAY)

    def _submitted_one(self, started: int) -> None:
        if not self._submitted:
            self._first_submit_ns = started
            if self._fill:
                self._clock_start = trio.current_time()
                self._clock_started.set()
        self._submitted += 1
        self._metrics.frames_in += 1
        if self._meter is not None and not self._submitted & StageMeter.SUBMIT_SAMPLE_MASK:
            self._meter.frame_submitted(started)

    async def _end_input(self) -> None:
        """Submit what the decoder and framer still hold, then let the writer finish."""
        try:
            tail = self._decoder.flush()
        except AudioFormatError as exc:
            self._reject(ProtocolError("invalid_audio", str(exc)))
            tail = np.zeros(0, dtype=np.float32)
        for frame in self._framer.push(tail):
            await self._submit(frame)
        last = self._framer.flush()
        if last is not None:
            await self._submit(last)
        await self._feed_flush()
        self.lease.end_input()
        self._advance(SessionState.INPUT_ENDED)
        if self._delivered == self._submitted:
            self._close_outbox()

    async def _feed_flush(self) -> None:
        """After the caller's last frame, the frames a model needs to finish its output
        (``flush_frames``): the scheduler's end-of-input mark, then silence.  They are answered
        and sent like any frame, and counted apart (``frames_flushed``) from the caller's audio.
        Not on a stop (shutdown, a limit, an error): that session ends as soon as it can."""
        count = self._flush_frames
        if not count or self._finish_reason is not None:
            return
        mark = self._services.scheduler.end_of_input
        silence = np.zeros_like(mark)
        for i in range(count):
            submitted = self._submitted
            await self._submit(mark if i == 0 else silence)
            if self._submitted == submitted:
                return  # the session's frame limit: it ends with reason "length"
            self._flushed += 1

    def _reject(self, error: ProtocolError) -> None:
        self._queue(self._protocol.error(error))
        if error.fatal:
            self._finish(FinishReason.ERROR, error.message, error.close_code)

    async def _fill_loop(self, scope: trio.CancelScope) -> None:
        with scope:
            await self._fill_overdue()

    async def _fill_overdue(self) -> None:
        """``late_input = "fill"``: step silence for each frame more than ``fill_after`` overdue.

        A frame is due when its audio ends on the session's clock (the first frame's submit plus
        one period per frame); the loop sleeps until the next frame is overdue, and wakes about
        once per ``fill_after`` + one period while input keeps time.  It fills only while the
        reader waits for a message: a reader that is decoding or waiting for the model's credit
        has the audio, and the model is what is late, not the client.
        """
        period = self._frame_seconds
        await self._clock_started.wait()
        while not self._taking_no_more:
            overdue_at = self._clock_start + (self._submitted + 1) * period + self._fill_after
            if trio.current_time() < overdue_at:
                await trio.sleep_until(overdue_at)
                continue
            if not self._between_messages:
                await trio.sleep(period)  # the reader has audio in hand: look again a frame later
                continue
            self._fill_debt += 1
            self._frames_filled += 1
            self._metrics.frames_filled += 1
            await self._submit(self._silence)

