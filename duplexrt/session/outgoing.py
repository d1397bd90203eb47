"""A session's one queue of messages to the client, in the order the translator made them.

Every message the translator makes goes in here the moment it is made (``queue``), and leaves
only once sent, so the client sees everything in the order the translator decided, even when the
reader (replies, errors) and the writer (audio) both have something.  The queue is bounded by
count and by bytes: past either the reader stops taking messages until the writer catches up
(``full``), so a client that sends and never reads holds a bounded amount of memory.
"""

from __future__ import annotations

from collections import deque

import trio

from duplexrt.session.credits import Credits
from duplexrt.wire.transport import DirectSend, Message, Transport

#: Replies and errors a session may have waiting for a client that is not reading: past either
#: bound its reader stops taking messages until the writer catches up.  Audio passes through the
#: same queue, a batch at a time, so the byte bound sits well above one batch of audio.
MAX_PENDING_MESSAGES = 64
MAX_PENDING_BYTES = 1 << 20


class Outgoing:
    """The queue, and the writer's wake-up for it (see the module docstring)."""

    __slots__ = ("pending", "pending_bytes", "writer_lot", "_credits")

    def __init__(self, credits: Credits) -> None:
        self.pending: deque[Message] = deque()
        #: len() of every message in ``pending``: characters or bytes.
        self.pending_bytes = 0
        #: Where the writer waits for something to send (this queue, or output in the outbox).
        self.writer_lot = trio.lowlevel.ParkingLot()
        self._credits = credits

    def queue(self, messages: list[Message] | tuple[Message, ...]) -> None:
        """Hand messages to the writer, behind everything made before them."""
        if messages:
            pending = self.pending
            for message in messages:
                pending.append(message)
                self.pending_bytes += len(message)
            if self.writer_lot:
                self.writer_lot.unpark_all()

    def full(self) -> bool:
        return len(self.pending) > MAX_PENDING_MESSAGES or self.pending_bytes > MAX_PENDING_BYTES

    def over_bytes(self) -> bool:
        return self.pending_bytes > MAX_PENDING_BYTES

    async def send(self, transport: Transport) -> None:
        """Send the queued messages in order; each leaves the queue only once sent, so a send cut
        off by cancellation leaves it for the goodbye."""
        pending = self.pending
        while pending:
            message = pending[0]
            await transport.send(message)
            pending.popleft()
            self.pending_bytes -= len(message)
        self._credits.wake()  # a reader waiting for room in the queue

    def send_nowait(self, direct: DirectSend) -> bool:
        """``send`` without yielding: True once every queued message is out whole.  False leaves
        the rest queued (or its end in the transport) for the writer."""
        pending = self.pending
        send_nowait = direct.send_nowait
        whole = True
        while pending and whole:
            message = pending[0]
            try:
                whole = send_nowait(message)
            except trio.WouldBlock:
                return False
            pending.popleft()
            self.pending_bytes -= len(message)
        self._credits.wake()  # a reader waiting for room in the queue
        return whole and not pending
