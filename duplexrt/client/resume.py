"""The client's half of resume (docs/resume.md): a transport that reconnects when its connection
drops, so that ``duplexrt client`` and ``simulate --url`` carry on the same conversation.

It counts the session's messages it received and keeps what it sent.  When the connection drops
without a clean end (no Close frame, code 1006), it reconnects to the same URL with
``resume=<token>&received=<count>``, reads the server's resume notice (how many client messages
the session took, and the next token), sends again, in order, whatever it sent after those, and
goes on: the conversation above it sees one unbroken stream, every message once.  The token comes
from the session's first server messages (``resume_token`` in the greeting, or in Moshi's
handshake metadata).
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable

import trio

from duplexrt.client.abilities import Abortable, nowait_sender
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message, Transport, TransportClosed, poller

__all__ = ["ResumingTransport", "token_in"]

#: Sent messages kept for sending again: those of the last ``KEEP_S`` seconds, at most
#: ``MAX_KEPT_BYTES``.  The server can only be missing what was in flight when the connection
#: dropped (socket buffers, a few messages queued) plus what was sent while it was away.
KEEP_S = 15.0
MAX_KEPT_BYTES = 8 << 20
#: The session's first messages that may carry its token (Moshi: the handshake, then metadata).
_TOKEN_MESSAGES = 2
#: Between two failed reconnects (the server may not have noticed the drop yet).
_RETRY_S = 0.1

#: Opens a new connection to a URL (the resume query already in it).
Connect = Callable[[str], Awaitable[Transport]]


def token_in(message: Message) -> str | None:
    """A resume token in one server message (JSON text, or Moshi's kind-4 metadata), or None."""
    if isinstance(message, str):
        text = message
    elif message[:1] == b"\x04":
        text = bytes(message[1:]).decode("utf-8", "replace")
    else:
        return None
    if "resume_token" not in text:
        return None
    try:
        data = json.loads(text)
    except ValueError:
        return None
    token = data.get("resume_token") if isinstance(data, dict) else None
    return token if isinstance(token, str) else None


def _notice(messages: list[Message]) -> tuple[str, int] | None:
    """The next token and the count of client messages taken, from a resume notice."""
    for message in messages:
        text = message if isinstance(message, str) else bytes(message[1:]).decode("utf-8", "replace")
        try:
            data = json.loads(text)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("resume_token"), str) and isinstance(data.get("received"), int):
            return data["resume_token"], data["received"]
    return None


def _is_drop(closed: TransportClosed) -> bool:
    return closed.finish_reason is None and closed.code == CloseCode.ABNORMAL_CLOSURE


class ResumingTransport:
    """A ``Transport`` that resumes its session on a new connection when the connection drops.

    ``notices`` is how many messages the route's resume notice takes (2 on ``/api/chat``: a
    handshake and metadata; 1 elsewhere).  ``window`` bounds how long it tries to reconnect."""

    def __init__(self, transport: Transport, url: str, connect: Connect, *, notices: int = 1,
                 window: float = 10.0, keep_s: float = KEEP_S, max_kept_bytes: int = MAX_KEPT_BYTES,
                 on_drop: Callable[[TransportClosed, float], None] | None = None) -> None:
        self._current: Transport | None = transport
        self._poll_current = poller(transport)  # every connection comes from the same connect
        self._send_current = nowait_sender(transport)
        self._url = url
        self._connect = connect
        self._notices = notices
        self._window = window
        #: Told of each drop as the resume begins (how the connection closed, the window in
        #: seconds): ``duplexrt client`` says it is resuming rather than go quiet for the window.
        self._on_drop = on_drop
        self._keep_s = keep_s
        self._max_kept_bytes = max_kept_bytes
        self.token: str | None = None
        #: The session's messages received, over every connection (notices not counted).
        self.received = 0
        #: Messages sent, and the resumes served.
        self.sent = 0
        self.resumes = 0
        self._kept: deque[tuple[float, Message]] = deque()
        self._kept_first = 0
        self._kept_bytes = 0
        self._ready = trio.Event()
        self._ready.set()
        #: Messages the new connection brought while this end was sending again (``_resume``),
        #: not yet handed on: ``receive`` gives them first.
        self._early: deque[Message] = deque()
        # The paths that do not yield, offered only where the connection offers them (every
        # connection comes from the same ``connect``), so that a caller who finds none does not
        # pay for a refusal on every message.
        if self._send_current is not None:
            self.send_nowait = self._send_nowait
        if hasattr(transport, "poll"):
            self.poll = self._poll

    @property
    def current(self) -> Transport | None:
        """The connection in use (None while reconnecting)."""
        return self._current

    async def receive(self) -> Message:
        while True:
            if self._early:
                message = self._early.popleft()
                self._count(message)
                return message
            transport = self._current
            if transport is None:
                await self._ready.wait()
                if self._current is None:
                    raise TransportClosed(CloseCode.ABNORMAL_CLOSURE, "the connection dropped and did not resume")
                continue
            try:
                message = await transport.receive()
            except TransportClosed as closed:
                if transport is not self._current:
                    continue
                await self._resume_or_raise(transport, closed)
                continue
            if transport is not self._current:
                continue  # from a connection given up: the server sends it again
            self._count(message)
            return message

    def receive_nowait(self) -> Message:
        message = self._poll()
        if message is None:
            raise trio.WouldBlock
        return message

    def _poll(self) -> Message | None:
        """A message already in, or None (``Transport.poll``; ``receive_nowait`` without the raise)."""
        if self._early:
            early = self._early.popleft()
            self._count(early)
            return early
        transport = self._current
        if transport is None:
            return None
        try:
            message = self._poll_current()
        except TransportClosed:
            return None  # receive() tells a drop from an end
        if message is not None:
            self._count(message)
        return message

    def _send_nowait(self, message: Message) -> None:
        """Send without yielding, or raise ``trio.WouldBlock`` having taken nothing: then the
        caller ``send``s it, which also resumes a connection that dropped."""
        if self._current is not None:
            send = self._send_current
            if send is None:  # this connection sends only by await: send() takes the message
                raise trio.WouldBlock
            try:
                send(message)
            except TransportClosed:
                raise trio.WouldBlock from None
        self._keep(message)  # reconnecting: the resume sends it, in order, as send() does

    async def send(self, message: Message) -> None:
        self._keep(message)
        transport = self._current
        if transport is None:
            return  # reconnecting: the resume sends it, in order
        try:
            await transport.send(message)
        except TransportClosed as closed:
            if transport is not self._current:
                return
            await self._resume_or_raise(transport, closed)

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        transport = self._current
        if transport is not None:
            await transport.close(code, reason)

    def drop(self) -> None:
        """Cut the connection in use without a Close frame (``simulate --drop-rate``)."""
        current = self._current
        if isinstance(current, Abortable):
            current.abort()

    # -- internals -------------------------------------------------------------------------------

    def _count(self, message: Message) -> None:
        self.received += 1
        if self.received <= _TOKEN_MESSAGES and self.token is None:
            self.token = token_in(message)

    def _keep(self, message: Message) -> None:
        kept = self._kept
        now = trio.current_time()
        kept.append((now, message))
        self._kept_bytes += len(message)
        self.sent += 1
        horizon = now - self._keep_s
        while kept and (kept[0][0] < horizon or self._kept_bytes > self._max_kept_bytes):
            self._kept_bytes -= len(kept.popleft()[1])
            self._kept_first += 1

    async def _resume_or_raise(self, transport: Transport, closed: TransportClosed) -> None:
        if self.token is None or not _is_drop(closed):
            raise closed
        self._current = None
        self._ready = trio.Event()
        if self._on_drop is not None:
            self._on_drop(closed, self._window)
        try:
            await self._resume(closed)
        finally:
            self._ready.set()

    async def _take_early(self, transport: Transport) -> None:
        try:
            while True:
                self._early.append(await transport.receive())
        except TransportClosed:
            pass  # the new connection failed too: the send under way, or receive(), finds out

    async def _resume(self, closed: TransportClosed) -> None:
        # What the last connection brought but nobody took is sent again by the server, which
        # replays from ``received`` on.
        self._early.clear()
        separator = "&" if "?" in self._url else "?"
        deadline = trio.current_time() + self._window
        while True:
            url = f"{self._url}{separator}resume={self.token}&received={self.received}"
            try:
                with trio.fail_after(max(0.0, deadline - trio.current_time())):
                    transport = await self._connect(url)
                    notice = _notice([await transport.receive() for _ in range(self._notices)])
                break
            except trio.TooSlowError:
                raise closed from None
            except TransportClosed:
                pass
            except Exception as exc:  # refused (a 4xx) or not reachable yet
                status = getattr(exc, "status", None)
                if status is not None and 400 <= status < 500:
                    raise TransportClosed(CloseCode.ABNORMAL_CLOSURE, f"the resume was refused: {exc}",
                                          FinishReason.RESUME_EXPIRED) from None
            if trio.current_time() + _RETRY_S >= deadline:
                raise closed
            await trio.sleep(_RETRY_S)
        if notice is None:
            raise TransportClosed(CloseCode.PROTOCOL_ERROR, "the server's resume notice was not understood")
        self.token, taken = notice
        if taken < self._kept_first:
            raise TransportClosed(CloseCode.ABNORMAL_CLOSURE, "the messages to send again are no longer kept")
        # The server replays what this end missed while this end sends again what the server
        # missed.  Both only writing, a replay larger than the socket buffers between them would
        # block both for good: what arrives meanwhile is read and kept for ``receive``.
        failed: TransportClosed | None = None  # raised after the nursery, not in a group
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._take_early, transport)
            number = taken
            try:
                # Messages sent meanwhile are kept, not sent: this loop sends them, in order, up
                # to the last one, with no await between the last check and going live.
                while number < self.sent:
                    if number < self._kept_first:
                        raise TransportClosed(CloseCode.ABNORMAL_CLOSURE,
                                              "the messages to send again are no longer kept")
                    await transport.send(self._kept[number - self._kept_first][1])
                    number += 1
                self._current = transport
                self._poll_current = poller(transport)
                self._send_current = nowait_sender(transport)
            except TransportClosed as exc:
                failed = exc
            nursery.cancel_scope.cancel()
        if failed is not None:
            raise failed
        self.resumes += 1
