"""A session's output half: the ordered queue of messages to the client, and the two ways a step's
output reaches it.

Every message the translator makes goes into one queue the moment it is made (``_queue``), and
leaves it only once sent, so the client sees everything in the order the translator decided,
even when the reader (replies, errors) and the output (audio) both have something.  A step's
output is sent from its delivery, with no task woken, when nothing stands in the way
(``_send_directly``, called from ``Session.delivery_done``); otherwise the writer task sends it
(``_write_loop``).  Both cut the outbox into batches the same way (``_next_batch``, never across
a turn's end), hand them to the translator (``_tell``) and count them sent only once they are out
(``_batch_sent``), which is also what gives the reader its credit back.

A mixin of ``Session``: the state it reads and writes is set up, and described, in
``Session.__init__``.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import trio

from duplexrt.core.handoffs import HandoffKind
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message, TransportClosed

log = logging.getLogger("duplexrt.session")

#: Replies and errors a session may have waiting for a client that is not reading: past either
#: bound its reader stops taking messages until the writer catches up.  Audio passes through the
#: same queue, a batch at a time, so the byte bound sits well above one batch of audio.
MAX_PENDING_MESSAGES = 64
MAX_PENDING_BYTES = 1 << 20

#: One row of a step as the outbox holds it: audio, text piece, submitted and stepped (ns).
Output = tuple[np.ndarray, str | None, int, int]


class SessionOutput:
    """The writer's side of a ``Session``: model output and the translator's messages out."""

    def _queue(self, messages: list[Message] | tuple[Message, ...]) -> None:
        """Hand messages to the writer, behind everything made before them."""
        if messages:
            pending = self._pending
            for message in messages:
                pending.append(message)
                self._pending_bytes += len(message)
            if self._writer_lot:
                self._writer_lot.unpark_all()

    def _queue_full(self) -> bool:
        return len(self._pending) > MAX_PENDING_MESSAGES or self._pending_bytes > MAX_PENDING_BYTES

    async def _send_pending(self) -> None:
        """Send the queued messages in order; each leaves the queue only once sent, so a send cut
        off by cancellation leaves it for the goodbye."""
        pending = self._pending
        transport = self._transport
        while pending:
            message = pending[0]
            await transport.send(message)
            pending.popleft()
            self._pending_bytes -= len(message)
        if self._credit:
            self._credit.unpark_all()  # a reader waiting for room in the queue

    def _send_pending_nowait(self) -> bool:
        """``_send_pending`` without yielding: True once every queued message is out whole.
        False leaves the rest queued (or its end in the transport) for the writer."""
        pending = self._pending
        send_nowait = self._send_nowait
        whole = True
        while pending and whole:
            message = pending[0]
            try:
                whole = send_nowait(message)
            except trio.WouldBlock:
                return False
            pending.popleft()
            self._pending_bytes -= len(message)
        if self._credit:
            self._credit.unpark_all()  # a reader waiting for room in the queue
        return whole and not pending

    async def _write_loop(self) -> None:
        outbox = self._outbox
        metrics = self._metrics
        try:
            while True:
                if self._pending:
                    await self._send_pending()
                if self._unflushed is not None:  # sent from a delivery: wait until all of it is out
                    assert self._direct is not None  # only a direct send leaves a batch unflushed
                    await self._direct.flush()
                    items, self._unflushed = self._unflushed, None
                    self._batch_sent(items)
                if not outbox:
                    if not outbox and self._outbox_done:
                        break
                    await self._writer_lot.park()
                    metrics.writer_wakeups += 1
                    continue
                items, rows = self._next_batch()
                encoder = self._encoder  # a format switch replaces it between two batches
                if self._always_offload:
                    self._encoding = True
                    try:
                        payload = await self._services.handoffs.offload(
                            HandoffKind.CONVERT_OFFLOAD, encoder.encode_rows, rows)
                    finally:
                        self._encoding = False
                        if self._encoded:
                            self._encoded.unpark_all()
                else:
                    payload = encoder.encode_rows(rows)
                self._tell(items, payload)
                await self._send_pending()
                self._batch_sent(items)
            tail = self._encoder.flush()
            if tail:
                self._queue(self._protocol.audio_out(tail, 0))
            await self._send_pending()
        except TransportClosed as closed:
            self._transport_closed(closed)

    def _send_directly(self) -> None:
        """The writer's work for what a delivery brought, done in the delivery itself (trio
        thread, never raises): batch by batch, each sent without yielding.  A batch that does not
        go out whole (the client reads slowly, the socket is full) is left to the writer, which
        sends what is queued, waits for the transport's flush, and only then counts it sent; the
        rest of the outbox waits for it there."""
        outbox = self._outbox
        try:
            while outbox:
                items, rows = self._next_batch()
                self._tell(items, self._encoder.encode_rows(rows))
                if not self._send_pending_nowait():
                    self._unflushed = items
                    self._writer_lot.unpark_all()
                    return
                self._batch_sent(items)
                self._metrics.direct_batches += 1
        except TransportClosed as closed:
            self._transport_closed(closed)
        except Exception:
            log.exception("session %s failed", self.lease.session_id)
            self._finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)

    def _next_batch(self) -> tuple[list[Output], list[np.ndarray]]:
        """The outbox's next batch and its rows of audio: all of it, but never across a turn's
        end (``next_boundary``), so that each response carries exactly its frames; the rest
        waits for the next batch."""
        outbox = self._outbox
        count = len(outbox)
        answered = self._told + self._dropped
        boundary = self._protocol.next_boundary()
        if boundary is not None and answered < boundary < answered + count:
            count = boundary - answered
            items = [outbox.popleft() for _ in range(count)]
        else:
            items = list(outbox)
            outbox.clear()
        return items, [item[0] for item in items]

    def _tell(self, items: list[Output], payload: bytes) -> None:
        """Hand a batch to the translator, its messages into the queue behind everything before."""
        protocol = self._protocol
        pending = self._pending
        count = len(items)
        # Text first: a protocol that closes a turn on its last audio (realtime) must not find
        # that turn's text arriving after it.
        for item in items:
            if item[1]:
                self._text_pieces += 1
                self._metrics.text_pieces += 1
                for message in protocol.text_out(item[1]):
                    pending.append(message)
                    self._pending_bytes += len(message)
        # Even with no bytes (an encoder still filling a packet): the translator counts the
        # frames, and may close a turn on them.
        for message in protocol.audio_out(payload, count):
            pending.append(message)
            self._pending_bytes += len(message)
        # Counted as the translator is told, so that what it reads stays in step with what it
        # has said, whatever arrives while the messages are being sent...
        self._told += count

    def _batch_sent(self, items: list[Output]) -> None:
        """... and as sent only once they are: usage counts what the client got."""
        count = len(items)
        self._sent += count
        self._metrics.frames_out += count
        now = time.perf_counter_ns()
        if self._meter is not None:
            self._meter.batch_sent(items, now, self._last_sent_ns)
        self._last_sent_ns = now
        self._in_flight -= count
        if self._credit:
            self._credit.unpark_all()

