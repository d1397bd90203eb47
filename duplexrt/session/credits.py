"""The credits both directions of a session share: the one bound that ties input to output.

A session submits a frame only while it has fewer than ``inbox_depth`` frames not yet stepped,
so its inbox queue never fills in normal operation, and the step delivery that frees room is
also what wakes the reader.  And it has at most ``inbox_depth + outbox_depth`` frames submitted
and not yet sent, so the scheduler can always hand it output without blocking, and a client that
stops reading stops its own input, not anyone else's.  (Letting sessions run into full inboxes
and wait on worker threads, as the lease's own ``submit`` must, is what this avoids: the thread
hops and CPU per frame are ``benchmarks/core.py``'s to measure.)

The reader counts frames in (``submitted``); the scheduler's delivery counts them back
(``delivered``, waking a reader that waits once ``resume_below`` or fewer are left in the inbox);
the writer counts them out (``told``, then ``sent``, which gives ``in_flight`` credit back); a
clear drops them (``dropped``).  Whoever gives credit back wakes the reader (``wake``).  The
once-a-frame updates are written out where they happen (``Session.step_output``,
``Writer._batch_sent``): a call each would cost more than the update.
"""

from __future__ import annotations

import trio


class Credits:
    """One session's frame counters and the reader's wait for credit (see the module docstring)."""

    __slots__ = ("inbox_depth", "max_in_flight", "resume_below", "submitted", "delivered", "told", "sent",
                 "dropped", "in_flight", "lot")

    def __init__(self, inbox_depth: int, outbox_depth: int) -> None:
        self.inbox_depth = inbox_depth
        self.max_in_flight = inbox_depth + outbox_depth
        #: A parked reader resumes only once half its inbox has drained, so that each wake-up
        #: submits several frames instead of one: task switches per frame halve or better.
        self.resume_below = max(1, inbox_depth // 2)
        #: Frames submitted (flush frames included), delivered back by the scheduler, handed to
        #: the translator to send, sent, and dropped at the client's request (ClearOutput).
        self.submitted = 0
        self.delivered = 0
        self.told = 0
        self.sent = 0
        self.dropped = 0
        #: Submitted and not yet sent (or dropped).
        self.in_flight = 0
        #: Where the reader waits for credit, or for room in the reply queue.
        self.lot = trio.lowlevel.ParkingLot()

    def may_submit(self) -> bool:
        return self.submitted - self.delivered < self.inbox_depth and self.in_flight < self.max_in_flight

    async def wait_to_submit(self) -> None:
        """Return once a frame may be submitted; the caller submits it before its next wait."""
        while self.submitted - self.delivered >= self.inbox_depth or self.in_flight >= self.max_in_flight:
            await self.lot.park()

    def drop(self, count: int) -> None:
        """``count`` frames waiting to go out were thrown away (ClearOutput)."""
        self.in_flight -= count
        self.dropped += count
        self.wake()

    def wake(self) -> None:
        """Wake a reader waiting for credit or for room: it looks again."""
        if self.lot:
            self.lot.unpark_all()

    @property
    def all_delivered(self) -> bool:
        return self.delivered == self.submitted

    @property
    def answered(self) -> int:
        """Frames handed to the translator to send, plus those dropped by ClearOutput."""
        return self.told + self.dropped
