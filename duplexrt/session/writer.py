"""A session's output half: the model's output to the client, a whole step at a time.

The scheduler's delivery puts each row of a step in the outbox (``step_output``), never more
than the credits allow.  Once a delivery is in, its output is sent from the delivery itself,
with no task woken, when nothing stands in the way (``delivery_done``: the writer task is parked
with nothing queued before it, and the transport sends without yielding); otherwise the writer
task sends it (``run``).  Both cut the outbox into batches the same way (``_next_batch``, never
across a turn's end), hand them to the translator (``_tell``) and count them sent only once they
are out (``_batch_sent``), which is also what gives the reader its credit back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import numpy as np
import trio

from duplexrt.audio import AudioFormatError, AudioSpec, Encoder, make_decoder, make_encoder
from duplexrt.core.handoffs import HandoffKind, Handoffs
from duplexrt.core.metrics import FrameMetrics
from duplexrt.core.stage_meter import StageMeter
from duplexrt.protocols.base import Translator
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.session.credits import Credits
from duplexrt.session.lifecycle import Lifecycle
from duplexrt.session.outgoing import Outgoing
from duplexrt.wire.transport import DirectSend, Transport, TransportClosed

log = logging.getLogger("duplexrt.session")

#: One row of a step as the outbox holds it: audio, text piece, submitted and stepped (ns).
Output = tuple[np.ndarray, str | None, int, int]


class Writer:
    """Model output out to the client (see the module docstring), built with what it uses: the
    transport (and its direct send, if it has one and the session may use it), the translator,
    the credits, the outgoing queue, the lifecycle, the metrics (and the stage meter), and the
    worker threads for ``offload = "always"``."""

    def __init__(self, *, session_id: int, transport: Transport, direct: DirectSend | None, protocol: Translator,
                 encoder: Encoder, model_rate: int, credits: Credits, outgoing: Outgoing, lifecycle: Lifecycle,
                 metrics: FrameMetrics, meter: StageMeter | None, handoffs: Handoffs | None,
                 coalesce: bool) -> None:
        self._session_id = session_id
        self._transport = transport
        self._direct = direct
        self._protocol = protocol
        self.encoder = encoder
        self._model_rate = model_rate
        self._credits = credits
        self._outgoing = outgoing
        self._lifecycle = lifecycle
        self._metrics = metrics
        self._meter = meter
        #: The worker threads every batch is encoded on (``offload = "always"``), or None.
        self._handoffs = handoffs
        #: Filled by the step delivery (never more than the credits allow), drained whole by
        #: the writer.  A deque and a parking lot cost less per frame than a channel.
        self.outbox: deque[Output] = deque()
        self._outbox_done = False
        #: The writer is encoding a batch on a worker thread, with the encoder a format switch
        #: must not flush or replace under it.
        self._encoding = False
        self._encoded = trio.lowlevel.ParkingLot()
        #: A batch sent from a delivery whose end the transport still holds: the writer counts
        #: it as sent once it is out (``flush``).
        self._unflushed: list[Output] | None = None
        #: runtime.coalesce_output: the output of a client message's frames goes out together,
        #: as the message came; the delivery holds it until this many frames are delivered.
        self._coalesce = coalesce
        self._hold_until = 0
        #: Usage: text pieces sent, and when the last output went (perf_counter_ns).
        self.text_pieces = 0
        self.last_sent_ns = 0

    # -- what the delivery and the reader call -----------------------------------------------------

    def delivery_done(self) -> None:
        """Every row of this delivery is in the outbox (steps that finished while trio was busy
        come together, and go out together, as the writer would send them).  Sent from here when
        nothing stands in the way; otherwise the writer is woken to send them."""
        writer_lot = self._outgoing.writer_lot
        if not self.outbox or not writer_lot:
            return  # nothing new, or the writer is awake (or ending) and takes the outbox itself
        if self._credits.delivered < self._hold_until:
            return  # the rest of the client message's frames are a step or two behind: one answer
        if (self._direct is not None and not self._outgoing.pending and self._unflushed is None
                and not self._encoding):
            self._send_directly(self._direct)
        else:
            writer_lot.unpark_all()

    def hold_for(self, frames: int) -> None:
        """A client message made ``frames`` frames, every one of them submitted by now."""
        if self._coalesce and frames > 1:
            # Set once every frame is in, never before: a hold over frames not yet submitted
            # could keep the credits the reader waits for.
            self._hold_until = self._credits.submitted

    def close_outbox(self) -> None:
        """No more output will come: the writer ends once it has sent what it holds."""
        self._outbox_done = True
        writer_lot = self._outgoing.writer_lot
        if writer_lot:
            writer_lot.unpark_all()

    def clear(self) -> None:
        """Throw away the output not yet sent (ClearOutput); its credit comes back."""
        dropped = len(self.outbox)
        self.outbox.clear()
        self._credits.drop(dropped)

    async def reformat(self, spec: AudioSpec) -> None:
        """Everything the client gets from now on is in ``spec``: the old encoder's tail is handed
        to the translator first, and audio the translator holds back is re-encoded."""
        while self._encoding:  # a batch on a worker thread, encoded with the old encoder
            await self._encoded.park()
        old = self.encoder
        new = self.encoder = make_encoder(spec, self._model_rate)
        tail = old.flush()
        if tail:
            self._outgoing.queue(self._protocol.audio_out(tail, 0))
        self._protocol.recode_held(lambda payloads: self._recode(payloads, old.spec, new))

    def _recode(self, payloads: Sequence[bytes], old: AudioSpec, encoder: Encoder) -> list[bytes]:
        """Audio in ``old`` (the session's own output, so PCM or G.711 as the translators that
        hold audio speak) into ``encoder``'s format, as one stream.  Inline: rare, and bounded by
        what the translator may hold.  What cannot be decoded inline is dropped."""
        if old.is_encoded:
            return [b"" for _ in payloads]
        decoder = make_decoder(old, self._model_rate)
        try:
            out = [encoder.encode(decoder.decode(payload)) for payload in payloads]
            if out:
                out[-1] += encoder.encode(decoder.flush())
        except AudioFormatError:
            log.exception("session %s: held audio could not be re-encoded", self._session_id)
            return [b"" for _ in payloads]
        return out

    # -- the writer task ---------------------------------------------------------------------------

    async def run(self) -> None:
        outbox = self.outbox
        outgoing = self._outgoing
        metrics = self._metrics
        try:
            while True:
                if outgoing.pending:
                    await outgoing.send(self._transport)
                if self._unflushed is not None:  # sent from a delivery: wait until all of it is out
                    assert self._direct is not None  # only a direct send leaves a batch unflushed
                    await self._direct.flush()
                    items, self._unflushed = self._unflushed, None
                    self._batch_sent(items)
                if not outbox:
                    if self._outbox_done:
                        break
                    await outgoing.writer_lot.park()
                    metrics.writer_wakeups += 1
                    continue
                items, rows = self._next_batch()
                encoder = self.encoder  # a format switch replaces it between two batches
                if self._handoffs is not None:
                    self._encoding = True
                    try:
                        payload = await self._handoffs.offload(HandoffKind.CONVERT_OFFLOAD, encoder.encode_rows, rows)
                    finally:
                        self._encoding = False
                        if self._encoded:
                            self._encoded.unpark_all()
                else:
                    payload = encoder.encode_rows(rows)
                self._tell(items, payload)
                await outgoing.send(self._transport)
                self._batch_sent(items)
            tail = self.encoder.flush()
            if tail:
                outgoing.queue(self._protocol.audio_out(tail, 0))
            await outgoing.send(self._transport)
        except TransportClosed as closed:
            self._lifecycle.transport_closed(closed)

    def _send_directly(self, direct: DirectSend) -> None:
        """The writer's work for what a delivery brought, done in the delivery itself (trio
        thread, never raises): batch by batch, each sent without yielding.  A batch that does not
        go out whole (the client reads slowly, the socket is full) is left to the writer, which
        sends what is queued, waits for the transport's flush, and only then counts it sent; the
        rest of the outbox waits for it there."""
        outbox = self.outbox
        try:
            while outbox:
                items, rows = self._next_batch()
                self._tell(items, self.encoder.encode_rows(rows))
                if not self._outgoing.send_nowait(direct):
                    self._unflushed = items
                    self._outgoing.writer_lot.unpark_all()
                    return
                self._batch_sent(items)
                self._metrics.direct_batches += 1
        except TransportClosed as closed:
            self._lifecycle.transport_closed(closed)
        except Exception:
            log.exception("session %s failed", self._session_id)
            self._lifecycle.finish(FinishReason.ERROR, "internal error", CloseCode.INTERNAL_ERROR)

    def _next_batch(self) -> tuple[list[Output], list[np.ndarray]]:
        """The outbox's next batch and its rows of audio: all of it, but never across a turn's
        end (``next_boundary``), so that each response carries exactly its frames; the rest
        waits for the next batch."""
        outbox = self.outbox
        count = len(outbox)
        credits = self._credits
        answered = credits.told + credits.dropped
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
        outgoing = self._outgoing
        pending = outgoing.pending  # appended here without a call each: the writer sends them next
        count = len(items)
        # Text first: a protocol that closes a turn on its last audio (realtime) must not find
        # that turn's text arriving after it.
        for item in items:
            if item[1]:
                self.text_pieces += 1
                self._metrics.text_pieces += 1
                for message in protocol.text_out(item[1]):
                    pending.append(message)
                    outgoing.pending_bytes += len(message)
        # Even with no bytes (an encoder still filling a packet): the translator counts the
        # frames, and may close a turn on them.
        for message in protocol.audio_out(payload, count):
            pending.append(message)
            outgoing.pending_bytes += len(message)
        # Counted as the translator is told, so that what it reads stays in step with what it
        # has said, whatever arrives while the messages are being sent...
        self._credits.told += count

    def _batch_sent(self, items: list[Output]) -> None:
        """... and as sent only once they are: usage counts what the client got."""
        count = len(items)
        self._metrics.frames_out += count
        now = time.perf_counter_ns()
        if self._meter is not None:
            self._meter.batch_sent(items, now, self.last_sent_ns)
        self.last_sent_ns = now
        credits = self._credits  # the credit rule (credits.py), written out: once per batch
        credits.sent += count
        credits.in_flight -= count
        if credits.lot:
            credits.lot.unpark_all()
