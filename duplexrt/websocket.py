"""A trio-websocket connection as a ``Transport``: the server's sessions and the clients
(``duplexrt client``, ``simulate --url``) speak through the same adapter."""

from __future__ import annotations

import math

import trio
import trio_websocket

from duplexrt.transport import GOING_AWAY, Message, POLICY_VIOLATION, TransportClosed


class WebSocketTransport:
    """Adapts ``WebSocketConnection`` to the transport interface.  On a server, also enforces
    that the client sends its first message within ``first_message_timeout`` seconds."""

    def __init__(self, ws: trio_websocket.WebSocketConnection, first_message_timeout: float = math.inf) -> None:
        self.ws = ws
        self._first_deadline = trio.current_time() + first_message_timeout
        self._heard = False

    async def receive(self) -> Message:
        try:
            if self._heard:
                return await self.ws.get_message()
            with trio.move_on_at(self._first_deadline):
                message = await self.ws.get_message()
                self._heard = True
                return message
        except trio_websocket.ConnectionClosed as exc:
            raise _closed(exc) from None
        reason = "no message arrived in time after the connection opened"
        await self.close(POLICY_VIOLATION, reason)
        raise TransportClosed(POLICY_VIOLATION, reason)

    def receive_nowait(self) -> Message:
        # trio-websocket queues parsed messages in a memory channel; taking one that is already
        # there needs no wait.  (A private attribute: if it ever goes away, say so here.)
        channel = getattr(self.ws, "_recv_channel", None)
        if channel is None:
            raise trio.WouldBlock
        try:
            message = channel.receive_nowait()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise _closed(trio_websocket.ConnectionClosed(self.ws.closed)) from None
        self._heard = True
        return message

    async def send(self, message: Message) -> None:
        if not isinstance(message, str | bytes):
            message = bytes(message)
        try:
            await self.ws.send_message(message)
        except trio_websocket.ConnectionClosed as exc:
            raise _closed(exc) from None

    async def close(self, code: int = 1000, reason: str = "") -> None:
        await self.ws.aclose(code, reason or None)


def _closed(exc: trio_websocket.ConnectionClosed) -> TransportClosed:
    reason = exc.reason
    if reason is None:
        return TransportClosed(GOING_AWAY, "the connection went away")
    return TransportClosed(reason.code, reason.reason or "")
