"""A session's input half: the reader task, from a client message to frames in the slot.

The reader receives a message, has the translator parse it, decodes the audio (inline for PCM
and G.711, on a worker thread for encoded formats and for messages of more than a second), cuts
it into model frames and submits each one, waiting for credit first (``credits.py``).  A stop
takes effect between two messages, never inside one (``Lifecycle.between_messages``).  Control
events (formats, turns, clears) are handled here too, in order with the audio, and the end of
input submits what the decoder and framer still hold, then the model's flush frames.  With
``runtime.late_input = "fill"`` a second task steps silence for input that is overdue.
"""

from __future__ import annotations

import logging
from time import perf_counter_ns as _perf_counter_ns

import numpy as np
import trio

from duplexrt.audio import AudioFormatError, AudioSpec, AudioTooLongError, Decoder, Framer, make_decoder
from duplexrt.backends.base import PersonaError, PersonaRequest
from duplexrt.config import Config
from duplexrt.core.handoffs import HandoffKind, Handoffs
from duplexrt.core.metrics import FrameMetrics
from duplexrt.core.scheduler import SlotClosedError, SlotLease
from duplexrt.core.stage_meter import StageMeter
from duplexrt.protocols.base import PersonaChoice, Translator
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
from duplexrt.session.credits import Credits
from duplexrt.session.lifecycle import Lifecycle, SessionState
from duplexrt.session.outgoing import Outgoing
from duplexrt.session.writer import Writer
from duplexrt.wire.transport import Message, Transport, TransportClosed, poller

log = logging.getLogger("duplexrt.session")




class Reader:
    """Client messages in, frames into the slot (see the module docstring), built with what it
    uses: the transport and the translator, the slot's lease, the credits, the outgoing queue
    (replies and errors go there, in order with the output), the writer (for a format switch and
    a clear), the lifecycle, the worker threads, the metrics (and the stage meter), and what the
    configuration says of input."""

    def __init__(self, *, config: Config, transport: Transport, protocol: Translator, lease: SlotLease,
                 decoder: Decoder, credits: Credits, outgoing: Outgoing, writer: Writer, lifecycle: Lifecycle,
                 handoffs: Handoffs, metrics: FrameMetrics, meter: StageMeter | None, max_frames: int | None,
                 flush_frames: int, end_of_input: np.ndarray, persona: PersonaChoice | None = None) -> None:
        self._transport = transport
        self._protocol = protocol
        self._lease = lease
        self.decoder = decoder
        self._credits = credits
        self._outgoing = outgoing
        self._writer = writer
        self._lifecycle = lifecycle
        self._handoffs = handoffs
        self._metrics = metrics
        self._meter = meter
        self._model_rate = config.audio.sample_rate
        self._frame_seconds = config.audio.frame_seconds
        self._max_message_seconds = config.audio.max_message_seconds
        self._framer = Framer(config.audio.frame_size)
        self._always_offload = config.runtime.offload == "always"
        #: The most frames this session may take, or None.
        self._max_frames = max_frames
        #: Frames the model wants after the caller's input ends, and the mark the first carries.
        self._flush_frames = flush_frames
        self._end_of_input = end_of_input
        #: Flush frames submitted: model input, but not the caller's audio.
        self.flushed = 0
        #: Usage: when the first frame went in (perf_counter_ns).
        self.first_submit_ns = 0
        #: runtime.late_input = "fill": the session's input clock against the wall clock.
        self.fills = config.runtime.late_input == "fill"
        self._fill_after = config.runtime.fill_after_ms / 1e3
        self._clock_start = 0.0  # trio time of the first frame submitted ...
        self._clock_started = trio.Event()  # ... once there is one
        self._fill_debt = 0  # frames filled whose real audio has not come yet: dropped when it does
        self.frames_filled = 0
        self.frames_dropped_late = 0
        self._silence = np.zeros(config.audio.frame_size, dtype=np.float32)
        #: The session's persona, for a model that takes one: fixed and handed to the slot before
        #: the first frame (``set_persona``), pending until then.
        self._persona = persona
        self._persona_pending = persona is not None
        self._persona_refused = False
        #: The reader takes no message now: it waits for credit or room, or its input is over.
        #: ``watch_for_close`` reads ahead meanwhile (woken through ``_away_lot``).
        self._away = False
        self._away_lot = trio.lowlevel.ParkingLot()

    # -- the reader task ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Read until the input ends (the client said so, went away, or the session stops), then
        submit what the decoder and framer still hold."""
        lifecycle = self._lifecycle
        with trio.CancelScope() as lifecycle.reader_scope:
            await self._read_loop()
        if lifecycle.reader_scope.cancelled_caught:  # stopped while waiting for a message
            await self._end_input()
        self._set_away(True)  # no message is taken any more: a Close still ends the session at once

    async def _read_loop(self) -> None:
        poll = poller(self._transport)
        protocol = self._protocol
        outgoing = self._outgoing
        lifecycle = self._lifecycle
        try:
            message = await self._receive()
            while True:
                event = protocol.parse(message)
                kind = type(event)
                if kind is AudioIn:
                    # What the translator said while reading it (the server VAD's events, a turn
                    # it opened) goes in the queue now, ahead of any output a step delivers while
                    # the audio waits for credit: a response's deltas never precede its creation.
                    if event.messages:  # type: ignore[union-attr]
                        outgoing.queue(event.messages)  # type: ignore[union-attr]
                    await self._take_audio(event.payload)  # type: ignore[union-attr]
                    if outgoing.over_bytes():  # errors for bad audio, unread
                        await self._wait_for_room()
                elif kind is InputEnd:
                    break
                elif kind is not Ignored:
                    await self._handle(event)
                    if outgoing.full():
                        await self._wait_for_room()
                if not lifecycle.taking_input:
                    break  # every frame of every message taken is submitted; nothing after them
                next_message = poll()  # a backlog costs one wake-up, not one each
                message = next_message if next_message is not None else await self._receive()
        except TransportClosed as closed:
            lifecycle.transport_closed(closed)
            return
        await self._end_input()

    async def _receive(self) -> Message:
        """Wait for the next message: the one place where a stop may cancel the reader."""
        lifecycle = self._lifecycle
        if not lifecycle.taking_input and lifecycle.reader_scope is not None:
            lifecycle.reader_scope.cancel()  # asked before the reader got here: a stop cancels only a waiter
        lifecycle.between_messages = True
        message = await self._transport.receive()
        lifecycle.between_messages = False
        return message

    async def _handle(self, event: Event) -> None:
        """Everything but audio: rare, so clarity over speed."""
        if isinstance(event, ProtocolError):
            self._reject(event)
        elif isinstance(event, Reply):
            self._outgoing.queue(event.messages)  # before any wait: the translator's order is the client's
            if self._flush_frames and isinstance(event, EndTurn):  # else the input is one stream
                last = self._framer.flush()
                if last is not None:
                    await self._submit(last)
                await self._feed_flush()
        elif isinstance(event, Reconfigure):
            await self._reconfigure(event)
        elif isinstance(event, ClearInput):
            self._framer.clear()
            self.decoder = self._new_decoder(self.decoder.spec)
            self._outgoing.queue(event.messages)
        elif isinstance(event, ClearOutput):
            self._writer.clear()
            self._outgoing.queue(event.messages)
        else:
            raise AssertionError(f"unexpected event {event!r}")

    async def _reconfigure(self, event: Reconfigure) -> None:
        """New wire formats (the event's specs), announced by its ``messages``.

        Output: everything the client gets after the announcement is in the new format
        (``Writer.reformat``).  Input: what the old decoder still held is model audio already, so
        it goes on into the framer."""
        if event.output_spec != self._writer.encoder.spec:
            await self._writer.reformat(event.output_spec)
        self._outgoing.queue(event.messages)
        if event.input_spec != self.decoder.spec:
            try:
                tail = self.decoder.flush()
            except AudioFormatError:
                tail = np.zeros(0, dtype=np.float32)
            self.decoder = self._new_decoder(event.input_spec)
            for frame in self._framer.push(tail):
                await self._submit(frame)

    def _new_decoder(self, spec: AudioSpec) -> Decoder:
        return make_decoder(spec, self._model_rate, self._max_message_seconds)

    async def _wait_for_room(self) -> None:
        """A client that stops reading but keeps sending control messages (or bad audio) must
        not grow the queue of replies without bound: its reader waits until the writer catches
        up."""
        lifecycle = self._lifecycle
        if not lifecycle.taking_input:
            return  # the reader stops now; its goodbye waits for the writer anyway
        lifecycle.between_messages = True  # the message that queued the replies is handled
        self._set_away(True)
        try:
            while self._outgoing.full():
                await self._credits.lot.park()
        finally:
            self._set_away(False)
        lifecycle.between_messages = False

    async def _take_audio(self, payload: bytes | bytearray | memoryview) -> None:
        meter = self._meter
        started = meter.message_started() if meter is not None else 0
        decoder = self.decoder
        try:
            if decoder.is_encoded:
                samples = await self._handoffs.offload(HandoffKind.DECODE_OFFLOAD, decoder.decode, bytes(payload))
            elif self._always_offload:
                samples = await self._handoffs.offload(HandoffKind.CONVERT_OFFLOAD, decoder.decode, bytes(payload))
            elif len(payload) <= decoder.inline_bytes:
                samples = decoder.decode(payload)
            elif len(payload) > decoder.max_bytes:
                raise decoder.too_long(len(payload))  # from its size: no thread hop to refuse it
            else:
                # Seconds of audio in one message: worth a thread hop, so that its conversion
                # (numpy releases the GIL over large arrays) does not hold up every other session.
                samples = await self._handoffs.offload(
                    HandoffKind.LARGE_DECODE_OFFLOAD, decoder.decode, bytes(payload))
        except AudioFormatError as exc:
            self._refuse_audio(exc)
            return
        frames = self._framer.push(samples)
        if meter is not None and started:
            meter.message_framed(started)
        for frame in frames:
            if self._fill_debt:  # this time was already filled with silence
                self._drop_filled()
                continue
            await self._submit(frame)
        self._writer.hold_for(len(frames))

    def _refuse_audio(self, exc: AudioFormatError) -> None:
        if isinstance(exc, AudioTooLongError):
            # Fatal only when the decoder had to stop inside the message (an Ogg stream).
            self._reject(ProtocolError("audio_too_long", str(exc),
                                       close_code=CloseCode.MESSAGE_TOO_BIG, fatal=exc.stream_lost))
        else:
            self._reject(ProtocolError("invalid_audio", str(exc)))

    def _drop_filled(self) -> None:
        self._fill_debt -= 1
        self.frames_dropped_late += 1
        self._metrics.frames_dropped_late += 1

    async def _submit(self, frame: np.ndarray) -> None:
        if self._at_frame_limit():
            return
        if self._persona_pending and not self.set_persona():
            return  # the session ends: no frame goes to the model without its persona
        credits = self._credits
        if (credits.submitted - credits.delivered >= credits.inbox_depth
                or credits.in_flight >= credits.max_in_flight):
            await self._wait_for_credit()  # rare on the paced path: no coroutine per frame otherwise
        credits.in_flight += 1
        started = _perf_counter_ns()
        lease = self._lease
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

    async def _wait_for_credit(self) -> None:
        """``Credits.wait_to_submit``, with ``watch_for_close`` looking for the client's Close
        meanwhile (not for the fill loop's submit: the reader is reading then)."""
        if self._lifecycle.between_messages:
            await self._credits.wait_to_submit()
            return
        self._set_away(True)
        try:
            await self._credits.wait_to_submit()
        finally:
            self._set_away(False)

    def _set_away(self, away: bool) -> None:
        self._away = away
        if self._away_lot:
            self._away_lot.unpark_all()

    async def watch_for_close(self) -> None:
        """Beside the reader (for a transport that can read ahead: ``NativeWebSocket``, and
        ``ResumableTransport`` over it): while the reader takes no message, the transport reads
        ahead for the client's Close, and a Close (or a drop that cannot resume) ends the
        session at once, with reason ``client_closed``.

        Why: a model slower than real time leaves seconds of a caller's audio queued ahead of it
        (in the socket, read and not yet taken, in the slot's inbox), and the reader takes the
        next message only once the model has stepped what came before.  A Close behind that
        audio was heard only after it: the session, its slot and its admission were held for
        1-13 s for a call that no longer existed, whose answer nobody could hear.  Now the
        frames not yet stepped are dropped with the slot (``SlotLease.release``; the count is in
        the session's end log line) and the messages not yet taken with the connection.  An end
        of input that is not a Close (``input.end``, a commit, a flush) is a caller still
        listening: it waits for its frames as before.  A drop that may resume detaches the
        session as before, once the reader has taken what came first (docs/resume.md)."""
        watch = self._transport.watch_for_close  # type: ignore[attr-defined]  # the session checked
        lot = self._away_lot

        def taking() -> bool:
            return not self._away

        while True:
            while not self._away:
                await lot.park()
            closed = await watch(taking)
            if closed is not None:
                self._lifecycle.transport_closed(closed)
                return
            while self._away:  # read ahead as far as it may: look again at the reader's next wait
                await lot.park()

    def set_persona(self) -> bool:
        """Fix the session's persona and hand it to the slot, ahead of any frame (the first
        frame's submit calls this; the session calls it at its start for a route whose persona
        came in the URL).  False when the model refuses it: the session ends, and no frame goes
        to the model."""
        if self._persona_refused:
            return False
        choice = self._persona
        assert choice is not None
        try:
            persona = choice.fix()
        except PersonaError as exc:
            # A persona is checked as it is asked (a URL's at admission): what fails here is the
            # model's own default, or one handed to ``Runtime.serve`` unchecked.
            self._persona_refused = True
            if choice.request == PersonaRequest():
                log.error("the model refused its default persona: %s", exc)
                self._lifecycle.finish(FinishReason.ERROR, f"the model refused its default persona: {exc}",
                                       CloseCode.INTERNAL_ERROR)
            else:
                self._lifecycle.finish(FinishReason.ERROR, f"the model refused the persona: {exc}",
                                       CloseCode.POLICY_VIOLATION)
            return False
        self._persona_pending = False
        assert persona is not None  # a model that takes a persona gives one
        try:
            self._lease.set_persona(persona)
        except SlotClosedError:
            self._persona_refused = True
            self._lifecycle.finish(FinishReason.SHUTDOWN, "the runtime is stopping", CloseCode.GOING_AWAY)
            return False
        return True

    def _at_frame_limit(self) -> bool:
        if self._max_frames is not None and self._credits.submitted >= self._max_frames:
            # The session has had all the audio it may have: answer what was taken, then end
            # with reason "length".  The rest of the message is skipped here, frame by frame,
            # and the reader stops at the end of it.
            self._lifecycle.stop_input(FinishReason.LENGTH, CloseCode.NORMAL_CLOSURE)
            return True
        return False

    def _slot_gone(self) -> None:
        self._credits.in_flight -= 1
        self._lifecycle.finish(FinishReason.SHUTDOWN, "the runtime is stopping", CloseCode.GOING_AWAY)

    def _submitted_one(self, started: int) -> None:
        credits = self._credits
        if not credits.submitted:
            self.first_submit_ns = started
            if self.fills:
                self._clock_start = trio.current_time()
                self._clock_started.set()
        credits.submitted += 1
        self._metrics.frames_in += 1
        if self._meter is not None and not credits.submitted & StageMeter.SUBMIT_SAMPLE_MASK:
            self._meter.frame_submitted(started)

    async def _end_input(self) -> None:
        """Submit what the decoder and framer still hold, then let the writer finish."""
        try:
            tail = self.decoder.flush()
        except AudioFormatError as exc:
            self._reject(ProtocolError("invalid_audio", str(exc)))
            tail = np.zeros(0, dtype=np.float32)
        for frame in self._framer.push(tail):
            await self._submit(frame)
        last = self._framer.flush()
        if last is not None:
            await self._submit(last)
        await self._feed_flush()
        self._lease.end_input()
        self._lifecycle.advance(SessionState.INPUT_ENDED)
        if self._credits.all_delivered:
            self._writer.close_outbox()

    async def _feed_flush(self) -> None:
        """After the caller's last frame, the frames a model needs to finish its output
        (``flush_frames``): the scheduler's end-of-input mark, then silence.  They are answered
        and sent like any frame, and counted apart (``flushed``) from the caller's audio.  Not on
        a stop (shutdown, a limit, an error): that session ends as soon as it can."""
        count = self._flush_frames
        if not count or self._lifecycle.finish_reason is not None:
            return
        mark = self._end_of_input
        silence = np.zeros_like(mark)
        credits = self._credits
        for i in range(count):
            submitted = credits.submitted
            await self._submit(mark if i == 0 else silence)
            if credits.submitted == submitted:
                return  # the session's frame limit: it ends with reason "length"
            self.flushed += 1

    def _reject(self, error: ProtocolError) -> None:
        self._outgoing.queue(self._protocol.error(error))
        if error.fatal:
            self._lifecycle.finish(FinishReason.ERROR, error.message, error.close_code)

    def release(self) -> None:
        """The session is over: what the framer holds goes with it."""
        self._framer.clear()

    # -- late input --------------------------------------------------------------------------------

    async def fill_loop(self, scope: trio.CancelScope) -> None:
        """``late_input = "fill"``: step silence for each frame more than ``fill_after`` overdue.

        A frame is due when its audio ends on the session's clock (the first frame's submit plus
        one period per frame); the loop sleeps until the next frame is overdue, and wakes about
        once per ``fill_after`` + one period while input keeps time.  It fills only while the
        reader waits for a message: a reader that is decoding or waiting for the model's credit
        has the audio, and the model is what is late, not the client.
        """
        with scope:
            period = self._frame_seconds
            lifecycle = self._lifecycle
            credits = self._credits
            await self._clock_started.wait()
            while lifecycle.taking_input:
                overdue_at = self._clock_start + (credits.submitted + 1) * period + self._fill_after
                if trio.current_time() < overdue_at:
                    await trio.sleep_until(overdue_at)
                    continue
                if not lifecycle.between_messages:
                    await trio.sleep(period)  # the reader has audio in hand: look again a frame later
                    continue
                self._fill_debt += 1
                self.frames_filled += 1
                self._metrics.frames_filled += 1
                await self._submit(self._silence)
