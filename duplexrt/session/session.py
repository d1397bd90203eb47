"""One conversation: client audio in, through the session's slot, model audio out.

Each session is a nursery of its own with two tasks: the ``Reader`` (a message to frames in the
slot) and the ``Writer`` (the model's output, and the translator's replies, to the client).  The
model's output comes back as the scheduler delivers it, a whole step at a time, and is sent from
the delivery itself when nothing stands in the way.  When the nursery ends — the client said it
was done, went away, misbehaved, or the runtime is stopping — the slot and every buffer the
session held are freed with it.

What the two halves share is explicit and small: the ``Credits`` (the counters that tie input to
output, so that a client that stops reading stops only its own input), the ``Outgoing`` queue
(every message to the client, in the translator's order) and the ``Lifecycle`` (the state, and
why the session ends).  Each half is built with exactly what it uses.  This class builds them,
runs the tasks, says goodbye, and is what the scheduler (``SlotOwner``), the translator
(``SessionProgress``) and a resumable transport (``ConnectionListener``) talk to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import attrs
import numpy as np
import trio

from duplexrt.audio import make_decoder, make_encoder
from duplexrt.backends.base import PersonaError
from duplexrt.config import Config
from duplexrt.core.handoffs import Handoffs
from duplexrt.core.metrics import FrameMetrics
from duplexrt.core.scheduler import BackendStepError, Scheduler, SlotLease, new_error_id
from duplexrt.core.stage_meter import StageMeter
from duplexrt.protocols.base import PersonaCheck, Translator
from duplexrt.protocols.events import SessionEnd
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.session.credits import Credits
from duplexrt.session.lifecycle import Lifecycle, SessionState
from duplexrt.session.outgoing import Outgoing
from duplexrt.session.reader import Reader
from duplexrt.session.writer import Writer
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.transcripts.keeper import Transcripts
from duplexrt.transcripts.record import CallTranscript
from duplexrt.wire.resume import ResumableTransport
from duplexrt.wire.transport import Transport, TransportClosed, direct_send

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
    #: ``Backend.check_persona`` for a model that takes a persona (``takes_persona``); None: the
    #: model takes none, and the session never sets one.
    persona_check: PersonaCheck | None = None
    #: Where the call's transcript goes when it ends (``[transcripts]``); None: none is recorded.
    transcripts: Transcripts | None = None


class Session:
    """Serves one client over ``transport``.  ``run`` returns how the session ended."""

    def __init__(self, services: SessionServices, transport: Transport, protocol: Translator,
                 session_id: int | None = None, *, route: str = "", peer: str = "") -> None:
        config = services.config
        #: The path the session was opened on and the client's address, for the log lines and the
        #: counters by route ("" when served without a route or from no known address).
        self.route = route
        self._where = "".join([f", on {route}" if route else "", f" from {peer}" if peer else ""])
        self._services = services
        self._transport = transport
        self._protocol = protocol
        self._requested_id = session_id
        self._frame_seconds = config.audio.frame_seconds
        # Built here, so that a format the session cannot serve fails before a slot is taken.
        self._decoder = make_decoder(protocol.input_spec, config.audio.sample_rate, config.audio.max_message_seconds)
        self._encoder = make_encoder(protocol.output_spec, config.audio.sample_rate)
        self.credits = Credits(config.runtime.inbox_depth, config.runtime.outbox_depth)
        self.outgoing = Outgoing(self.credits)
        self.lifecycle = Lifecycle()
        # The whole goodbye (last messages, Close and the peer's answer) fits in this: a peer
        # that never answers cannot keep the session, its slot or a shutdown waiting.
        self._close_timeout = config.server.close_timeout_s
        self.lease: SlotLease | None = None
        #: Frames the slot held not yet stepped when the session ended (a client's Close drops
        #: its queued audio at once: ``Reader.watch_for_close``), for the end's log line.
        self.frames_dropped = 0
        #: The two halves, built once the slot is open (``run``).
        self.reader: Reader | None = None
        self.writer: Writer | None = None
        # Stage timing, only when asked for (None: no clock read, nothing recorded for it).
        self._meter = (StageMeter(services.metrics, self._frame_seconds)
                       if config.metrics.collect_stage_metrics else None)
        limits = [services.max_session_frames]
        if config.runtime.max_session_seconds > 0:
            limits.append(int(config.runtime.max_session_seconds / self._frame_seconds + 1e-9))
        self._max_frames = min((limit for limit in limits if limit), default=None)
        if isinstance(transport, ResumableTransport):
            transport.listener = self  # for DETACHED and back
        #: Both sides' text as the call runs (``[transcripts]``), handed over once when it ends;
        #: None when nothing keeps transcripts.  Its id is the one the client is told, if any.
        self.record: CallTranscript | None = None
        if services.transcripts is not None:
            self.record = services.transcripts.record(protocol.call_id, route, self._frame_seconds * 1e3)
        protocol.attach(self)
        # Before ``start``: a translator echoes the persona in effect from its first message.
        protocol.persona.check = services.persona_check

    @property
    def state(self) -> SessionState:
        return self.lifecycle.state

    # -- what the translator may read (``SessionProgress``) ------------------------------------------

    @property
    def frames_in(self) -> int:
        """Model frames submitted so far, flush frames included: the position the translator
        matches output against."""
        return self.credits.submitted

    @property
    def frames_flushed(self) -> int:
        """Flush frames submitted after the caller's input or turn ended (``flush_frames``)."""
        return self.reader.flushed if self.reader is not None else 0

    @property
    def frames_out(self) -> int:
        """Model frames of output sent so far."""
        return self.credits.sent

    @property
    def frames_answered(self) -> int:
        """Frames handed to the translator to send, plus those dropped by ClearOutput."""
        return self.credits.answered

    @property
    def max_frames(self) -> int | None:
        """The most frames this session may take, or None."""
        return self._max_frames

    # -- the session's life --------------------------------------------------------------------------

    async def run(self) -> SessionEnd:
        services = self._services
        config = services.config
        lease = self.lease = services.scheduler.open_slot(self, self._requested_id)
        if self.record is not None:
            self.record.session_id = lease.session_id
        lifecycle = self.lifecycle
        lifecycle.advance(SessionState.OPEN)
        always_offload = config.runtime.offload == "always"
        # The direct path: a step's output sent from its delivery, with no writer wake-up, when
        # the transport can send without yielding (``DirectSend``, checked here once).  Not with
        # offload = "always", whose encoding goes through a worker thread and so the writer.
        writer = self.writer = Writer(
            session_id=lease.session_id, transport=self._transport,
            direct=None if always_offload else direct_send(self._transport), protocol=self._protocol,
            encoder=self._encoder, model_rate=config.audio.sample_rate, credits=self.credits,
            outgoing=self.outgoing, lifecycle=lifecycle, metrics=services.metrics, meter=self._meter,
            handoffs=services.handoffs if always_offload else None, coalesce=config.runtime.coalesce_output)
        persona = self._protocol.persona
        reader = self.reader = Reader(
            config=config, transport=self._transport, protocol=self._protocol, lease=lease, decoder=self._decoder,
            credits=self.credits, outgoing=self.outgoing, writer=writer, lifecycle=lifecycle,
            handoffs=services.handoffs, metrics=services.metrics, meter=self._meter, max_frames=self._max_frames,
            flush_frames=services.flush_frames, end_of_input=services.scheduler.end_of_input,
            persona=persona if persona.taken else None)
        metrics = services.metrics
        metrics.sessions_opened += 1
        metrics.sessions_active += 1
        metrics.active_by_route[self.route] += 1
        services.registry.add(self)
        if self._meter is not None:
            self._meter.opened()
        log.info("session %s opened: %s in, %s out, slot %d, %d active%s", lease.session_id,
                 self._protocol.input_spec, self._protocol.output_spec, lease.slot, metrics.sessions_active,
                 self._where)
        try:
            async with trio.open_nursery() as nursery:
                lifecycle.cancel_scope = nursery.cancel_scope
                self.outgoing.queue(self._protocol.start())
                if persona.taken and self._protocol.persona_at_start:
                    # The persona came in the URL: it goes to the slot now, not at the first
                    # frame, so its prompt runs before the caller speaks (and, on /api/chat,
                    # before the handshake that tells the caller to).
                    reader.set_persona()
                watch_scope = trio.CancelScope()  # the Close watch lasts as long as the writer
                nursery.start_soon(self._write, writer, watch_scope)
                if getattr(self._transport, "watch_for_close", None) is not None:
                    nursery.start_soon(self._watch_for_close, reader, watch_scope)
                fill_scope = trio.CancelScope()
                if reader.fills:
                    nursery.start_soon(reader.fill_loop, fill_scope)
                await reader.run()
                fill_scope.cancel()  # no input is coming any more: nothing is overdue
        except BaseException as exc:
            if lifecycle.finish_reason is None:
                if _only_cancellation(exc):
                    lifecycle.finish(FinishReason.SHUTDOWN, None, CloseCode.GOING_AWAY)
                else:
                    log.exception("session %s failed", lease.session_id)
                    lifecycle.finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)
            raise
        finally:
            self.frames_dropped = lease.release()  # frames not yet stepped: a Close, an error, a cut
            writer.outbox.clear()  # drops any output not yet sent
            writer.close_outbox()
            reader.release()
            services.registry.discard(self)
            metrics.sessions_active -= 1
            metrics.active_by_route[self.route] -= 1
            with trio.CancelScope(shield=True):
                end = await self._say_goodbye()
            self._keep_transcript(end)
            metrics.sessions_ended[self.route, str(end.reason)] += 1
            lifecycle.state = SessionState.CLOSED
            self._log_end(end)
            self._let_go()
        return end

    @staticmethod
    async def _write(writer: Writer, watch_scope: trio.CancelScope) -> None:
        try:
            await writer.run()
        finally:
            watch_scope.cancel()  # every output is out: nothing is left for a Close to cut short

    @staticmethod
    async def _watch_for_close(reader: Reader, scope: trio.CancelScope) -> None:
        with scope:
            await reader.watch_for_close()

    def _let_go(self) -> None:
        """Over: break the references back to this session (the translator's counters, the
        slot's owner), so that the session and everything it holds (buffers, translator,
        journal) go when the last outside reference does, by reference counting, not at a
        later cycle collection: a busy server would otherwise carry many ended sessions."""
        self._protocol.progress = _EndedProgress(self.frames_in, self.frames_flushed, self.frames_out,
                                                 self.frames_answered, self._max_frames)
        lease = self.lease
        if lease is not None:
            lease.owner = _NO_OWNER

    def _keep_transcript(self, end: SessionEnd) -> None:
        """Hand the call's transcript over, once: before the end goes to the client where the
        session says goodbye (so a client that fetches it on the end finds it), else here."""
        record = self.record
        transcripts = self._services.transcripts
        if record is None or transcripts is None:
            return
        self.record = None
        record.finish(str(end.reason), end.error)
        transcripts.keep(record)

    def _log_end(self, end: SessionEnd) -> None:
        timing = self._meter.describe(end.frames_out) if self._meter is not None else ""
        log.info("session %s ended: %s, %d frames in (%.2f s), %d out (%.2f s), %d text pieces, "
                 "%.2f s generating%s%s%s%s", self.lease.session_id if self.lease else None, end.reason,
                 end.frames_in, end.seconds_in, end.frames_out, end.seconds_out, end.text_tokens_out,
                 end.generation_seconds, f", error: {end.error}" if end.error else "",
                 f", {self.frames_dropped} queued frames dropped unstepped" if self.frames_dropped else "",
                 timing, self._where)

    def summary(self) -> SessionEnd:
        credits = self.credits
        reader = self.reader
        writer = self.writer
        flushed = reader.flushed if reader is not None else 0
        first_submit_ns = reader.first_submit_ns if reader is not None else 0
        last_sent_ns = writer.last_sent_ns if writer is not None else 0
        return SessionEnd(
            reason=self.lifecycle.finish_reason or FinishReason.STOP,
            frames_in=credits.submitted - flushed,
            frames_out=credits.sent,
            seconds_in=round((credits.submitted - flushed) * self._frame_seconds, 6),
            seconds_out=round(credits.sent * self._frame_seconds, 6),
            error=self.lifecycle.finish_error,
            text_tokens_out=writer.text_pieces if writer is not None else 0,
            generation_seconds=round(max(0, last_sent_ns - first_submit_ns) / 1e9, 6)
            if first_submit_ns else 0.0,
            frames_filled=reader.frames_filled if reader is not None else 0,
            frames_dropped_late=reader.frames_dropped_late if reader is not None else 0,
            frames_flushed=flushed,
        )

    def connection_dropped(self) -> None:
        """The connection dropped and the transport waits for a resume (``ResumableTransport``):
        the session carries on, its input waiting per ``runtime.late_input``."""
        self.lifecycle.detach()

    def connection_resumed(self) -> None:
        """A client resumed the session on a new connection."""
        self.lifecycle.reattach()
        self._services.metrics.sessions_resumed += 1

    def shutdown(self) -> None:
        """The server is stopping: take no more messages, submit and answer every frame of the
        messages already taken (the one being read included, nothing after it), then end with
        reason ``shutdown``.  Whoever calls this also bounds how long that may take."""
        self.lifecycle.stop_input(FinishReason.SHUTDOWN, CloseCode.GOING_AWAY)

    async def _say_goodbye(self) -> SessionEnd:
        """Send what the writer left (a fatal error, audio cut off mid-send), then the end with
        its usage, then close.  Returns the end as the client was told it."""
        lifecycle = self.lifecycle
        transport = self._transport
        deadline = trio.current_time() + self._close_timeout
        if lifecycle.finish_reason == FinishReason.CLIENT_CLOSED:
            self._keep_transcript(self.summary())
            with trio.move_on_at(deadline):
                await transport.close(lifecycle.close_code)
            return self.summary()
        end = None
        with trio.move_on_at(deadline) as timeout:
            try:
                await self.outgoing.send(transport)
                # Every output the translator was given is now out.
                credits = self.credits
                self._services.metrics.frames_out += credits.told - credits.sent
                credits.sent = credits.told
                end = self.summary()
                self._keep_transcript(end)
                for message in self._protocol.end(end):
                    await transport.send(message)
            except TransportClosed:
                pass
        if end is None or timeout.cancelled_caught or self.outgoing.pending:
            end = self.summary()
        reason = end.error or end.reason
        if isinstance(transport, ResumableTransport) and lifecycle.finish_reason is not FinishReason.SHUTDOWN:
            # Ended while detached: the end and its usage wait in the journal for the client's
            # return, as long as a resume may come (the slot is free already).  Not when the
            # server is stopping: no resume will come.
            deadline = max(deadline, transport.resume_deadline + self._close_timeout)
        with trio.move_on_at(deadline):  # past it, the transport drops the connection at once
            await transport.close(lifecycle.close_code, reason[:120])
        return end

    # -- the scheduler's callbacks (``SlotOwner``: trio thread, once per step) -----------------------

    def step_output(self, output: np.ndarray, text: str | None, submitted_ns: int, stepped_ns: int) -> None:
        # Once per frame: the credit rule (credits.py) written out, no call.
        lease = self.lease
        writer = self.writer
        state = self.lifecycle.state
        if lease is None or lease.released or writer is None or state is _CLOSING or state is _CLOSED:
            return
        writer.outbox.append((output, text, submitted_ns, stepped_ns))
        credits = self.credits
        if text and self.record is not None:
            self.record.model(text, credits.delivered)
        credits.delivered += 1
        if credits.lot and credits.submitted - credits.delivered <= credits.resume_below:
            credits.lot.unpark_all()
        if state is _INPUT_ENDED and credits.delivered == credits.submitted:
            writer.close_outbox()

    def transcript(self, pieces: Sequence[TranscriptPiece]) -> None:
        """What the caller said (a transcriber's pieces for this step): the translator's
        messages for them, queued now, ahead of this step's output."""
        lease = self.lease
        state = self.lifecycle.state
        if lease is None or lease.released or state is _CLOSING or state is _CLOSED:
            return
        if self.record is not None:
            self.record.caller(pieces)
        if not self.lifecycle.sending:
            return
        messages = self._protocol.input_text(pieces)
        if messages:
            self.outgoing.queue(messages)

    def delivery_done(self) -> None:
        """Every row of this delivery is in the outbox: the writer sends it (see ``Writer``)."""
        if self.writer is not None:
            self.writer.delivery_done()

    def persona_set(self) -> None:
        """The model took the session's persona: whatever the translator held back for it (the
        Moshi handshake) goes out now, ahead of any output."""
        if self.lifecycle.sending:
            self.outgoing.queue(self._protocol.persona_ready())

    def step_failed(self, error: BaseException) -> None:
        # The client hears a generic message with an error id, never the backend's exception
        # text (paths, shapes, device messages): that is in the log under the same id.
        if isinstance(error, PersonaError):  # the model refused the persona: its words are the caller's to read
            self.lifecycle.finish(FinishReason.ERROR, f"the model refused the persona: {error}",
                                  CloseCode.POLICY_VIOLATION)
            return
        if isinstance(error, BackendStepError):
            message = str(error)
        else:
            error_id = new_error_id()
            log.error("session %s: the model failed (error id %s)", self.lease.session_id if self.lease else None,
                      error_id, exc_info=error)
            message = str(BackendStepError(error_id))
        self.lifecycle.finish(FinishReason.ERROR, message, CloseCode.INTERNAL_ERROR)


@attrs.frozen
class _EndedProgress:
    """A session's last counters, for a translator that outlives it (``SessionProgress``)."""

    frames_in: int
    frames_flushed: int
    frames_out: int
    frames_answered: int
    max_frames: int | None


class _NoOwner:
    """The slot owner of an ended session's lease: a late delivery finds no one to tell."""

    def step_output(self, output: np.ndarray, text: str | None, submitted_ns: int, stepped_ns: int) -> None:
        pass

    def transcript(self, pieces: Sequence[TranscriptPiece]) -> None:
        pass

    def delivery_done(self) -> None:
        pass

    def step_failed(self, error: BaseException) -> None:
        pass

    def persona_set(self) -> None:
        pass


_NO_OWNER = _NoOwner()
_INPUT_ENDED = SessionState.INPUT_ENDED
_CLOSING = SessionState.CLOSING
_CLOSED = SessionState.CLOSED


def _only_cancellation(exc: BaseException) -> bool:
    """True when ``exc`` is a cancellation, or a group of nothing but cancellations."""
    if isinstance(exc, BaseExceptionGroup):
        return all(_only_cancellation(e) for e in exc.exceptions)
    return isinstance(exc, trio.Cancelled)
