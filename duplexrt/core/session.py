"""One conversation: client audio in, through the session's slot, model audio out.

Each session is a nursery of its own with two tasks.  The reader receives messages, decodes them
(inline for PCM and G.711, on a worker thread only for encoded formats), cuts them into model
frames and submits each frame to the slot.  The model's output comes back as the scheduler
delivers it, a whole step at a time, and is sent from the delivery itself when nothing stands in
the way (``delivery_done``); the writer sends whatever the delivery could not.  When the nursery
ends — the client said it was done, went away, misbehaved, or the runtime is stopping — the slot
and every buffer the session held are freed with it.

Flow control is done on the trio side, at no cost in thread crossings.  A session submits a frame
only while it has fewer than ``inbox_depth`` frames not yet stepped, so its inbox queue never
fills in normal operation; the step delivery that frees room is also what wakes the reader.  And it
has at most ``inbox_depth + outbox_depth`` frames submitted and not yet sent, so the scheduler can
always hand it output without blocking, and a client that stops reading stops its own input, not
anyone else's.  (Measured: letting sessions run into full inboxes and wait on worker threads, as the
lease's own ``submit`` must, cost 10,622 thread hops and 160 µs of CPU per frame in a 96-session
burst.)
"""

from __future__ import annotations

import logging
import time
from time import perf_counter_ns as _perf_counter_ns
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np
import trio

from duplexrt.audio import (
    AudioFormatError,
    AudioSpec,
    AudioTooLongError,
    Decoder,
    Encoder,
    Framer,
    make_decoder,
    make_encoder,
)
from duplexrt.config import Config
from duplexrt.core.handoffs import HandoffKind, Handoffs
from duplexrt.core.metrics import FrameMetrics
from duplexrt.core.resume import ResumableTransport
from duplexrt.core.scheduler import BackendStepError, Scheduler, SlotClosedError, new_error_id
from duplexrt.core.stage_meter import StageMeter
from duplexrt.core.state import SessionState, rank
from duplexrt.protocols.base import Translator
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
    SessionEnd,
)
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.transport import Message, Taken, Transport, TransportClosed, poller


log = logging.getLogger("duplexrt.session")

#: Replies and errors a session may have waiting for a client that is not reading: past either
#: bound its reader stops taking messages until the writer catches up.  Audio passes through the
#: same queue, a batch at a time, so the byte bound sits well above one batch of audio.
MAX_PENDING_MESSAGES = 64
MAX_PENDING_BYTES = 1 << 20

#: One row of a step as the outbox holds it: audio, text piece, submitted and stepped (ns).
_Output = tuple[np.ndarray, str | None, int, int]


@attrs.frozen
class SessionServices:
    """What a session takes from the runtime that serves it, handed over explicitly: a session
    can be read (and built in a test) without the runtime, and never reaches back into it."""

    config: Config
    #: Opens the session's slot; everything after goes through the slot's lease.
    scheduler: Scheduler
    #: Counts the session's worker-thread crossings (encoded formats, large messages).
    handoffs: Handoffs
    #: Where per-frame figures and usage totals go.
    metrics: FrameMetrics
    #: The live sessions, so that a shutdown can reach each of them.
    registry: set[Session]
    #: The model's own limit on a session's frames (None: none).
    max_session_frames: int | None = None
    #: Frames the model wants after the caller's input ends (``BackendInfo.flush_frames``).
    flush_frames: int = 0


class Session:
    """Serves one client over ``transport``.  ``run`` returns how the session ended."""

    def __init__(self, services: SessionServices, transport: Transport, protocol: Translator,
                 session_id: int | None = None) -> None:
        config = services.config
        self._services = services
        self._transport = transport
        self._protocol = protocol
        self._requested_id = session_id
        self._model_rate = config.audio.sample_rate
        self._frame_seconds = config.audio.frame_seconds
        self._max_message_seconds = config.audio.max_message_seconds
        self._decoder = self._new_decoder(protocol.input_spec)
        self._encoder = make_encoder(protocol.output_spec, self._model_rate)
        self._framer = Framer(config.audio.frame_size)
        self._frame_size = config.audio.frame_size
        self._always_offload = config.runtime.offload == "always"
        self._inbox_depth = config.runtime.inbox_depth
        # A parked reader resumes only once half its inbox has drained, so that each wake-up
        # submits several frames instead of one: task switches per frame halve or better.
        self._resume_below = max(1, config.runtime.inbox_depth // 2)
        self._max_in_flight = config.runtime.inbox_depth + config.runtime.outbox_depth
        # The outbox: filled by the step delivery (never more than the credits allow), drained
        # whole by the writer.  A deque and a parking lot cost less per frame than a channel.
        self._outbox: deque[_Output] = deque()
        self._outbox_done = False
        self._writer_lot = trio.lowlevel.ParkingLot()
        self._credit = trio.lowlevel.ParkingLot()
        # Every message the translator makes goes in here the moment it is made, and only the
        # writer sends from it: what the client sees is in the order the translator decided,
        # even when the reader (replies, errors) and the writer (audio) both have something.
        self._pending: deque[Message] = deque()
        self._pending_bytes = 0  # len() of every message in _pending: characters or bytes
        # runtime.offload = "always": the writer is encoding a batch on a worker thread, with the
        # encoder a format switch must not flush or replace under it.
        self._encoding = False
        self._encoded = trio.lowlevel.ParkingLot()
        # The direct path: a step's output sent from its delivery, with no writer wake-up, when
        # the transport can send without yielding (``offers_send_nowait``).  Not with offload =
        # "always", whose encoding goes through a worker thread and so through the writer.
        self._send_nowait = (transport.send_nowait  # type: ignore[attr-defined]
                             if getattr(transport, "offers_send_nowait", False) and not self._always_offload
                             else None)
        # The read side's twin: where the transport serves messages (``serve_messages``: a server's
        # read hub), ``_take_nowait`` takes each one as it is read, and the reader task is woken
        # only for what has to wait (held here for it, parsed).
        self._serve_messages = getattr(transport, "serve_messages", None)
        self._held: Event | None = None
        #: Frames of a message taken where it was read that had no credit yet, and how many
        #: frames the message made: the reader submits them (``_submit_rest``).
        self._unsubmitted: tuple[list[np.ndarray], int] | None = None
        # A batch sent from a delivery whose end the transport still holds: the writer counts it
        # as sent once it is out (``flush``).
        self._unflushed: list[_Output] | None = None
        # runtime.coalesce_output: the output of a client message's frames goes out together, as
        # the message came; the delivery holds it until this many frames are delivered (the
        # count submitted once the message's last frame was in).
        self._coalesce = config.runtime.coalesce_output
        self._hold_until = 0
        self._metrics = services.metrics
        self._in_flight = 0  # submitted and not yet sent
        self._submitted = 0
        self._delivered = 0
        self._sent = 0
        self._dropped = 0  # outputs thrown away at the client's request (ClearOutput)
        self._told = 0  # outputs handed to the translator (sent, or being sent)
        self.state = SessionState.OPENING
        self._flush_frames = services.flush_frames
        self._flushed = 0  # flush frames submitted: model input, but not the caller's audio
        self._finish_reason: FinishReason | None = None
        self._finish_error: str | None = None
        self._close_code: int = CloseCode.NORMAL_CLOSURE
        # The whole goodbye (last messages, Close and the peer's answer) fits in this: a peer
        # that never answers cannot keep the session, its slot or a shutdown waiting.
        self._close_timeout = config.server.close_timeout_s
        self._cancel_scope: trio.CancelScope | None = None
        self._reader_scope: trio.CancelScope | None = None
        # A stop (shutdown, the length limit) takes effect between two messages, never inside
        # one: the reader is only cancelled while it waits for the next message, and otherwise
        # stops by itself once the message in hand is submitted whole.
        self._between_messages = False
        self.lease = None
        # Usage: always exact, whatever is collected besides.
        self._text_pieces = 0
        self._first_submit_ns = 0
        self._last_sent_ns = 0
        # Stage timing, only when asked for (None: no clock read, nothing recorded for it).
        self._meter = (StageMeter(services.metrics, self._frame_seconds)
                       if config.metrics.collect_stage_metrics else None)
        limits = [services.max_session_frames]
        if config.runtime.max_session_seconds > 0:
            limits.append(int(config.runtime.max_session_seconds / self._frame_seconds + 1e-9))
        self._max_frames = min((limit for limit in limits if limit), default=None)
        # runtime.late_input = "fill": the session's input clock against the wall clock.
        self._fill = config.runtime.late_input == "fill"
        self._fill_after = config.runtime.fill_after_ms / 1e3
        self._clock_start = 0.0  # trio time of the first frame submitted ...
        self._clock_started = trio.Event()  # ... once there is one
        self._fill_debt = 0  # frames filled whose real audio has not come yet: dropped when it does
        self._frames_filled = 0
        self._frames_dropped_late = 0
        self._silence = np.zeros(config.audio.frame_size, dtype=np.float32)
        if isinstance(transport, ResumableTransport):
            transport.listener = self  # for DETACHED and back
        protocol.attach(self)

    @property
    def frames_in(self) -> int:
        """Model frames submitted so far, flush frames included: the position the translator
        matches output against (what the translator may read)."""
        return self._submitted

    @property
    def frames_flushed(self) -> int:
        """Flush frames submitted after the caller's input or turn ended (``flush_frames``)."""
        return self._flushed

    @property
    def frames_out(self) -> int:
        """Model frames of output sent so far."""
        return self._sent

    @property
    def frames_answered(self) -> int:
        """Frames handed to the translator to send, plus those dropped by ClearOutput."""
        return self._told + self._dropped

    @property
    def max_frames(self) -> int | None:
        """The most frames this session may take, or None (what the translator may read)."""
        return self._max_frames

    # -- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> SessionEnd:
        services = self._services
        self.lease = services.scheduler.open_slot(self, self._requested_id)
        self._advance(SessionState.OPEN)
        metrics = services.metrics
        metrics.sessions_opened += 1
        metrics.sessions_active += 1
        services.registry.add(self)
        if self._meter is not None:
            self._meter.opened()
        try:
            async with trio.open_nursery() as nursery:
                self._cancel_scope = nursery.cancel_scope
                self._queue(self._protocol.start())
                nursery.start_soon(self._write_loop)
                fill_scope = trio.CancelScope()
                if self._fill:
                    nursery.start_soon(self._fill_loop, fill_scope)
                with trio.CancelScope() as self._reader_scope:
                    await self._read_loop()
                if self._reader_scope.cancelled_caught:  # stopped while waiting for a message
                    await self._end_input()
                fill_scope.cancel()  # no input is coming any more: nothing is overdue
        except BaseException as exc:
            if self._finish_reason is None:
                if _only_cancellation(exc):
                    self._finish(FinishReason.SHUTDOWN, None, CloseCode.GOING_AWAY)
                else:
                    log.exception("session %s failed", self.lease.session_id)
                    self._finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)
            raise
        finally:
            self._release()
            services.registry.discard(self)
            metrics.sessions_active -= 1
            with trio.CancelScope(shield=True):
                end = await self._say_goodbye()
            self.state = SessionState.CLOSED
            self._log_end(end)
        return end

    def _log_end(self, end: SessionEnd) -> None:
        timing = self._meter.describe(end.frames_out) if self._meter is not None else ""
        log.info("session %s ended: %s, %d frames in (%.2f s), %d out (%.2f s), %d text pieces, "
                 "%.2f s generating%s%s", self.lease.session_id, end.reason, end.frames_in, end.seconds_in,
                 end.frames_out, end.seconds_out, end.text_tokens_out, end.generation_seconds,
                 f", error: {end.error}" if end.error else "", timing)

    def summary(self) -> SessionEnd:
        return SessionEnd(
            reason=self._finish_reason or FinishReason.STOP,
            frames_in=self._submitted - self._flushed,
            frames_out=self._sent,
            seconds_in=round((self._submitted - self._flushed) * self._frame_seconds, 6),
            seconds_out=round(self._sent * self._frame_seconds, 6),
            error=self._finish_error,
            text_tokens_out=self._text_pieces,
            generation_seconds=round(max(0, self._last_sent_ns - self._first_submit_ns) / 1e9, 6)
            if self._first_submit_ns else 0.0,
            frames_filled=self._frames_filled,
            frames_dropped_late=self._frames_dropped_late,
            frames_flushed=self._flushed,
        )

    @property
    def _taking_no_more(self) -> bool:
        """No more input is taken: stopping, the input ended, or ending."""
        state = self.state  # identity tests: an enum's hash (for a rank lookup) is Python code
        return not (state is _OPEN or state is _DETACHED or state is _OPENING)

    def _advance(self, state: SessionState) -> None:
        """Move forward to ``state``; never back (a later stop does not reopen an ended input)."""
        if rank(state) > rank(self.state):
            self.state = state

    def connection_dropped(self) -> None:
        """The connection dropped and the transport waits for a resume (``ResumableTransport``):
        the session carries on, its input waiting per ``runtime.late_input``."""
        if self.state is SessionState.OPEN:
            self.state = SessionState.DETACHED

    def connection_resumed(self) -> None:
        """A client resumed the session on a new connection."""
        if self.state is SessionState.DETACHED:
            self.state = SessionState.OPEN
        self._metrics.sessions_resumed += 1

    def shutdown(self) -> None:
        """The server is stopping: take no more messages, submit and answer every frame of the
        messages already taken (the one being read included, nothing after it), then end with
        reason ``shutdown``.  Whoever calls this also bounds how long that may take."""
        self._stop_input(FinishReason.SHUTDOWN, CloseCode.GOING_AWAY)

    def _stop_input(self, reason: FinishReason, close_code: int) -> None:
        """End the session after the messages already taken have been answered: the reader stops
        at the next message boundary, the writer finishes, the client gets full usage and
        ``reason``."""
        if self._finish_reason is None:
            self._finish_reason = reason
            self._close_code = close_code
        self._advance(SessionState.STOPPING)
        if self._reader_scope is not None:
            # Mid-message (decoding, submitting, waiting for credit) the reader is left to finish
            # the message: cancelling it there would drop the rest of the message's frames and
            # then submit the framer's tail after the hole.
            if self._between_messages:
                self._reader_scope.cancel()
        elif self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def _finish(self, reason: FinishReason, error: str | None, close_code: int) -> None:
        """Record why the session ends (the first reason wins) and stop its tasks: outputs that
        arrive from now on (a later step of a failed session) are not sent."""
        self._advance(SessionState.CLOSING)
        if self._finish_reason is None:
            self._finish_reason = reason
            self._finish_error = error
            self._close_code = close_code
        if self._cancel_scope is not None:
            self._cancel_scope.cancel()

    def _release(self) -> None:
        assert self.lease is not None
        self.lease.release()
        self._outbox.clear()  # drops any output not yet sent
        self._close_outbox()
        self._framer.clear()

    async def _say_goodbye(self) -> SessionEnd:
        """Send what the writer left (a fatal error, audio cut off mid-send), then the end with
        its usage, then close.  Returns the end as the client was told it."""
        deadline = trio.current_time() + self._close_timeout
        if self._finish_reason == FinishReason.CLIENT_CLOSED:
            with trio.move_on_at(deadline):
                await self._transport.close(self._close_code)
            return self.summary()
        with trio.move_on_at(deadline) as timeout:
            try:
                await self._send_pending()
                # Every output the translator was given is now out.
                self._metrics.frames_out += self._told - self._sent
                self._sent = self._told
                end = self.summary()
                for message in self._protocol.end(end):
                    await self._transport.send(message)
            except TransportClosed:
                pass
        if timeout.cancelled_caught or self._pending:
            end = self.summary()
        reason = end.error or end.reason
        with trio.move_on_at(deadline):  # past it, the transport drops the connection at once
            await self._transport.close(self._close_code, reason[:120])
        return end

    # -- scheduler callbacks (trio thread, once per step) ----------------------------------------

    def step_output(self, output: np.ndarray, text: str | None, submitted_ns: int, stepped_ns: int) -> None:
        state = self.state
        if self.lease is None or self.lease.released or state is _CLOSING or state is _CLOSED:
            return
        self._outbox.append((output, text, submitted_ns, stepped_ns))
        self._delivered += 1
        if self._credit and self._submitted - self._delivered <= self._resume_below:
            self._credit.unpark_all()
        if state is _INPUT_ENDED and self._delivered == self._submitted:
            self._close_outbox()

    def delivery_done(self) -> None:
        """Every row of this delivery is in the outbox (steps that finished while trio was busy
        come together, and go out together, as the writer would send them).  Sent from here when
        nothing stands in the way: the writer is parked with nothing queued before them, and the
        transport sends without yielding; otherwise the writer is woken to send them."""
        if not self._outbox or not self._writer_lot:
            return  # nothing new, or the writer is awake (or ending) and takes the outbox itself
        if self._held is not None:
            # An event read and parsed ahead of this output waits for the reader (the translator
            # may have opened a response for it whose creation is not queued yet): the output
            # goes once the reader has taken it, in the order the translator made things.
            return
        if self._delivered < self._hold_until:
            return  # the rest of the client message's frames are a step or two behind: one answer
        if (self._send_nowait is not None and not self._pending and self._unflushed is None
                and not self._encoding):
            self._send_directly()
        else:
            self._writer_lot.unpark_all()

    def _close_outbox(self) -> None:
        """No more output will come: the writer ends once it has sent what it holds."""
        self._outbox_done = True
        if self._writer_lot:
            self._writer_lot.unpark_all()

    def step_failed(self, error: BaseException) -> None:
        # The client hears a generic message with an error id, never the backend's exception
        # text (paths, shapes, device messages): that is in the log under the same id.
        if isinstance(error, BackendStepError):
            message = str(error)
        else:
            error_id = new_error_id()
            log.error("session %s: the model failed (error id %s)", self.lease.session_id, error_id,
                      exc_info=error)
            message = str(BackendStepError(error_id))
        self._finish(FinishReason.ERROR, message, CloseCode.INTERNAL_ERROR)

    # -- reader ----------------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        poll = poller(self._transport)
        protocol = self._protocol
        try:
            message = await self._receive()
            while True:
                if message is not None:
                    event = protocol.parse(message)
                else:  # taken where it was read (``_take_nowait``): what it needs is done here
                    event, self._held = self._held, None
                    if self._outbox and self._writer_lot:
                        # Output held back while the event waited for this task (delivery_done):
                        # the writer takes it once this task next waits, after what the event
                        # queues (everything below queues before its first wait).
                        self._writer_lot.unpark_all()
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
                elif event is None:  # taken where it was read: what had to wait is done here
                    await self._submit_rest()
                    if self._pending_bytes > MAX_PENDING_BYTES:
                        await self._wait_for_room()
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

    async def _receive(self) -> Message | None:
        """Wait for the next message: the one place where a stop may cancel the reader.  Where
        the transport serves messages (a server's read hub), this waits while ``_take_nowait``
        takes them as they are read, and returns None for one it held (``self._held``)."""
        if self._taking_no_more and self._reader_scope is not None:
            self._reader_scope.cancel()  # asked before the reader got here: a stop cancels only a waiter
        self._between_messages = True
        serve = self._serve_messages
        if serve is None or self._decoder.is_encoded or self._always_offload:
            # Nothing it reads could be taken where it was read (an Opus message decodes on a
            # worker thread): the hub would only wake this task for each one, a step later.
            message = await self._transport.receive()
        else:
            message = await serve(self._take_nowait)
        self._between_messages = False
        return message

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

    def _queue(self, messages: list[Message] | tuple[Message, ...]) -> None:
        """Hand messages to the writer, behind everything made before them."""
        if messages:
            pending = self._pending
            for message in messages:
                pending.append(message)
                self._pending_bytes += len(message)
            if self._writer_lot:
                self._writer_lot.unpark_all()

    def _queue_full(self) -> bool:
        return len(self._pending) > MAX_PENDING_MESSAGES or self._pending_bytes > MAX_PENDING_BYTES

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

    def _hold(self, event: Event | None) -> Taken:
        """Leave the rest of a message taken where it was read to the reader.  The reader is in
        the middle of that message from now on, as if it had read it itself: a stop lets it
        finish the message (``_stop_input``), and the fill loop does not fill under it."""
        self._held = event
        self._between_messages = False
        return Taken.HELD

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

    # -- writer ----------------------------------------------------------------------------------

    async def _send_pending(self) -> None:
        """Send the queued messages in order; each leaves the queue only once sent, so a send cut
        off by cancellation leaves it for the goodbye."""
        pending = self._pending
        transport = self._transport
        while pending:
            message = pending[0]
            await transport.send(message)
            pending.popleft()
            self._pending_bytes -= len(message)
        if self._credit:
            self._credit.unpark_all()  # a reader waiting for room in the queue

    def _send_pending_nowait(self) -> bool:
        """``_send_pending`` without yielding: True once every queued message is out whole.
        False leaves the rest queued (or its end in the transport) for the writer."""
        pending = self._pending
        send_nowait = self._send_nowait
        whole = True
        while pending and whole:
            message = pending[0]
            try:
                whole = send_nowait(message)
            except trio.WouldBlock:
                return False
            pending.popleft()
            self._pending_bytes -= len(message)
        if self._credit:
            self._credit.unpark_all()  # a reader waiting for room in the queue
        return whole and not pending

    async def _write_loop(self) -> None:
        outbox = self._outbox
        metrics = self._metrics
        try:
            while True:
                if self._pending:
                    await self._send_pending()
                if self._unflushed is not None:  # sent from a delivery: wait until all of it is out
                    await self._transport.flush()  # type: ignore[attr-defined]
                    items, self._unflushed = self._unflushed, None
                    self._batch_sent(items)
                if not outbox or self._held is not None:  # (held: see delivery_done)
                    if not outbox and self._outbox_done:
                        break
                    await self._writer_lot.park()
                    metrics.writer_wakeups += 1
                    continue
                items, rows = self._next_batch()
                encoder = self._encoder  # a format switch replaces it between two batches
                if self._always_offload:
                    self._encoding = True
                    try:
                        payload = await self._services.handoffs.offload(
                            HandoffKind.CONVERT_OFFLOAD, encoder.encode_rows, rows)
                    finally:
                        self._encoding = False
                        if self._encoded:
                            self._encoded.unpark_all()
                else:
                    payload = encoder.encode_rows(rows)
                self._tell(items, payload)
                await self._send_pending()
                self._batch_sent(items)
            tail = self._encoder.flush()
            if tail:
                self._queue(self._protocol.audio_out(tail, 0))
            await self._send_pending()
        except TransportClosed as closed:
            self._transport_closed(closed)

    def _send_directly(self) -> None:
        """The writer's work for what a delivery brought, done in the delivery itself (trio
        thread, never raises): batch by batch, each sent without yielding.  A batch that does not
        go out whole (the client reads slowly, the socket is full) is left to the writer, which
        sends what is queued, waits for the transport's flush, and only then counts it sent; the
        rest of the outbox waits for it there."""
        outbox = self._outbox
        try:
            while outbox:
                items, rows = self._next_batch()
                self._tell(items, self._encoder.encode_rows(rows))
                if not self._send_pending_nowait():
                    self._unflushed = items
                    self._writer_lot.unpark_all()
                    return
                self._batch_sent(items)
                self._metrics.direct_batches += 1
        except TransportClosed as closed:
            self._transport_closed(closed)
        except Exception:
            log.exception("session %s failed", self.lease.session_id)
            self._finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)

    # -- one batch of output: what the writer and the direct path share ------------------------

    def _next_batch(self) -> tuple[list[_Output], list[np.ndarray]]:
        """The outbox's next batch and its rows of audio: all of it, but never across a turn's
        end (``next_boundary``), so that each response carries exactly its frames; the rest
        waits for the next batch."""
        outbox = self._outbox
        count = len(outbox)
        answered = self._told + self._dropped
        boundary = self._protocol.next_boundary()
        if boundary is not None and answered < boundary < answered + count:
            count = boundary - answered
            items = [outbox.popleft() for _ in range(count)]
        else:
            items = list(outbox)
            outbox.clear()
        return items, [item[0] for item in items]

    def _tell(self, items: list[_Output], payload: bytes) -> None:
        """Hand a batch to the translator, its messages into the queue behind everything before."""
        protocol = self._protocol
        pending = self._pending
        count = len(items)
        # Text first: a protocol that closes a turn on its last audio (realtime) must not find
        # that turn's text arriving after it.
        for item in items:
            if item[1]:
                self._text_pieces += 1
                self._metrics.text_pieces += 1
                for message in protocol.text_out(item[1]):
                    pending.append(message)
                    self._pending_bytes += len(message)
        # Even with no bytes (an encoder still filling a packet): the translator counts the
        # frames, and may close a turn on them.
        for message in protocol.audio_out(payload, count):
            pending.append(message)
            self._pending_bytes += len(message)
        # Counted as the translator is told, so that what it reads stays in step with what it
        # has said, whatever arrives while the messages are being sent...
        self._told += count

    def _batch_sent(self, items: list[_Output]) -> None:
        """... and as sent only once they are: usage counts what the client got."""
        count = len(items)
        self._sent += count
        self._metrics.frames_out += count
        now = time.perf_counter_ns()
        if self._meter is not None:
            self._meter.batch_sent(items, now, self._last_sent_ns)
        self._last_sent_ns = now
        self._in_flight -= count
        if self._credit:
            self._credit.unpark_all()

    def _transport_closed(self, closed: TransportClosed) -> None:
        if closed.finish_reason is None:
            self._finish(FinishReason.CLIENT_CLOSED, None, CloseCode.NORMAL_CLOSURE)
        else:  # this end closed it (a limit, a dead peer): its own reason, for the log and usage
            self._finish(closed.finish_reason, None, closed.code)


_OPENING = SessionState.OPENING
_OPEN = SessionState.OPEN
_DETACHED = SessionState.DETACHED
_CLOSING = SessionState.CLOSING
_CLOSED = SessionState.CLOSED
_INPUT_ENDED = SessionState.INPUT_ENDED


def _only_cancellation(exc: BaseException) -> bool:
    """True when ``exc`` is a cancellation, or a group of nothing but cancellations."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
