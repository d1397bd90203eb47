"""One client conversation over any transport: send audio (burst or paced), hear what comes back.

Shared by ``duplexrt client``, ``duplexrt simulate --url`` (a WebSocket and the route's client
protocol) and the in-process ``duplexrt simulate`` (an in-memory transport and the raw protocol),
so that all three send, pace, receive and decide when a conversation is over the same way.

The sender sends message ``i`` at ``start + (i + 1) × interval`` when paced (the moment that much
audio has been spoken), or as fast as the transport takes it; then the protocol's end of input.
The receiver hands every piece of audio to ``on_audio`` with the time it arrived, collects the
server's events, and ends the conversation as the protocol says: when the server closes after its
end event, when the client has heard its end event (and closes), or, for protocols with no end of
input, once ``caught_up()`` says all the output has been heard.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from duplexrt.client.abilities import NowaitSender, nowait_sender
from duplexrt.client.pacer import Pacer
from duplexrt.client.protocols import AUDIO_TYPES, Buffer, ClientProtocol, Ended, Opened, ServerError, Text
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message, Transport, TransportClosed

__all__ = ["Conversation", "ENDED", "CLOSED", "COMPLETE", "IDLE"]

#: How a conversation finished, from the client's side.
ENDED = "ended"  # the server said how it ended (``Conversation.end``)
CLOSED = "closed"  # the connection closed without the server saying so (``Conversation.closed``)
COMPLETE = "complete"  # the client heard everything and hung up (protocols with no end of input)
IDLE = "idle"  # the input was all sent and the server went quiet for ``idle_timeout`` seconds


class Conversation:
    """One session, from the client's side.  ``run`` returns once it is over; then ``outcome``,
    ``end``, ``errors`` and ``closed`` say how it went."""

    def __init__(self, transport: Transport, protocol: ClientProtocol, *,
                 on_audio: Callable[[Buffer, float], Any],
                 caught_up: Callable[[], bool] | None = None,
                 on_text: Callable[[str], Any] | None = None,
                 idle_timeout: float | None = None) -> None:
        self.transport = transport
        self.protocol = protocol
        self.on_audio = on_audio
        self.caught_up = caught_up
        self.on_text = on_text
        self.idle_timeout = idle_timeout
        self.outcome: str | None = None
        self.end: Ended | None = None
        self.errors: list[ServerError] = []
        self.closed: TransportClosed | None = None
        #: perf_counter() of each audio message as it was sent, of the first, of the last output.
        self.send_times: list[float] = []
        self.first_send: float | None = None
        self.last_output: float | None = None
        self.messages_sent = 0
        self.input_done = False
        self._finishing = False
        self._idle_scope: trio.CancelScope | None = None

    async def run(self, count: int, message_at: Callable[[int], Buffer], *,
                  interval: float | None = None, offset: float = 0.0, pacer: Pacer | None = None) -> None:
        """Send ``count`` audio payloads (``message_at(i)``, already in the protocol's input format)
        and receive until the conversation is over.  ``interval``: paced, one message every that
        many seconds from ``offset`` seconds after now; None: as fast as the transport takes them.
        ``pacer``: paced conversations wait on it (one timer shared by many) instead of a timer
        of their own."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._send, count, message_at, interval, offset, pacer)
            await self._receive()
            nursery.cancel_scope.cancel()

    # -- sending --------------------------------------------------------------------------------

    async def _send(self, count: int, message_at: Callable[[int], Buffer], interval: float | None,
                    offset: float, pacer: Pacer | None) -> None:
        transport = self.transport
        sleep_until = pacer.wait_until if pacer is not None else trio.sleep_until
        wrap = self.protocol.audio
        send_nowait = nowait_sender(transport)
        send_times = self.send_times
        start = trio.current_time() + offset
        period = 0.0 if interval is None else interval  # due() is only asked for when paced

        def due(i: int) -> float:
            return start + (i + 1) * period

        # Paced on a pacer over a transport that can send without yielding: the pacer's task
        # sends, and this one wakes only for a message that must wait (or at the end).
        direct = None
        if interval is not None and pacer is not None and send_nowait is not None:
            direct = pacer, self._sender(send_nowait, wrap, message_at)
        try:
            i = 0
            while i < count:
                if direct is not None:
                    direct_pacer, send_now = direct
                    i = await direct_pacer.send_due(i, count, due, send_now)
                    if i >= count:
                        break
                elif interval is not None:
                    await sleep_until(due(i))
                now = time.perf_counter()
                if self.first_send is None:
                    self.first_send = now
                send_times.append(now)
                message = wrap(message_at(i))
                if send_nowait is not None:
                    try:
                        send_nowait(message)  # the load generator yields only when it must
                    except trio.WouldBlock:
                        await transport.send(message)
                else:
                    await transport.send(message)
                i += 1
                self.messages_sent = i
            for message in self.protocol.end_input():
                await transport.send(message)
        except TransportClosed:
            return
        self.input_done = True
        if self._idle_scope is not None and self.idle_timeout is not None:
            self._idle_scope.deadline = trio.current_time() + self.idle_timeout

    def _sender(self, send_nowait: NowaitSender, wrap: Callable[[Buffer], Message],
                message_at: Callable[[int], Buffer]) -> Callable[[int], bool]:
        """For the pacer's task: send message ``i`` if it goes without waiting (True), or leave
        it to this conversation's own task (False)."""
        send_times = self.send_times

        def send_now(i: int) -> bool:
            message = wrap(message_at(i))
            now = time.perf_counter()
            try:
                send_nowait(message)
            except trio.WouldBlock:
                return False
            if self.first_send is None:
                self.first_send = now
            send_times.append(now)
            self.messages_sent = i + 1
            return True

        return send_now

    # -- receiving ------------------------------------------------------------------------------

    async def _receive(self) -> None:
        # One cancel scope for the whole conversation, not one per message (a scope costs about
        # as much as framing the message): it has no deadline until the input is all sent; from
        # then on each message pushes it idle_timeout further (the sender sets the first one).
        with trio.CancelScope() as scope:
            if self.idle_timeout is not None:
                self._idle_scope = scope
                if self.input_done:
                    scope.deadline = trio.current_time() + self.idle_timeout
            close = False
            try:
                close = await self._receive_loop(scope)
            finally:
                self._idle_scope = None
        if scope.cancelled_caught:  # a wait for a message outlasted idle_timeout after the input ended
            self.outcome = IDLE
            close = True
        if close:  # outside the scope: the idle deadline bounds waiting for messages, not the close
            await self._close()

    async def _receive_loop(self, scope: trio.CancelScope) -> bool:
        """Receive until the conversation is over; True when this end should close."""
        transport = self.transport
        protocol = self.protocol
        parse = protocol.parse
        on_audio = self.on_audio
        caught_up = self.caught_up if protocol.needs_catch_up else None
        idle_timeout = self.idle_timeout
        # A transport's poll answers None where receive_nowait raises: on a paced connection
        # nothing is waiting after nearly every message, and a raise each time costs more.
        poll = getattr(transport, "poll", None)
        while True:
            try:
                if poll is not None:
                    message = poll()
                    if message is None:
                        message = await transport.receive()
                else:
                    try:
                        message = transport.receive_nowait()
                    except trio.WouldBlock:
                        message = await transport.receive()
            except TransportClosed as closed:
                self.closed = closed
                if self.outcome is None:
                    self.outcome = CLOSED
                return False
            if idle_timeout is not None and self.input_done:
                scope.deadline = trio.current_time() + idle_timeout
            now = time.perf_counter()
            item = parse(message)
            if isinstance(item, AUDIO_TYPES):
                self.last_output = now
                on_audio(item, now)
                if caught_up is not None and not self._finishing and caught_up():
                    self._finishing = True
                    messages = protocol.finish()
                    if not messages:
                        self.outcome = COMPLETE
                        return True
                    await self._send_quietly(messages)  # then read on, up to the end event
                continue
            if type(item) is Ended:
                self.end = item
                self.outcome = ENDED
                if not protocol.server_closes:
                    return True
            elif type(item) is ServerError:
                self.errors.append(item)
            elif type(item) is Text:
                if self.on_text is not None:
                    self.on_text(item.text)
            elif type(item) is Opened:
                protocol.opened(item)

    async def _send_quietly(self, messages: list[Message]) -> None:
        try:
            for message in messages:
                await self.transport.send(message)
        except TransportClosed:
            pass  # the receiver hears the close next

    async def _close(self) -> None:
        with trio.move_on_after(5):
            await self.transport.close(CloseCode.NORMAL_CLOSURE)

    # -- after the end ---------------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        """Ended as a conversation should: the server's own end with reason ``stop``, or (no end
        of input) the client heard everything; no error events."""
        if self.errors:
            return False
        if self.outcome == COMPLETE:
            return True
        return self.outcome == ENDED and self.end is not None and self.end.reason == FinishReason.STOP

    def describe(self) -> str:
        """How it ended, in words."""
        if self.outcome == ENDED and self.end is not None:
            text = f"server ended the session: {self.end.reason}"
            return text + (f" ({self.end.error})" if self.end.error else "")
        if self.outcome == COMPLETE:
            return "complete: all output heard"
        if self.outcome == IDLE:
            return f"the server sent nothing for {self.idle_timeout:g} s after the input ended"
        if self.outcome == CLOSED and self.closed is not None:
            code = self.closed.code
            reason = f": {self.closed.reason}" if self.closed.reason else ""
            return f"the connection closed early with code {code}{reason}"
        return "unfinished"
