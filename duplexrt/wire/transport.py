"""The message transport a session talks through, and an in-memory pair of it.

A session only needs to receive and send whole messages (bytes for audio, text for control) and
to close with a code and a reason, which is what a WebSocket offers.  The in-memory pair gives
``duplexrt simulate`` and the tests the same interface with no sockets, so they drive the very
same session code a network connection will.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs
import trio

from duplexrt.reasons import CloseCode, FinishReason

Message = bytes | str

#: How long a WebSocket close may wait for the peer's Close frame unless told otherwise.
DEFAULT_CLOSE_TIMEOUT = 3.0


class TransportClosed(Exception):
    """The connection is closed: nothing more can be received (or sent).

    ``finish_reason`` is None when the other end closed or went away, and names why when this
    end closed it (a limit reached, a peer that stopped answering pings)."""

    def __init__(self, code: int, reason: str = "", finish_reason: FinishReason | None = None) -> None:
        super().__init__(f"connection closed with code {code}" + (f": {reason}" if reason else ""))
        self.code = code
        self.reason = reason
        self.finish_reason = finish_reason


class Transport(Protocol):
    """What a session talks through (``DirectSend`` is what a transport may offer besides)."""

    async def receive(self) -> Message:
        """The next whole message; raises TransportClosed once the peer has closed."""
        ...

    def receive_nowait(self) -> Message:
        """A message that has already arrived, without yielding; raises ``trio.WouldBlock`` when
        none has.  Lets a reader take a backlog in one wake-up instead of one per message."""
        ...

    def poll(self) -> Message | None:
        """``receive_nowait`` answering None instead of raising ``trio.WouldBlock``: a paced
        reader finds nothing waiting after nearly every message, and a raise through the
        transports and the session each time costs more than the rest of the look.  Optional:
        ``poller`` makes one from ``receive_nowait`` for a transport without it."""
        ...

    async def send(self, message: Message) -> None:
        """Send one whole message; raises TransportClosed if the peer has gone."""
        ...

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Close both directions, telling the peer why.  Idempotent."""
        ...


@runtime_checkable
class DirectSend(Protocol):
    """A transport that can send without yielding, so that a session sends a step's output
    from the step's delivery instead of waking its writer task for it.  A session checks for it
    once, when it is built (``direct_send``).  ``NativeWebSocket``, ``ResumableTransport`` over
    it and ``MemoryTransport`` offer it."""

    #: False where the class has the methods but the connection under it cannot use them (a
    #: ``ResumableTransport`` over a transport without a direct send).
    offers_send_nowait: bool

    def send_nowait(self, message: Message) -> bool:
        """True once ``message`` is written whole; False when the transport holds the rest of
        it, writes it as soon as it can, and sends everything later after it.  Raises
        ``trio.WouldBlock``, taking nothing, when it cannot take the message now, and
        TransportClosed where ``send`` would."""
        ...

    async def flush(self) -> None:
        """Return once everything taken is out; raises TransportClosed where ``send`` would."""
        ...


def direct_send(transport: object) -> DirectSend | None:
    """``transport`` as a ``DirectSend`` where it offers one, else None."""
    if isinstance(transport, DirectSend) and transport.offers_send_nowait:
        return transport
    return None


@attrs.define
class _CloseRecord:
    code: int | None = None
    reason: str = ""


class MemoryTransport:
    """One end of an in-memory, message-oriented, bounded connection."""

    def __init__(self, outgoing: trio.MemorySendChannel[Message], incoming: trio.MemoryReceiveChannel[Message],
                 mine: _CloseRecord, theirs: _CloseRecord) -> None:
        self._outgoing = outgoing
        self._incoming = incoming
        self._mine = mine
        self._theirs = theirs

    async def receive(self) -> Message:
        try:
            return await self._incoming.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed() from None

    def receive_nowait(self) -> Message:
        try:
            return self._incoming.receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed() from None

    def poll(self) -> Message | None:
        try:
            return self._incoming.receive_nowait()
        except trio.WouldBlock:
            return None
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise self._closed() from None

    def send_nowait(self, message: Message) -> bool:
        """Send if there is room, without yielding; raises ``trio.WouldBlock`` when full.  True:
        a message that goes is always whole here."""
        if self._theirs.code is not None or self._mine.code is not None:
            raise self._closed()
        try:
            self._outgoing.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._closed() from None
        return True

    #: A message that goes is whole (``flush`` has nothing to wait for).
    offers_send_nowait = True

    async def flush(self) -> None:
        if self._theirs.code is not None or self._mine.code is not None:
            raise self._closed()

    async def send(self, message: Message) -> None:
        if self._theirs.code is not None or self._mine.code is not None:
            raise self._closed()
        try:
            await self._outgoing.send(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self._closed() from None

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        if self._mine.code is None and self._theirs.code is None:
            self._mine.code = code
            self._mine.reason = reason
        self._outgoing.close()
        self._incoming.close()
        await trio.lowlevel.checkpoint()

    @property
    def close_code(self) -> int | None:
        """The code this connection closed with, from whichever side closed first."""
        record = self._mine if self._mine.code is not None else self._theirs
        return record.code

    @property
    def close_reason(self) -> str:
        record = self._mine if self._mine.code is not None else self._theirs
        return record.reason

    def _closed(self) -> TransportClosed:
        record = self._theirs if self._theirs.code is not None else self._mine
        if record.code is None:
            return TransportClosed(CloseCode.GOING_AWAY, "the connection went away")
        return TransportClosed(record.code, record.reason)


def memory_transport_pair(capacity: int = 2) -> tuple[MemoryTransport, MemoryTransport]:
    """Two connected ends, ``(client, server)``; each direction holds ``capacity`` messages."""
    to_server_send, to_server_receive = trio.open_memory_channel[Message](capacity)
    to_client_send, to_client_receive = trio.open_memory_channel[Message](capacity)
    client_close, server_close = _CloseRecord(), _CloseRecord()
    client = MemoryTransport(to_server_send, to_client_receive, client_close, server_close)
    server = MemoryTransport(to_client_send, to_server_receive, server_close, client_close)
    return client, server


def poller(transport: Transport) -> Callable[[], Message | None]:
    """``transport.poll``, or, for a transport that has none (a test's stand-in, a wrapper),
    the same answer made from its ``receive_nowait``."""
    poll = getattr(transport, "poll", None)
    if poll is not None:
        return poll
    def poll_by_raising() -> Message | None:
        try:
            return transport.receive_nowait()  # looked up when asked: a stand-in may lack it
        except trio.WouldBlock:
            return None

    return poll_by_raising


#: The idle watch looks this many times per idle limit: a silent peer is noticed within 1/8 of the
#: limit past it, and a busy one costs a wake-up every limit/8, not a clock read per message.
IDLE_CHECKS = 8


async def wait_for_silence(limit: float, heard: Callable[[], bool]) -> None:
    """Return once ``heard()`` has answered False at every look for ``limit`` seconds.

    The server's idle clock (``NativeWebSocket.watch``); the caller says what counts as hearing
    from its peer (a message taken since the last look, or one read and not yet taken)."""
    last_heard = trio.current_time()
    while True:
        await trio.sleep(limit / IDLE_CHECKS)
        now = trio.current_time()
        if heard():
            last_heard = now
        elif now - last_heard >= limit:
            return
