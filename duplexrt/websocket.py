"""A trio-websocket connection as a ``Transport``: the server's sessions and the clients
(``duplexrt client``, ``simulate --url``) speak through the same adapter.

On a server it also bounds how long a connection may hold its slot without doing its part: a
first message that never comes, a peer that stops answering pings or sends nothing for too long,
and a closing handshake the peer never finishes all end the connection, each with a finish reason
of its own (``TransportClosed.finish_reason``) so that the log tells a limit from a hang-up.
"""

from __future__ import annotations

import math

import trio
import trio_websocket

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.transport import Message, TransportClosed, wait_for_silence

#: How long a close may wait for the peer's Close frame unless told otherwise.
DEFAULT_CLOSE_TIMEOUT = 3.0


class WebSocketTransport:
    """Adapts ``WebSocketConnection`` to the transport interface.

    On a server, also enforces that the client sends its first message within
    ``first_message_timeout`` seconds, and ``watch`` (run beside the session) keeps the peer
    alive-or-gone and non-idle.  Every close gives up after ``close_timeout`` seconds and then
    drops ``stream`` (the socket under the WebSocket), so a peer that never answers Close cannot
    keep its slot."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, first_message_timeout: float = math.inf, *,
                 close_timeout: float = DEFAULT_CLOSE_TIMEOUT, stream: trio.SocketStream | None = None) -> None:
        self.ws = ws
        self._first_deadline = trio.current_time() + first_message_timeout
        #: Messages taken so far: the one piece of per-message bookkeeping (the idle watch reads it).
        self.received = 0
        self._close_timeout = close_timeout
        self._stream = stream
        #: Set when this end ended the connection itself: what every later receive/send raises.
        self._ended: TransportClosed | None = None
        self._closing: trio.Event | None = None
        self._close_deadline = math.inf
        self._close_scope: trio.CancelScope | None = None
        self._receive_scope: trio.CancelScope | None = None

    async def receive(self) -> Message:
        if self._ended is not None:
            raise self._ended
        # The scope lets the idle watch end a waiting receive without closing the connection.
        with trio.CancelScope(deadline=math.inf if self.received else self._first_deadline) as scope:
            self._receive_scope = scope
            try:
                message = await self.ws.get_message()
            except trio_websocket.ConnectionClosed as exc:
                raise self._closed(exc) from None
            finally:
                self._receive_scope = None
            self.received += 1
            return message
        if self._ended is not None:
            raise self._ended
        reason = "no message arrived in time after the connection opened"
        ended = self._end(FinishReason.FIRST_MESSAGE_TIMEOUT, CloseCode.POLICY_VIOLATION, reason)
        await self.close(CloseCode.POLICY_VIOLATION, reason)
        raise ended

    def receive_nowait(self) -> Message:
        # trio-websocket has no public way to take an already-parsed message without a wait;
        # this fallback pays one wake-up per message (wsnative takes a backlog in one).
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

    # -- keeping the peer honest -------------------------------------------------------------------

    async def watch(self, ping_interval: float, ping_timeout: float, idle_timeout: float) -> None:
        """Run beside the session until cancelled: a WebSocket ping every ``ping_interval``
        seconds, and the connection dropped when no pong comes within ``ping_timeout``; and the
        session ended when no message comes for ``idle_timeout``.  A 0 turns that part off
        (``ping_timeout`` 0: pings keep middleboxes awake but a missing pong ends nothing)."""
        async with trio.open_nursery() as nursery:
            if ping_interval > 0:
                nursery.start_soon(self._keep_alive, ping_interval, ping_timeout)
            if idle_timeout > 0:
                nursery.start_soon(self._watch_idle, idle_timeout)

    async def _keep_alive(self, interval: float, timeout: float) -> None:
        while True:
            await trio.sleep(interval)
            with trio.move_on_after(timeout if timeout > 0 else interval) as waited:
                try:
                    await self.ws.ping()
                except trio_websocket.ConnectionClosed:
                    return
            if waited.cancelled_caught and timeout > 0:
                # A peer that cannot even take a ping (or answer it) is gone or stuck: a Close
                # would wait on it too, so the socket goes at once.
                self._end(FinishReason.PING_TIMEOUT, CloseCode.GOING_AWAY, f"no pong within {timeout:g} s")
                self.abort()
                return

    async def _watch_idle(self, limit: float) -> None:
        seen = self.received

        def heard() -> bool:
            nonlocal seen
            # Messages queued but not yet taken (a session waiting on the model) count as heard.
            fresh = self.received != seen or self._backlog()
            seen = self.received
            return fresh

        await wait_for_silence(limit, heard)
        self._interrupt(FinishReason.IDLE_TIMEOUT, CloseCode.POLICY_VIOLATION,
                        f"no message from the client for {limit:g} s")

    # -- internals ---------------------------------------------------------------------------------

    def _end(self, finish_reason: FinishReason, code: int, reason: str) -> TransportClosed:
        if self._ended is None:
            self._ended = TransportClosed(code, reason, finish_reason)
        return self._ended

    def _interrupt(self, finish_reason: FinishReason, code: int, reason: str) -> None:
        """End the session's input with ``finish_reason`` but leave the connection open, so the
        session can still send its end and close with its usage: a waiting receive is cancelled
        and raises the recorded end, and so does every later one."""
        self._end(finish_reason, code, reason)
        if self._receive_scope is not None:
            self._receive_scope.cancel()

    def _backlog(self) -> bool:
        # Without a public view of trio-websocket's queue, a session that is not waiting for a
        # message (busy, or waiting for room) is taken to be behind, not its client idle.
        return self._receive_scope is None

    def _drop_stream(self) -> None:
        if self._stream is not None:
            # A synchronous close: it wakes whatever waits on the socket (trio's reader task, a
            # send stuck on a full buffer) with ClosedResourceError, even inside a shield.
            self._stream.socket.close()

    def _closed(self, exc: trio_websocket.ConnectionClosed) -> TransportClosed:
        if self._ended is not None:
            return self._ended
        reason = exc.reason
        if reason is None:
            return TransportClosed(CloseCode.GOING_AWAY, "the connection went away")
        # trio-websocket ends a connection itself on a message over the size limit (it sends
        # Close 1009) and on a frame it cannot parse (1002, or 1007 for bad UTF-8).  Its public
        # surface does not say which end closed, so those codes are taken as this end's: a
        # client has no reason to close with them (wsnative knows, and says so exactly).
        if reason.code in (CloseCode.MESSAGE_TOO_BIG, CloseCode.PROTOCOL_ERROR, CloseCode.INVALID_PAYLOAD):
            finish = (FinishReason.MESSAGE_TOO_BIG if reason.code == CloseCode.MESSAGE_TOO_BIG
                      else FinishReason.PROTOCOL_ERROR)
            return TransportClosed(reason.code, reason.reason or "", finish)
        return TransportClosed(reason.code, reason.reason or "")
