"""One WebSocket connection's state, without I/O: bytes in, events out; messages in, bytes out.

``native.NativeWebSocket`` drives a ``Connection`` over a trio socket; everything it must know to
decide what the connection may still do lives here, in one place, as h11 and wsproto keep it:

- ``state`` (``ConnectionState``): the closing handshake, as each side's Close has gone or come;
- ``ended``: why THIS end ended the connection (a broken frame, a limit the driver enforces),
  the one thing every later receive and send raises;
- ``gone``: how the PEER ended it (its Close, or a connection that dropped), what a receive
  raises once the messages already read have been taken;
- the read side: the frame parser (the socket reads straight into its buffer: ``room`` and
  ``received``), whether a broken frame spent it, and whether this end shut its reading.

Input: ``receive_into(messages)`` queues every whole message parsed so far and counts pongs, and
hands back the event that needs an answer (the latest ``Ping`` of the bytes read, the peer's
``Close``, a ``FrameError``), having already recorded what it means for the state.  Output:
``frame``, ``answer_pings``, ``ping`` and ``close`` give the bytes to write, and ``close`` moves the state.

Two rules keep a peer's control frames from costing the server more than they cost the peer: a
burst of pings read together is answered in one write, for the latest ``PONGS_PER_BURST`` of them
(RFC 6455 5.5.3 allows answering only the latest; the Autobahn suite, and some clients' keepalive,
expect a pong for each of a few), and a peer that sends more than ``MAX_CONTROL_RATE`` control frames a second, over a window of
``CONTROL_WINDOW_S``, is closed with 1008.  Pings and pongs are there for liveness: a client pings
every few seconds at most, so the limit is far above any honest one.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Callable

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.frames import (Close, FrameError, FrameParser, MaskKeys, Opcode, Ping, Pong, close_payload,
                                  frame, frame_header, masked_frame_parts)
from duplexrt.wire.transport import Message, TransportClosed


class ConnectionState(enum.Enum):
    """Where the closing handshake stands (RFC 6455 7.1)."""

    #: Messages may go both ways.
    OPEN = "open"
    #: This end sent its Close and waits for the peer's; nothing more is sent.
    CLOSE_SENT = "close sent"
    #: The peer sent its Close; this end answers with its own, and reads nothing more.
    CLOSE_RECEIVED = "close received"
    #: Both Closes went: nothing more either way.  (A connection that drops is ``gone``, in
    #: whichever state it was.)
    CLOSED = "closed"


#: The most control frames (pings and pongs) a peer may send a second, averaged over a window of
#: ``CONTROL_WINDOW_S``: past it the connection closes with 1008.  A ping costs the server a
#: parse and a pong write, as much as a message of audio; a flood of them took every other
#: session's turns on the one trio thread (``tests/test_under_attack_wire.py``).
MAX_CONTROL_RATE = 100
#: The window the control-frame rate is counted over: a short burst above the rate is fine.
CONTROL_WINDOW_S = 2.0
#: The most pongs one burst of pings read together gets, for the latest pings: the older ones of
#: a longer burst get none.
PONGS_PER_BURST = 16
#: ``receive_into`` stops once it has queued this many messages: a read of tiny messages is
#: parsed a batch at a time, as they are taken, not thousands in one go on the trio thread.
PARSE_BATCH = 64

_CLOSE_SENT = ConnectionState.CLOSE_SENT
_CLOSED = ConnectionState.CLOSED


def dropped() -> TransportClosed:
    """What a receive raises once the peer has hung up without a Close."""
    return TransportClosed(CloseCode.ABNORMAL_CLOSURE, "the connection dropped without a Close frame")


class Connection:
    """One end of a WebSocket (see the module docstring).  ``client``: this end masks what it
    sends and the peer must not; ``max_message``: the largest message the peer may send."""

    def __init__(self, *, client: bool, max_message: int, clock: Callable[[], float] = time.monotonic,
                 max_control_rate: float = MAX_CONTROL_RATE) -> None:
        self.client = client
        self.state = ConnectionState.OPEN
        #: Why this end ended the connection: what every later receive and send raises.
        self.ended: TransportClosed | None = None
        #: How the peer ended it (its Close, or a drop): what a receive raises once the
        #: messages already read are taken.
        self.gone: TransportClosed | None = None
        #: The peer's Close, once it came.
        self.peer_close: Close | None = None
        #: A broken frame spent the parser: what the socket still brings is only read past.
        self.failed = False
        #: This end shut its reading (the idle limit): the end of the stream is no hang-up then.
        self.read_shut = False
        #: The stream ended after this end shut its reading: nothing more will be read.
        self.eof = False
        #: Pongs received so far (the keepalive reads it).
        self.pongs = 0
        #: ``receive_into`` stopped at ``PARSE_BATCH`` messages: bytes read wait to be parsed.
        self.backlog = False
        #: Data messages parsed after this end's Close went, and thrown away (``receive_into``).
        self.discarded = 0
        self.parser = FrameParser(masked=not client, max_message=max_message)
        self._mask_keys = MaskKeys() if client else None
        #: The control-frame rate: ``clock`` (seconds) is read once per window's worth of
        #: control frames, never per frame.
        self._clock = clock
        self._max_control_rate = max_control_rate
        self._control_allowance = max(1, int(max_control_rate * CONTROL_WINDOW_S))
        self._controls = 0
        self._window_start = clock()
        #: The pings read and not yet answered (``answer_pings``), the latest ``PONGS_PER_BURST``.
        self._unanswered: deque[Ping] = deque(maxlen=PONGS_PER_BURST)
        #: An event parsed after a ping of the same read, handed back by the next call once that
        #: ping is answered (a Close, a FrameError).
        self._held: Close | FrameError | None = None

    # -- the state, as the driver asks about it ----------------------------------------------------

    @property
    def close_sent(self) -> bool:
        state = self.state
        return state is ConnectionState.CLOSE_SENT or state is ConnectionState.CLOSED

    @property
    def reading(self) -> bool:
        """Something may still come in: no Close from the peer, no drop, no broken frame, no end
        of the stream after this end stopped reading."""
        return self.peer_close is None and self.gone is None and not (self.failed or self.eof)

    def send_error(self) -> TransportClosed | None:
        """What a send raises now, or None while sending is allowed.  An ended input (the idle
        limit) still lets a session send its end: only a closing or closed connection stops it."""
        state = self.state  # once per message sent: the states by identity, no property call
        if state is _CLOSE_SENT or state is _CLOSED or self.gone is not None:
            return self.ended or self.gone or TransportClosed(CloseCode.GOING_AWAY, "the connection is closing")
        return None

    def closed_error(self) -> TransportClosed:
        """What a write that found the connection gone raises."""
        return self.ended or self.gone or dropped()

    def receive_error(self) -> TransportClosed | None:
        """What a receive raises once no message waits, or None while one may still come."""
        if self.ended is not None:
            return self.ended
        if self.gone is not None:
            return self.gone
        if self.eof:
            return dropped()
        return None

    # -- input ---------------------------------------------------------------------------------------

    def receive_into(self, messages: deque[Message]) -> Ping | Close | FrameError | None:
        """Append every whole message parsed so far to ``messages`` (at most ``PARSE_BATCH`` a
        call: ``backlog`` says more may be parsed; once this end's Close went, none: they are
        counted in ``discarded`` and dropped) and count pongs; return what
        needs an answer, its meaning already recorded: the latest ``Ping`` once the bytes run out
        (``answer_pings`` answers it and those before it), else a ``Close`` (the peer's end) or a
        ``FrameError`` (this end's).  A Close or a FrameError that follows a ping is handed back
        by the next call, so the ping is answered first.  A plain call, no coroutine: a read that
        brings audio needs no other work."""
        held = self._held
        if held is not None:
            self._held = None
            return held
        parser = self.parser
        # Once this end's Close went, no one takes another message: each one parsed is dropped
        # at once (RFC 6455 1.4: data after sending Close may be ignored).  Kept, a peer that
        # streams large messages into the closing handshake held all of them until the close
        # timeout, hundreds of MiB a connection (``tests/test_under_attack_wire.py``).
        append = self._discard if self.state is _CLOSE_SENT else messages.append
        ping: Ping | None = None
        batch = PARSE_BATCH
        while True:
            if not batch:
                self.backlog = True
                return ping
            try:
                event = parser.next()
            except FrameError as error:
                self._broken(error)
                return self._after(ping, error)
            if event is None:
                self.backlog = False
                return ping
            kind = type(event)
            if kind is bytes or kind is str:  # exactly: a Ping and a Pong are bytes too
                append(event)  # type: ignore[arg-type]
                batch -= 1
                continue
            if isinstance(event, Close):
                self._peer_closed(event)
                return self._after(ping, event)
            # A Ping or a Pong, by elimination: a control frame, counted against the rate.
            self._controls += 1
            if self._controls >= self._control_allowance:
                too_fast = self._control_rate_checked()
                if too_fast is not None:
                    return self._after(ping, too_fast)
            if kind is Pong:
                self.pongs += 1
            else:
                ping = event  # type: ignore[assignment]  # a Ping, by elimination
                self._unanswered.append(event)  # type: ignore[arg-type]

    def _discard(self, message: Message) -> None:
        self.discarded += 1

    def _after(self, ping: Ping | None, event: Close | FrameError) -> Ping | Close | FrameError:
        """``event`` now, or ``ping`` now and ``event`` from the next call."""
        if ping is None:
            return event
        self._held = event
        return ping

    def _control_rate_checked(self) -> FrameError | None:
        """A window's allowance of control frames has come: too fast (ended with 1008, the
        error returned), or a new window starts."""
        now = self._clock()
        if now - self._window_start < CONTROL_WINDOW_S:
            error = FrameError(CloseCode.POLICY_VIOLATION,
                               f"more than {self._max_control_rate:g} control frames a second")
            self.failed = True
            self.backlog = False
            self.end(FinishReason.PROTOCOL_ERROR, error.code, error.reason)
            return error
        self._window_start = now
        self._controls = 0
        return None

    def _broken(self, error: FrameError) -> None:
        self.failed = True
        self.backlog = False  # a spent parser: nothing more is parsed
        finish = FinishReason.MESSAGE_TOO_BIG if error.code == CloseCode.MESSAGE_TOO_BIG else FinishReason.PROTOCOL_ERROR
        self.end(finish, error.code, error.reason)

    def _peer_closed(self, close: Close) -> None:
        self.peer_close = close
        self.backlog = False  # nothing after a Close counts
        if self.gone is None:
            self.gone = TransportClosed(close.code, close.reason)
        self.state = ConnectionState.CLOSED if self.state is ConnectionState.CLOSE_SENT else ConnectionState.CLOSE_RECEIVED

    def stream_ended(self) -> None:
        """A read found the end of the stream."""
        if self.read_shut:
            self.eof = True  # this end stopped reading (idle): sending still works
        else:
            self.lost()

    def lost(self) -> None:
        """The connection is gone under both directions (a reset, a broken pipe, no more bytes)."""
        if self.gone is None:
            self.gone = dropped()

    def shut_reading(self) -> None:
        """This end stops reading (the idle limit): the stream's end that follows is no drop."""
        self.read_shut = True

    def end(self, finish_reason: FinishReason, code: int, reason: str) -> TransportClosed:
        """This end ends the connection with ``code`` and ``reason`` (the first reason wins)."""
        if self.ended is None:
            self.ended = TransportClosed(code, reason, finish_reason)
        return self.ended

    # -- output --------------------------------------------------------------------------------------

    def frame(self, message: Message) -> tuple[bytes | bytearray, bytes]:
        """A message as one frame, header and payload apart for one writev: a server's payload
        not copied, a client's masked in one copy (``masked_frame_parts``)."""
        keys = self._mask_keys
        if isinstance(message, str):
            payload: bytes | bytearray | memoryview = message.encode()
            opcode = Opcode.TEXT
        else:
            opcode = Opcode.BINARY
            if keys is not None:  # masked into a buffer of its own anyway: no copy of a view first
                return masked_frame_parts(opcode, message, keys.next())
            payload = message if type(message) is bytes else bytes(message)
        if keys is not None:
            return masked_frame_parts(opcode, payload, keys.next())
        return frame_header(opcode, len(payload)), payload  # type: ignore[return-value]  # bytes, from above

    def ping(self) -> bytes:
        return frame(Opcode.PING, b"duplexrt", masked=self.client)

    def answer_pings(self) -> bytes | None:
        """The answers to the pings read since the last call, in order, in one buffer (the latest
        ``PONGS_PER_BURST`` of them); None when there are none, or once this end's Close went
        (nothing more is sent)."""
        unanswered = self._unanswered
        if not unanswered or self.close_sent:
            unanswered.clear()
            return None
        masked = self.client
        data = b"".join(frame(Opcode.PONG, ping, masked=masked) for ping in unanswered)
        unanswered.clear()
        return data

    def close(self, code: int, reason: str) -> bytes | None:
        """This end's Close frame, or None when there is none to send: one went already, or the
        connection dropped with no Close of the peer's to answer."""
        if self.close_sent or (self.gone is not None and self.peer_close is None):
            return None
        self.state = ConnectionState.CLOSED if self.state is ConnectionState.CLOSE_RECEIVED else ConnectionState.CLOSE_SENT
        return frame(Opcode.CLOSE, close_payload(code, reason), masked=self.client)
