"""Resume after a dropped connection: a transport that outlives the connection under it.

A phone that walks out of Wi-Fi, or a balancer that restarts, cuts a WebSocket without a Close.
``ResumableTransport`` stands between the session and its connection so that such a drop is not
the end: the session keeps its slot, its reader waits for input as it would for a slow client
(``runtime.late_input``), and what its writer sends goes into a journal.  A client that comes
back with the session's token within ``runtime.resume_window_s`` gets, on the new connection, a
notice (how many of its messages the session took), then the journal from the first message it
did not receive, then live output: the same conversation, nothing lost and nothing twice.

Exactly once, both ways, by counting messages:

- every message the session sends is numbered from 0 (the first server message, which carries
  the token, is number 0); the journal keeps the last ``runtime.resume_journal_s`` seconds of
  them.  The client says how many it received (``received=N``) and gets numbers N onwards.  The
  resume notice itself is not numbered.
- every client message the session takes is counted; the notice says how many (``taken``), and
  the client sends again, in order, whatever it sent after those.  A message the old connection
  delivers after the drop was noticed is not taken: the client will send it again.

A token is good for one resume: the notice carries the next one.  A token names its replica
(``<replica id>.<secret>``) so that a balancer can send the resume where the session lives.

What one client may hold with this is bounded, so that resume cannot be used to lock others out:

- a connection becomes resumable only once the session has taken a message from it: an upgrade
  cut before its first message is the end, not a drop (it would cost nothing to repeat);
- the server claims a token (``claim``) in the same step that reads the resume's request head,
  so two reconnects with one token cannot both win;
- a resume's notice and replay must go out within the server's deadline, or the resuming
  connection is given up (the session stays detached, the token good): a resumer that reads
  nothing cannot keep other resumes out;
- the journal is bounded in bytes by what ``journal_s`` seconds of the session's output format
  take (the server works it out per route and format), not only by when messages were sent;
- the server may ``evict`` a detached session when a new caller needs its slot.
"""

from __future__ import annotations

import math
import secrets
from collections import deque
from collections.abc import Callable
from typing import Protocol

import trio

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import DirectSend, Message, Transport, TransportClosed, direct_send, poller

#: Random bytes in a token's secret: 144 bits, far past guessing; urlsafe base64 has no ``.``.
TOKEN_BYTES = 18
#: A journal never holds more than this, whatever its seconds and its format.  The server passes a
#: tighter cap per session, from the seconds of audio its route and format take
#: (``duplexrt.server.budget.journal_bytes``).
MAX_JOURNAL_BYTES = 32 << 20


def new_token(replica_id: str) -> str:
    """A fresh, unguessable resume token naming ``replica_id``."""
    return f"{replica_id}.{secrets.token_urlsafe(TOKEN_BYTES)}"


def split_token(token: str) -> tuple[str, str]:
    """``(replica id, secret)``; the replica id may itself contain dots, the secret never does."""
    replica, _, secret = token.rpartition(".")
    return replica, secret


class ResumeError(Exception):
    """A resume that cannot be served: ``status`` for the HTTP answer, ``code`` for programs."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message


class ConnectionListener(Protocol):
    """Who hears that the connection dropped or came back (the session, for its state)."""

    def connection_dropped(self) -> None: ...

    def connection_resumed(self) -> None: ...


#: Builds the protocol's resume notice from the next token and the count of client messages taken.
Notice = Callable[[str, int], list[Message]]


class Claim:
    """One resuming connection's hold on a session (``ResumableTransport.claim``): compared by
    identity, so that only its own connection can use or release it."""

    __slots__ = ()


def is_drop(closed: TransportClosed) -> bool:
    """A connection lost without a clean end: no Close frame (1006), or a peer that stopped
    answering pings.  A client's own Close, a limit or a protocol error ends the session."""
    if closed.finish_reason is FinishReason.PING_TIMEOUT:
        return True
    return closed.finish_reason is None and closed.code == CloseCode.ABNORMAL_CLOSURE


class ResumableTransport:
    """A ``Transport`` over a connection that may be replaced (see the module docstring)."""

    def __init__(self, transport: Transport, token: str, *, window_s: float, journal_s: float,
                 max_journal_bytes: int | Callable[[], int] = MAX_JOURNAL_BYTES) -> None:
        self.token = token
        self.listener: ConnectionListener | None = None
        #: Messages the session sent (numbered from 0), and client messages it took.
        self.sent = 0
        self.taken = 0
        #: Drops noticed and resumes served.
        self.drops = 0
        self.resumes = 0
        self._current: Transport | None = transport
        self._poll_current = poller(transport)
        self._window = window_s
        self._journal_s = journal_s
        # A callable cap is asked again whenever the journal passes it: the session's output
        # format may change (a client's format switch), and the cap is that format's seconds.
        self._journal_budget = max_journal_bytes if callable(max_journal_bytes) else None
        self._max_journal_bytes = min(MAX_JOURNAL_BYTES, max_journal_bytes() if callable(max_journal_bytes)
                                      else max_journal_bytes)
        self._journal: deque[tuple[float, Message]] = deque()
        self._journal_first = 0  # the number of the oldest message in the journal
        self._journal_bytes = 0
        self._attached = trio.Event()
        self._attached.set()
        self._deadline = math.inf
        self._claim: Claim | None = None  # the resuming connection's, while one is under way
        self._expired = False
        self._evicted = False
        self._closed = False
        self._changed = trio.lowlevel.ParkingLot()
        self._clock = trio.lowlevel.current_clock().current_time
        #: The connection's own direct send, if it has one (a resumed one, made by the same
        #: server, has one too): ``send_nowait`` can succeed only then.
        self._direct: DirectSend | None = direct_send(transport)
        self.offers_send_nowait = self._direct is not None

    @property
    def detached(self) -> bool:
        """The connection dropped and no client has resumed yet (nor has the window ended)."""
        return self._current is None and not self._closed and not self._expired

    @property
    def resume_deadline(self) -> float:
        """When the window of the current drop ends (trio time); ``-inf`` while attached."""
        return self._deadline if self.detached else -math.inf

    @property
    def journal_bytes(self) -> int:
        """What the journal holds now, in bytes of message payload."""
        return self._journal_bytes

    def _resumable_drop(self, closed: TransportClosed) -> bool:
        """A connection lost this way detaches the session rather than ending it: resume is on,
        the loss was a drop, and the session took at least one message over it (an upgrade cut
        before its first message would hold a slot for nothing)."""
        return self._window > 0 and self.taken > 0 and is_drop(closed)

    def evict(self) -> None:
        """End a detached session's wait now: a new caller needs its slot.  The session ends with
        finish reason ``resume_expired`` (its close reason says it was evicted); a later resume
        is refused as for any ended session."""
        if not self.detached:
            return
        self._evicted = True
        self._expired = True
        self._attached.set()
        self._changed.unpark_all()

    def abandon(self) -> None:
        """No resume will come (the server is stopping at once): end the window now, so that a
        session detached, or detaching, does not wait it out."""
        self._window = 0  # a drop from now on ends the session
        if self._current is None:
            self._expired = True
            self._attached.set()
        self._changed.unpark_all()

    # -- the session's side ----------------------------------------------------------------------

    async def receive(self) -> Message:
        while True:
            transport = self._current
            if transport is None:
                await self._wait_for_client()
                continue
            try:
                message = await transport.receive()
            except TransportClosed as closed:
                if transport is not self._current:
                    continue  # that connection was already given up
                if self._resumable_drop(closed):
                    self._drop(transport)
                    continue
                raise
            if transport is not self._current:
                continue  # arrived on a connection given up: the client sends it again
            self.taken += 1
            return message

    def receive_nowait(self) -> Message:
        transport = self._current
        if transport is None:
            raise trio.WouldBlock
        try:
            message = transport.receive_nowait()
        except TransportClosed:
            raise trio.WouldBlock from None  # receive() tells a drop from an end
        self.taken += 1
        return message

    def poll(self) -> Message | None:
        if self._current is None:
            return None
        try:
            message = self._poll_current()
        except TransportClosed:
            return None  # receive() tells a drop from an end
        if message is not None:
            self.taken += 1
        return message

    async def watch_for_close(self, taking: Callable[[], bool]) -> TransportClosed | None:
        """The connection's own ``watch_for_close`` (``NativeWebSocket``): how the client ended
        it, once it has, while the session takes no message.  A drop that may resume is not an
        end: None, and the session notices it, as before, once it has taken what came first."""
        transport = self._current
        watch = getattr(transport, "watch_for_close", None)
        if watch is None:
            return None
        closed: TransportClosed | None = await watch(taking)
        if closed is None or transport is not self._current or self._resumable_drop(closed):
            return None
        return closed

    async def send(self, message: Message) -> None:
        if self._expired or self._closed:
            raise self._ended()
        self._record(message)
        transport = self._current
        if transport is None:
            return  # kept in the journal for the client's return
        try:
            await transport.send(message)
        except TransportClosed as closed:
            if transport is not self._current:
                return  # given up meanwhile: the message is in the journal
            if self._resumable_drop(closed):
                self._drop(transport)
                return
            raise

    def send_nowait(self, message: Message) -> bool:
        """``send`` without yielding, numbered and journaled exactly as ``send`` does it: True
        once out whole (or journaled, detached), False when the connection holds part of it
        for now (``flush``).  Raises ``trio.WouldBlock``, having numbered nothing, when the
        connection cannot take it now or has no ``send_nowait``."""
        if self._expired or self._closed:
            raise self._ended()
        transport = self._current
        if transport is None:
            self._record(message)
            return True  # kept in the journal for the client's return
        direct = self._direct
        if direct is None:
            raise trio.WouldBlock
        try:
            whole = direct.send_nowait(message)
        except TransportClosed as closed:
            self._record(message)
            if self._resumable_drop(closed):
                self._drop(transport)
                return True
            raise
        self._record(message)
        return whole is not False

    async def flush(self) -> None:
        """Return once what the connection in use holds of earlier messages is out; a drop on
        the way is noticed as ``send`` notices it (the journal has the messages)."""
        transport = self._current
        direct = self._direct
        if transport is None or direct is None:
            return  # detached, or a connection whose every send is awaited whole
        try:
            await direct.flush()
        except TransportClosed as closed:
            if transport is not self._current:
                return  # given up meanwhile
            if self._resumable_drop(closed):
                self._drop(transport)
                return
            raise

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        """Close the connection in use.  Detached, first give the client until the end of the
        window to come back for the session's last messages (the caller bounds the wait)."""
        if self._closed:
            return
        try:
            if self._current is None and not self._expired:
                with trio.move_on_at(self._deadline):
                    await self._attached.wait()
            self._closed = True
            transport = self._current
            if transport is not None:
                await transport.close(code, reason)
        finally:  # over, even when the caller's bound cut the wait short
            self._closed = True
            self._release_memory()
            self._changed.unpark_all()

    # -- the resuming connection's side ----------------------------------------------------------

    def check(self, received: int) -> None:
        """Raises ResumeError unless a client that received ``received`` messages can resume now."""
        if self._closed or self._expired:
            raise ResumeError(410, "session_ended", "the session has ended")
        if self._claim is not None:
            raise ResumeError(409, "resume_in_progress", "another connection is resuming this session")
        self._check_counts(received)

    def claim(self, received: int) -> Claim:
        """Check, then hold the session for one resuming connection, with no await in between: a
        second connection with the same token is refused (409) until the claim is released or
        ``attach`` is over.  The server claims when it has read the resume's request head."""
        self.check(received)
        claim = self._claim = Claim()
        return claim

    def release(self, claim: Claim) -> None:
        """Give up ``claim`` if it still holds the session (its connection never reached, or
        never finished, ``attach``); a claim already over releases nothing."""
        if self._claim is claim:
            self._claim = None

    def _check_counts(self, received: int) -> None:
        if self._closed or self._expired:
            raise ResumeError(410, "session_ended", "the session has ended")
        if not 0 <= received <= self.sent:
            raise ResumeError(400, "bad_received",
                              f"received={received}, but the session has sent {self.sent} messages")
        if received < self._journal_first:
            raise ResumeError(410, "journal_exceeded",
                              f"the session's journal no longer holds message {received} (it starts at "
                              f"{self._journal_first}): the connection was away too long to resume")

    async def attach(self, transport: Transport, received: int, token: str, notice: Notice, *,
                     claim: Claim | None = None, replay_timeout: float = math.inf) -> None:
        """Serve the session over ``transport`` from now on: the notice (carrying ``token``, the
        next one), the messages from number ``received`` on, then live.  A connection still in
        use (its drop not yet noticed) is given up: the token proves who is asking.  ``claim``:
        the one the caller holds (else this claims the session itself).  The notice and the replay must be out
        within ``replay_timeout`` seconds, or the new connection is given up (TransportClosed)
        and the session stays detached.  Raises ResumeError if that cannot be done,
        TransportClosed if the new connection fails too."""
        if claim is None:
            claim = self.claim(received)
        elif self._claim is not claim:
            raise ResumeError(409, "resume_in_progress", "another connection is resuming this session")
        else:
            self._check_counts(received)
        try:
            if self._current is not None:
                self._drop(self._current)
            with trio.move_on_after(replay_timeout) as replay:
                for message in notice(token, self.taken):
                    await transport.send(message)
                number = received
                # Sends may add to the journal while this one replays it: until caught up, no
                # await lies between the last check and taking over as the live connection.
                while number < self.sent:
                    if number < self._journal_first:
                        raise ResumeError(410, "journal_exceeded",
                                          "the journal moved past the client during the resume")
                    await transport.send(self._journal[number - self._journal_first][1])
                    number += 1
            if replay.cancelled_caught:
                abort = getattr(transport, "abort", None)
                if abort is not None:
                    abort()
                raise TransportClosed(CloseCode.ABNORMAL_CLOSURE,
                                      f"the resume's replay was not taken within {replay_timeout:g} s")
            if self._closed or self._expired:
                raise ResumeError(410, "session_ended", "the session ended during the resume")
        finally:
            self.release(claim)
        self._current = transport
        self._poll_current = poller(transport)
        self._direct = direct_send(transport)
        self.offers_send_nowait = self._direct is not None
        self.token = token
        self.resumes += 1
        self._attached.set()
        self._changed.unpark_all()
        if self.listener is not None:
            self.listener.connection_resumed()

    async def wait_released(self, transport: Transport) -> None:
        """Return once ``transport`` no longer serves the session (it dropped, was replaced, or
        the session ended and closed it)."""
        while self._current is transport and not self._closed:
            await self._changed.park()

    # -- internals -------------------------------------------------------------------------------

    def _record(self, message: Message) -> None:
        # Once per message sent: the clock's bound method (no trio.current_time() lookup chain),
        # and the trim loop entered only when the oldest message is due out.
        now = self._clock()
        journal = self._journal
        journal.append((now, message))
        self._journal_bytes += len(message)
        self.sent += 1
        horizon = now - self._journal_s
        if journal[0][0] < horizon or self._journal_bytes > self._max_journal_bytes:
            if self._journal_budget is not None and self._journal_bytes > self._max_journal_bytes:
                self._max_journal_bytes = min(MAX_JOURNAL_BYTES, self._journal_budget())
            while journal and (journal[0][0] < horizon or self._journal_bytes > self._max_journal_bytes):
                self._journal_bytes -= len(journal.popleft()[1])
                self._journal_first += 1

    def _drop(self, transport: Transport) -> None:
        self._current = None
        self.drops += 1
        self._attached = trio.Event()
        self._deadline = trio.current_time() + self._window
        abort = getattr(transport, "abort", None)
        if abort is not None:
            abort()  # free the socket now; whatever it still holds is resent or replayed
        self._changed.unpark_all()
        if self.listener is not None:
            self.listener.connection_dropped()

    async def _wait_for_client(self) -> None:
        if not (self._expired or self._closed):
            with trio.move_on_at(self._deadline):
                await self._attached.wait()
                return
            self._expired = True
            self._changed.unpark_all()
        raise self._ended()

    def _release_memory(self) -> None:
        """The session is over: drop the journal and the references back to the session now, so
        that they go with the last reference to this transport, not with a later cycle
        collection (a server holds no ended session's journal)."""
        self._journal.clear()
        self._journal_bytes = 0
        self.listener = None

    def _ended(self) -> TransportClosed:
        if self._evicted:
            return TransportClosed(CloseCode.GOING_AWAY, "evicted: a new session needed the slot of this "
                                   "detached one", FinishReason.RESUME_EXPIRED)
        if self._expired:
            return TransportClosed(CloseCode.GOING_AWAY, f"no resume within {self._window:g} s",
                                   FinishReason.RESUME_EXPIRED)
        return TransportClosed(CloseCode.NORMAL_CLOSURE, "the session has ended")
