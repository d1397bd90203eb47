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

This module holds what the whole session shares: its state (all of it set up in
``Session.__init__``), its lifecycle and end, and what the scheduler calls.  The halves that
move a frame are mixins in modules of their own: ``session_input`` (the reader: a message to
frames in the slot) and ``session_output`` (the writer and the direct path: output and replies to the client, in order).
They are one object because they share one set of counters, the credits that tie the two
directions together; the split is by what each piece of code does, and every piece reads the
state where it is described."""

from __future__ import annotations

import logging
from collections import deque

import attrs
import numpy as np
import trio

from duplexrt.audio import Framer, make_encoder
from duplexrt.config import Config
from duplexrt.core.handoffs import Handoffs
from duplexrt.core.metrics import FrameMetrics
from duplexrt.wire.resume import ResumableTransport
from duplexrt.core.scheduler import BackendStepError, Scheduler, new_error_id
from duplexrt.core.session_input import SessionInput
from duplexrt.core.session_output import Output, SessionOutput
from duplexrt.core.stage_meter import StageMeter
from duplexrt.core.state import SessionState, rank
from duplexrt.protocols.base import Translator
from duplexrt.protocols.events import SessionEnd
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message, Transport, TransportClosed, direct_send


log = logging.getLogger("duplexrt.session")


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


class Session(SessionInput, SessionOutput):
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
        self._outbox: deque[Output] = deque()
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
        # the transport can send without yielding (``DirectSend``, checked here once).  Not with
        # offload = "always", whose encoding goes through a worker thread and so through the writer.
        self._direct = direct_send(transport) if not self._always_offload else None
        self._send_nowait = self._direct.send_nowait if self._direct is not None else None
        # A batch sent from a delivery whose end the transport still holds: the writer counts it
        # as sent once it is out (``flush``).
        self._unflushed: list[Output] | None = None
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
        log.info("session %s opened: %s in, %s out, slot %d, %d active", self.lease.session_id,
                 self._protocol.input_spec, self._protocol.output_spec, self.lease.slot, metrics.sessions_active)
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
