"""A session's lifecycle: its state, how it moves, and why the session ends, in one place.

The reader, the writer and the scheduler's callbacks ask it two things on their hot paths (is
input still taken? is output still sent?) and tell it two (stop taking input; end now).  It holds
the cancel scopes those two act on: a stop cancels the reader only while it waits for the next
message (``between_messages``), an end cancels the whole session.
"""

from __future__ import annotations

import enum

import trio

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import TransportClosed


class SessionState(enum.Enum):
    """Where a session is in its life.  It moves forward through the list, except that an
    ``OPEN`` session may go ``DETACHED`` and back any number of times (a dropped connection and
    its resume).  ``Lifecycle.state`` holds it; ``_RANK`` below orders it for "at least" tests."""

    #: Built, no slot yet: ``run`` has not started.
    OPENING = "opening"
    #: Holds its slot, takes the client's messages and sends the model's output.
    OPEN = "open"
    #: The connection dropped without a clean end: the slot is kept for
    #: ``runtime.resume_window_s``, input waits per ``runtime.late_input``, output goes to the
    #: resume journal until a client resumes with the session's token (back to ``OPEN``).
    DETACHED = "detached"
    #: Takes no more messages (shutdown, the length limit); answers every frame already taken.
    STOPPING = "stopping"
    #: Every frame of the input is submitted; the writer sends what is left and ends.
    INPUT_ENDED = "input_ended"
    #: Ending now (a finish reason is set, the tasks are cancelled): no more output goes out,
    #: only the goodbye.
    CLOSING = "closing"
    #: Over: the slot is freed and the goodbye said.
    CLOSED = "closed"


#: Order for "at least" tests: a detached session counts as open.
_RANK = {SessionState.OPENING: 0, SessionState.OPEN: 1, SessionState.DETACHED: 1, SessionState.STOPPING: 2,
         SessionState.INPUT_ENDED: 3, SessionState.CLOSING: 4, SessionState.CLOSED: 5}


def rank(state: SessionState) -> int:
    """``state``'s place in the forward order (``OPEN`` and ``DETACHED`` share one)."""
    return _RANK[state]


_OPENING = SessionState.OPENING
_OPEN = SessionState.OPEN
_DETACHED = SessionState.DETACHED
_CLOSING = SessionState.CLOSING
_CLOSED = SessionState.CLOSED


class Lifecycle:
    """One session's state and its end (see the module docstring)."""

    def __init__(self) -> None:
        self.state = SessionState.OPENING
        #: Why the session ends (the first reason wins), what the client is told besides, and
        #: the close code it goes with.
        self.finish_reason: FinishReason | None = None
        self.finish_error: str | None = None
        self.close_code: int = CloseCode.NORMAL_CLOSURE
        #: The session's nursery, cancelled by an end.
        self.cancel_scope: trio.CancelScope | None = None
        #: The reader's, cancelled by a stop that finds it between two messages.
        self.reader_scope: trio.CancelScope | None = None
        #: The reader waits for the next message (or for room in the reply queue): the one place
        #: a stop may cancel it.  Mid-message it finishes the message first.
        self.between_messages = False

    @property
    def taking_input(self) -> bool:
        """Input is still taken: not stopping, its input not ended, not ending."""
        state = self.state  # identity tests: an enum's hash (for a rank lookup) is Python code
        return state is _OPEN or state is _DETACHED or state is _OPENING

    @property
    def sending(self) -> bool:
        """Output still goes out (the session is not ending or over)."""
        state = self.state
        return not (state is _CLOSING or state is _CLOSED)

    def advance(self, state: SessionState) -> None:
        """Move forward to ``state``; never back (a later stop does not reopen an ended input)."""
        if rank(state) > rank(self.state):
            self.state = state

    def detach(self) -> None:
        if self.state is _OPEN:
            self.state = _DETACHED

    def reattach(self) -> None:
        if self.state is _DETACHED:
            self.state = _OPEN

    def stop_input(self, reason: FinishReason, close_code: int) -> None:
        """End the session after the messages already taken have been answered: the reader stops
        at the next message boundary, the writer finishes, the client gets full usage and
        ``reason``."""
        if self.finish_reason is None:
            self.finish_reason = reason
            self.close_code = close_code
        self.advance(SessionState.STOPPING)
        if self.reader_scope is not None:
            # Mid-message (decoding, submitting, waiting for credit) the reader is left to finish
            # the message: cancelling it there would drop the rest of the message's frames and
            # then submit the framer's tail after the hole.
            if self.between_messages:
                self.reader_scope.cancel()
        elif self.cancel_scope is not None:
            self.cancel_scope.cancel()

    def finish(self, reason: FinishReason, error: str | None, close_code: int) -> None:
        """Record why the session ends (the first reason wins) and stop its tasks: outputs that
        arrive from now on (a later step of a failed session) are not sent."""
        self.advance(SessionState.CLOSING)
        if self.finish_reason is None:
            self.finish_reason = reason
            self.finish_error = error
            self.close_code = close_code
        if self.cancel_scope is not None:
            self.cancel_scope.cancel()

    def transport_closed(self, closed: TransportClosed) -> None:
        """The connection ended: the client's doing, or this end's (a limit, a dead peer)."""
        if closed.finish_reason is None:
            self.finish(FinishReason.CLIENT_CLOSED, None, CloseCode.NORMAL_CLOSURE)
        else:  # this end closed it: its own reason, for the log and usage
            self.finish(closed.finish_reason, None, closed.code)
