"""A session's lifecycle as one value instead of a handful of flags."""

from __future__ import annotations

import enum


class SessionState(enum.Enum):
    """Where a session is in its life.  It moves forward through the list, except that an
    ``OPEN`` session may go ``DETACHED`` and back any number of times (a dropped connection and
    its resume).  ``Session.state`` holds it; ``_RANK`` below orders it for the "at least" tests
    the session makes on its hot paths."""

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
