"""A trio-websocket connection as a ``Transport``: the clients' ``wss://`` (``duplexrt client``,
``simulate --url``), where TLS is trio's and the native stack (``native``) does not go.

The server speaks through ``native`` only; its limits (first message, pings, idle) are there.
Here a close still gives up after ``close_timeout`` seconds, so a server that never answers
Close cannot hold the client.
"""

from __future__ import annotations

import math

import trio
import trio_websocket

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import DEFAULT_CLOSE_TIMEOUT, Message, TransportClosed


class WebSocketTransport:
    """Adapts ``WebSocketConnection`` to the transport interface.  Every close gives up after
    ``close_timeout`` seconds and then drops ``stream`` (the socket under the WebSocket)."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, *,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT, stream: trio.SocketStream | None = None) -> None:
        self.ws = ws
        #: Messages taken so far.
        self.received = 0
        self._close_timeout = close_timeout
        self._stream = stream
        self._closing: trio.Event | None = None
        self._close_deadline = math.inf
        self._close_scope: trio.CancelScope | None = None

    async def receive(self) -> Message:
        try:
            message = await self.ws.get_message()
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from None
        self.received += 1
        return message

    def receive_nowait(self) -> Message:
        # trio-websocket has no public way to take an already-parsed message without a wait;
        # this fallback pays one wake-up per message (``native`` takes a backlog in one).
        raise trio.WouldBlock

    def poll(self) -> Message | None:
        return None  # as receive_nowait: nothing is ever taken without a wait here

    async def send(self, message: Message) -> None:
        if not isinstance(message, str | bytes):
            message = bytes(message)
        try:
            await self.ws.send_message(message)
        except trio_websocket.ConnectionClosed as exc:
            raise self._closed(exc) from None

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Send Close and wait for the peer's, at most ``close_timeout`` seconds; then (or on
        cancellation) drop the connection.  A second caller waits for the first one's close,
        within the same deadline."""
        if self._closing is not None:
            with trio.move_on_at(self._close_deadline):
                await self._closing.wait()
            return
        self._closing = trio.Event()
        self._close_deadline = trio.current_time() + self._close_timeout
        done = False
        try:
            with trio.move_on_at(self._close_deadline) as self._close_scope:
                await self.ws.aclose(code, reason or None)
                done = True
        finally:
            if not done:  # timed out, aborted or cancelled: the peer gets no more time
                self._drop_stream()
            self._closing.set()

    def abort(self) -> None:
        """Drop the connection now, cutting short a close under way (a second shutdown signal)."""
        if self._close_scope is not None:
            self._close_scope.cancel()
        self._drop_stream()

    # -- internals ---------------------------------------------------------------------------------

    def _drop_stream(self) -> None:
        if self._stream is not None:
            # A synchronous close: it wakes whatever waits on the socket (trio's reader task, a
            # send stuck on a full buffer) with ClosedResourceError, even inside a shield.
            self._stream.socket.close()

    def _closed(self, exc: trio_websocket.ConnectionClosed) -> TransportClosed:
        reason = exc.reason
        if reason is None:
            return TransportClosed(CloseCode.GOING_AWAY, "the connection went away")
        # trio-websocket ends a connection itself on a message over the size limit (it sends
        # Close 1009) and on a frame it cannot parse (1002, or 1007 for bad UTF-8).  Its public
        # surface does not say which end closed, so those codes are taken as this end's.
        if reason.code in (CloseCode.MESSAGE_TOO_BIG, CloseCode.PROTOCOL_ERROR, CloseCode.INVALID_PAYLOAD):
            finish = (FinishReason.MESSAGE_TOO_BIG if reason.code == CloseCode.MESSAGE_TOO_BIG
                      else FinishReason.PROTOCOL_ERROR)
            return TransportClosed(reason.code, reason.reason or "", finish)
        return TransportClosed(reason.code, reason.reason or "")
