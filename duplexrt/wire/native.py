"""A WebSocket ``Transport`` that drives the socket itself, once the handshake is done: the thin
trio driver of a sans-IO ``connection.Connection``, which holds what the connection may still do
and why it ended; this module holds only the I/O (reads, writes, waits and deadlines).

Why not trio-websocket on the hot path: it runs a background reader task per connection that
parses each message with wsproto and hands it to the session through a memory channel, so every
input message costs a task wake-up, a channel hop and a per-byte Python unmask before the session
sees it.  Here whoever needs bytes reads them: the session's own reader task calls ``receive``,
which reads a chunk from the socket and parses the whole frames in it (``frames``), a batch of
messages at a time; messages already parsed are taken with ``poll`` (or ``receive_nowait``) in
the same wake-up, up to a turn's share (``_TURN_MESSAGES``, ``_TURN_NS``) before it yields.  A
message goes out as one ``send_all`` of header and payload.

What keeps working when the session is not reading (its input ended, or it waits for the client to
read): the keepalive reads by itself while it waits for a pong, and stops reading ahead once
``queue_limit`` messages wait unread, as trio-websocket does; a close reads until the peer's Close
and drops the messages that come meanwhile (no one takes them).  Pings are answered by whoever reads
them without waiting for the write turn (``_send_pongs``): a reader never waits on a writer.  On a
server it also bounds how long a connection may hold its slot without doing its part: a first
message that never comes, a peer that stops answering pings or sends nothing for too long, and a
closing handshake the peer never finishes all end the connection, each with a finish reason of its
own (``TransportClosed.finish_reason``) so that the log tells a limit from a hang-up.
"""

from __future__ import annotations

import logging
import math
import os
import socket
from collections import deque
from collections.abc import Callable

from time import perf_counter_ns as _now_ns

import trio

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.connection import Connection
from duplexrt.wire.frames import MIN_ROOM, Close, FrameError, Ping
from duplexrt.wire.transport import DEFAULT_CLOSE_TIMEOUT, Message, TransportClosed, wait_for_silence

log = logging.getLogger("duplexrt.wire.native")

#: A read that filled all the room it had asks for this much next: a backlog (a session that fell
#: behind, a burst) is taken several messages a read, not one.
_BACKLOG_READ = 1 << 16
#: The most one read takes: a large message comes in several reads, with turns for the other
#: sessions between them, not one copy of megabytes on the trio thread.
_MAX_READ = 1 << 18
#: A read that finds data waiting does not yield; every this many in a row, one does.
_YIELD_EVERY = 8
#: One server connection's work per scheduling turn, so that a peer flooding tiny messages or control
#: frames cannot hold the one trio thread that every session shares: after this many messages
#: taken without a wait, or this long (ns) since this connection last gave trio a turn, the next
#: ``receive`` yields first and ``poll`` says no message.  A paced session never meets either
#: (it waits for its socket between messages); the time is a small part of a frame period, and
#: a yield costs a few µs (what a flood does to a paced victim: ``tests/test_under_attack_wire.py``).
_TURN_MESSAGES = 64
_TURN_NS = 2_000_000


class NativeWebSocket:
    """One open WebSocket over ``stream``.  ``client``: this end is the client (it masks what it
    sends, and the peer must not); ``received``: bytes the peer sent right after its handshake."""

    def __init__(self, stream: trio.SocketStream, *, client: bool = False, max_message: int = 1 << 20,
                 first_message_timeout: float = math.inf, close_timeout: float = DEFAULT_CLOSE_TIMEOUT,
                 received: bytes = b"", queue_limit: int = 4, subprotocol: str | None = None,
                 first_messages: int = 1) -> None:
        self._stream = stream
        self._client = client
        #: The connection's state, sans-IO: what this driver may still do, and why it ended.
        self._connection = connection = Connection(client=client, max_message=max_message, clock=trio.current_time)
        self._parser = connection.parser
        if received:
            self._parser.feed(received)
        self._unparsed = bool(received)
        self._queue_limit = queue_limit
        #: What ``watch_for_close`` reads ahead at most (bytes held unread): one message's worth.
        self._read_ahead_limit = max_message
        #: The subprotocol the handshake settled on, if any.
        self.subprotocol = subprotocol
        self._messages: deque[Message] = deque()
        self._reading = False
        self._read_lot = trio.lowlevel.ParkingLot()
        self._sock = stream.socket
        self._reads_without_wait = 0
        #: This connection's turn on the trio thread: messages taken and when it began (ns).
        self._turn_messages = 0
        self._turn_start = _now_ns()
        #: The last read took less than it asked for: the socket was empty after it.
        self._drained = False
        self._sending = False
        self._send_lot = trio.lowlevel.ParkingLot()
        #: Pongs that came while another write held the turn: whoever holds it writes them
        #: before passing it on (``_release_send``), between two messages, never behind them.
        self._pongs: bytes | None = None
        self._first_deadline = trio.current_time() + first_message_timeout
        #: How many messages the first-message deadline is for (the key's ``start`` on Twilio's route).
        self._first_messages = first_messages
        #: Messages taken so far (the idle watch reads it).
        self.received = 0
        self._close_timeout = close_timeout
        self._closing: trio.Event | None = None
        self._close_deadline = math.inf
        self._close_scope: trio.CancelScope | None = None

    # -- Transport -------------------------------------------------------------------------------

    async def receive(self) -> Message:
        messages = self._messages
        ended = self._connection.ended
        if ended is not None:
            raise ended
        if self._turn_spent():
            await trio.lowlevel.checkpoint()  # a backlog: other sessions' turn first (nothing is taken yet)
            self._new_turn()
        if not messages:
            if self.received >= self._first_messages:
                await self._fill()
            else:
                with trio.move_on_at(self._first_deadline):
                    await self._fill()
                if not messages:
                    reason = "no message arrived in time after the connection opened"
                    ended = self._connection.end(FinishReason.FIRST_MESSAGE_TIMEOUT, CloseCode.POLICY_VIOLATION, reason)
                    await self.close(CloseCode.POLICY_VIOLATION, reason)
                    raise ended
        self.received += 1
        self._turn_messages += 1
        return messages.popleft()

    def receive_nowait(self) -> Message:
        connection = self._connection
        if connection.ended is not None:
            raise connection.ended
        if not self._messages:
            if connection.gone is not None:
                raise connection.gone
            raise trio.WouldBlock
        if self._turn_spent():
            raise trio.WouldBlock  # this turn's share is taken: ``receive`` yields, then takes it
        self.received += 1
        self._turn_messages += 1
        return self._messages.popleft()

    def poll(self) -> Message | None:
        connection = self._connection
        if connection.ended is not None:
            raise connection.ended
        messages = self._messages
        if not messages:
            if connection.gone is not None:
                raise connection.gone
            return None
        if self._turn_spent():
            return None  # this turn's share is taken: ``receive`` yields, then takes it
        self.received += 1
        self._turn_messages += 1
        return messages.popleft()

    @property
    def held_bytes(self) -> int:
        """What this connection holds of the peer's, in bytes: messages read and not yet taken,
        the fragments of a message under way, and bytes read and not yet parsed (a text message
        counted by its characters).  A statistic (it sums the queue when asked): what a peer can
        make the server keep is bounded by the queue and message limits, in the closing
        handshake too."""
        return sum(len(message) for message in self._messages) + self._parser.held

    @property
    def discarded(self) -> int:
        """Messages the peer sent after this end's Close, dropped unread."""
        return self._connection.discarded

    def _turn_spent(self) -> bool:
        """This connection has had its share of the trio thread since it last yielded.  On a
        server only: the peer there may be hostile, and every session shares the thread."""
        return not self._client and (self._turn_messages >= _TURN_MESSAGES or _now_ns() - self._turn_start > _TURN_NS)

    def _new_turn(self) -> None:
        """Just back from a yield: the share starts again."""
        self._turn_messages = 0
        self._turn_start = _now_ns()

    async def send(self, message: Message) -> None:
        self._check_open()
        data, tail = self._connection.frame(message)
        if not await self._write(data, tail):
            raise self._connection.closed_error()

    #: ``send_nowait`` and ``flush`` are here: a session may send straight from a step's delivery.
    offers_send_nowait = True

    def send_nowait(self, message: Message) -> bool:
        """Send ``message`` without yielding: True once it is written whole.  False when the
        socket took only part of it: the rest is this transport's now, written by a task of its
        own as the socket drains (nothing waits for the next send to push it), and everything
        sent later goes out after it; ``flush`` waits for it.  Raises ``trio.WouldBlock`` when
        another write is under way (a rest among them): nothing of the message was taken."""
        self._check_open()
        if self._sending:
            raise trio.WouldBlock
        data, tail = self._connection.frame(message)
        rest = self._write_now(data, tail)
        if rest is None:
            raise self._connection.closed_error()
        if not rest:
            return True
        self._sending = True  # held by the drain until the rest is out
        trio.lowlevel.spawn_system_task(self._drain, rest, name="duplexrt.wire.native.drain")
        return False

    async def flush(self) -> None:
        """Return once every message taken is written to the socket (the rest a ``send_nowait``
        left included); raises TransportClosed where ``send`` would."""
        if self._sending:
            while self._sending:
                await self._send_lot.park()
            if self._send_lot:
                self._send_lot.unpark()  # the turn this waiter was woken with: pass it on
        self._check_open()

    def _check_open(self) -> None:
        error = self._connection.send_error()
        if error is not None:
            raise error

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Send Close (unless one was sent) and wait for the peer's, at most ``close_timeout``
        seconds; then drop the connection.  A second caller waits for the first one's close."""
        if self._closing is not None:
            with trio.move_on_at(self._close_deadline):
                await self._closing.wait()
            return
        self._closing = trio.Event()
        self._close_deadline = trio.current_time() + self._close_timeout
        try:
            with trio.move_on_at(self._close_deadline) as self._close_scope:
                await self._send_close(code, reason)
                # After a broken frame no Close of the peer's can be found: hang up at once.
                # What the peer sends meanwhile is parsed only to find its Close: its messages
                # are dropped as they come (``Connection.receive_into``), so a peer streaming
                # into the handshake costs a parse, not memory, and no more than its share of
                # the trio thread (the turn, as for ``receive``).
                while self._connection.reading:
                    if not self._client and _now_ns() - self._turn_start > _TURN_NS:
                        await trio.lowlevel.checkpoint()
                        self._new_turn()
                    await self._read_more(limit=False)
        finally:
            self._drop_stream()
            self._closing.set()

    def abort(self) -> None:
        """Drop the connection now, cutting short a close under way (a second shutdown signal)."""
        if self._close_scope is not None:
            self._close_scope.cancel()
        self._drop_stream()

    async def watch_for_close(self, taking: Callable[[], bool]) -> TransportClosed | None:
        """Read ahead while the session takes no message (``taking()`` is False: its reader waits
        for the model), to find the peer's Close behind the messages it sent before it.  A caller
        who hangs up while seconds of its audio wait for a model slower than real time is heard
        at once, not once that audio has been stepped: the session ends then, and its slot is free.

        Returns how the peer ended the connection (its Close, or a drop) once it has.  Returns None
        once ``taking()`` is True again, once this end has ended the connection (a limit: the
        session hears it from ``receive``), or once a message's worth of bytes (``max_message``)
        waits unread: the read-ahead holds no more than one message of the peer's could, and a
        Close further back is found as the session catches up, as before.  The messages read go
        to ``receive`` as usual; none is taken here."""
        connection = self._connection
        while True:
            if connection.ended is not None:  # first: this end's own reason (an abort also drops the stream)
                return None
            if connection.gone is not None:
                return connection.gone
            if taking() or not connection.reading or self.held_bytes >= self._read_ahead_limit:
                return None
            await self._read_more(limit=False)

    # -- keeping the peer honest -------------------------------------------------------------------

    async def watch(self, ping_interval: float, ping_timeout: float, idle_timeout: float) -> None:
        """Run beside the session until cancelled: a WebSocket ping every ``ping_interval``
        seconds, and the connection dropped when no pong comes within ``ping_timeout``; and the
        session's input ended when no message comes for ``idle_timeout``.  A 0 turns that part
        off (``ping_timeout`` 0: pings keep middleboxes awake but a missing pong ends nothing)."""
        async with trio.open_nursery() as nursery:
            if ping_interval > 0:
                nursery.start_soon(self._keep_alive, ping_interval, ping_timeout)
            if idle_timeout > 0:
                nursery.start_soon(self._watch_idle, idle_timeout)

    async def _keep_alive(self, interval: float, timeout: float) -> None:
        while True:
            await trio.sleep(interval)
            connection = self._connection
            pongs = connection.pongs
            with trio.move_on_after(timeout if timeout > 0 else interval) as waited:
                if not await self._write(connection.ping()):
                    return
                while connection.pongs == pongs:
                    if (connection.gone is not None or connection.ended is not None or connection.close_sent
                            or connection.eof):
                        return
                    await self._read_more(limit=True)
            if waited.cancelled_caught and timeout > 0:
                connection.end(FinishReason.PING_TIMEOUT, CloseCode.GOING_AWAY, f"no pong within {timeout:g} s")
                self.abort()
                return

    async def _watch_idle(self, limit: float) -> None:
        seen = self.received
        last_message = trio.current_time()

        def heard() -> bool:
            nonlocal seen, last_message
            # Messages read but not yet taken (a session waiting on the model) count as heard.
            if self.received != seen or self._messages:
                seen = self.received
                last_message = trio.current_time()
                return True
            # A frame under way (a large message still arriving) counts for one idle period after
            # the last message, no longer: a peer that sends one byte of a header, or trickles a
            # frame it never finishes, is idle however long it keeps that up.
            return bool(self._parser.buffered) and trio.current_time() - last_message < limit

        await wait_for_silence(limit, heard)
        self._connection.end(FinishReason.IDLE_TIMEOUT, CloseCode.POLICY_VIOLATION,
                             f"no message from the client for {limit:g} s")
        # The session's input ends with that reason; the connection stays open so the session
        # can still send its end and close with its usage.  Shutting the read side wakes a
        # waiting read with the end of the stream (no cancel scope around every read for this
        # rare case); sends still go out.
        self._connection.shut_reading()
        try:
            self._sock.shutdown(socket.SHUT_RD)
        except OSError:
            pass
        self._read_lot.unpark_all()

    # -- reading ---------------------------------------------------------------------------------

    async def _fill(self) -> None:
        messages = self._messages
        connection = self._connection
        while not messages:
            error = connection.receive_error()
            if error is not None:
                raise error
            if self._unparsed:  # frames that came with the handshake
                self._unparsed = False
                await self._parse()
                continue
            await self._read_more(limit=False)

    async def _read_more(self, *, limit: bool) -> None:
        """Read once and parse what came, or, while another task reads (or, with ``limit``, while
        ``queue_limit`` messages wait unread), wait until that changes."""
        if self._reading or (limit and len(self._messages) >= self._queue_limit):
            await self._read_lot.park()  # the other reader wakes this
            return
        if self._connection.backlog:  # frames read already, not yet parsed: no read for them
            await self._parse()
            return
        self._reading = True
        try:
            count = await self._receive_some()
        finally:
            self._reading = False
            if self._read_lot:
                self._read_lot.unpark_all()
        if not count:
            self._stream_ended()
            return
        if self._connection.failed:
            return  # after a broken frame, only the end of the connection matters
        event = self._connection.receive_into(self._messages)
        if event is not None:  # rare: a ping, a close, a broken frame
            await self._handle(event)

    async def _receive_some(self) -> int:
        """Read what the socket holds into the parser's buffer; how many bytes (0 at its end).
        trio's ``receive_some`` costs a syscall that fails, a wait, the syscall again and a yield
        after it; here the read is tried first and only a read that finds nothing waits, so a
        session that has fallen behind catches up without a wake-up per read (with a yield every
        ``_YIELD_EVERY`` reads, to stay fair)."""
        sock = self._sock
        parser = self._parser
        if self._drained:
            # The last read emptied the socket: at a paced 12.5 messages a second the next one
            # is not there yet, and trying first would only cost a failed syscall.
            if sock.fileno() < 0:
                return 0  # closed already: no wait to wake it
            try:
                await trio.lowlevel.wait_readable(sock)
            except (trio.ClosedResourceError, trio.BusyResourceError):
                return 0
            self._new_turn()
        while True:
            fd = sock.fileno()
            if fd < 0:
                return 0
            room = parser.room(MIN_ROOM if self._drained else _BACKLOG_READ)[:_MAX_READ]
            try:
                count = os.readv(fd, (room,))
            except BlockingIOError:
                try:
                    await trio.lowlevel.wait_readable(sock)
                except (trio.ClosedResourceError, trio.BusyResourceError):
                    return 0
                self._reads_without_wait = 0
                self._new_turn()
                continue
            except OSError:  # reset by the peer
                return 0
            self._drained = count < len(room)
            # Taken at once, before any yield; after a broken frame the bytes are only overwritten.
            if not self._connection.failed:
                parser.received(count)
            self._reads_without_wait += 1
            if self._reads_without_wait >= _YIELD_EVERY or _now_ns() - self._turn_start > _TURN_NS:
                self._reads_without_wait = 0
                await trio.lowlevel.cancel_shielded_checkpoint()  # never loses what was read
                self._new_turn()
            return count

    async def _parse(self) -> None:
        event = self._connection.receive_into(self._messages)
        if event is not None:
            await self._handle(event)

    async def _handle(self, event: Ping | Close | FrameError | None) -> None:
        """Answer ``event`` (from ``Connection.receive_into``, which recorded what it means), then
        go on parsing."""
        connection = self._connection
        while event is not None:
            if type(event) is Ping:
                pongs = connection.answer_pings()
                if pongs is not None:
                    self._send_pongs(pongs)
            elif type(event) is FrameError:  # close with its code; nothing more is read into messages
                with trio.move_on_after(self._close_timeout):
                    await self._send_close(event.code, event.reason)
                return
            else:  # the peer's Close: answer with the same code, then (a server) hang up
                assert isinstance(event, Close)
                with trio.move_on_after(self._close_timeout):
                    await self._send_close(event.code if event.code != 1005 else CloseCode.NORMAL_CLOSURE, "")
                if not self._client:
                    self._drop_stream()
                return
            event = connection.receive_into(self._messages)

    def _stream_ended(self) -> None:
        """A read found the end of the stream."""
        self._connection.stream_ended()
        self._read_lot.unpark_all()

    def _lost(self) -> None:
        self._connection.lost()
        self._read_lot.unpark_all()

    # -- writing ---------------------------------------------------------------------------------

    async def _write(self, data: bytes | bytearray, tail: bytes = b"") -> bool:
        """Send ``data`` and then ``tail`` whole, one writer at a time; False once the connection
        is gone.  The write is tried at once: it waits (and yields) only when the socket's buffer
        is full."""
        while self._sending:
            await self._send_lot.park()
        self._sending = True
        try:
            rest = self._write_now(data, tail)
            if rest:  # rare: the socket's buffer is full
                return await self._write_rest(rest)
            return rest is not None
        finally:
            self._release_send()

    def _write_now(self, data: bytes | bytearray, tail: bytes) -> bytes | memoryview | None:
        """Write what the socket takes now, without waiting: what is left of ``data + tail``
        (empty once all of it went), or None once the connection is gone."""
        fd = self._sock.fileno()
        try:
            if tail:
                sent = os.writev(fd, (data, tail)) if fd >= 0 else -1
            else:
                sent = os.write(fd, data) if fd >= 0 else -1
        except BlockingIOError:
            sent = 0
        except OSError:  # reset, or a broken pipe
            sent = -1
        if sent < 0:
            self._lost()
            return None
        if sent == len(data) + len(tail):
            return b""
        return memoryview(data + tail if tail else data)[sent:]

    async def _write_rest(self, view: bytes | memoryview) -> bool:
        """Write ``view`` whole, waiting for the socket as often as it takes; False once the
        connection is gone.  The caller holds the write turn."""
        sock = self._sock
        try:
            while True:
                fd = sock.fileno()
                if fd < 0:
                    self._lost()
                    return False
                try:
                    sent = os.write(fd, view)
                except BlockingIOError:
                    await trio.lowlevel.wait_writable(sock)
                    continue
                except OSError:  # reset, or a broken pipe
                    self._lost()
                    return False
                if sent == len(view):
                    return True
                view = memoryview(view)[sent:]
        except (trio.ClosedResourceError, trio.BusyResourceError):
            self._lost()
            return False

    async def _drain(self, rest: bytes | memoryview) -> None:
        """The rest of a ``send_nowait`` (a system task: it must not raise, and ends when the
        connection does, since a dropped socket wakes its wait)."""
        try:
            await self._write_rest(rest)
        except Exception:  # noqa: BLE001 - a raise in a system task would take all of trio down
            self._lost()
        finally:
            self._release_send()

    def _send_pongs(self, pongs: bytes) -> None:
        """Answer pings without waiting for the write turn: whoever reads must never wait on a
        write.  A reader that parked here behind a large or stalled send stopped reading, and
        when the peer in turn waits for this end to read before it reads again (a server
        whose model steps in real time stops reading a client that bursts), neither end ever
        moved again.  Written now when no write is under way, what the socket does not take
        left to a drain task; else kept for the writer that holds the turn, which writes them
        right after its message.  A later burst replaces one not yet written: the latest pings
        are the ones to answer (RFC 6455 5.5.3)."""
        if self._sending:
            self._pongs = pongs
            return
        rest = self._write_now(pongs, b"")
        if rest:
            self._sending = True  # held by the drain until the rest is out
            trio.lowlevel.spawn_system_task(self._drain, rest, name="duplexrt.wire.native.drain")

    def _release_send(self) -> None:
        pongs = self._pongs
        if pongs is not None:
            # Pongs that waited for this write: out now, before the next writer's message (none
            # once this end's Close went: nothing may follow it).
            self._pongs = None
            if not self._connection.close_sent:
                rest = self._write_now(pongs, b"")
                if rest:  # the turn stays held, by a drain for the rest
                    trio.lowlevel.spawn_system_task(self._drain, rest, name="duplexrt.wire.native.drain")
                    return
        self._sending = False
        if self._send_lot:
            self._send_lot.unpark()

    async def _send_close(self, code: int, reason: str) -> None:
        data = self._connection.close(code, reason)
        if data is not None:
            await self._write(data)

    # -- internals ---------------------------------------------------------------------------------

    def _drop_stream(self) -> None:
        # A synchronous close: whatever waits on the socket wakes with ClosedResourceError.
        self._stream.socket.close()
