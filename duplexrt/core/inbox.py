"""The one structure shared by the trio thread and the scheduler thread.

Sessions append frames to their slot's bounded queue from the trio thread; the scheduler thread
takes at most one frame per slot per step, in slot order.  Everything here happens under one lock
whose critical sections are a few list and deque operations: nothing slow, nothing that allocates
per frame beyond the queue entry itself.

The scheduler is only signalled when it is actually waiting and the change makes a difference to
it: when it sleeps with no work at all (a put, or a slot opening or closing, so that the model
resets a slot before that session's first frame rather than during it), or when it is gathering
and the change makes every expected slot ready.  A burst of puts into a busy scheduler costs no
signals.
"""

from __future__ import annotations

import bisect
import enum
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import cast

import attrs
import numpy as np

from duplexrt.backends.base import Persona, SlotSession
from duplexrt.core.slot_owner import SlotOwner


class _State(enum.Enum):
    IDLE = "idle"  # nothing to do: sleeping until a put or a stop
    GATHERING = "gathering"  # some frames waiting: sleeping until all expected slots are ready
    BUSY = "busy"  # stepping: needs no signal, it will look again


class ControlOp(enum.Enum):
    OPEN = "open"
    CLOSE = "close"
    #: The session's persona, for ``Backend.set_persona``: queued before the slot's first frame.
    PERSONA = "persona"


@attrs.frozen
class Control:
    """A slot's opening, persona or closing, applied by the scheduler thread before its next
    step, in the order the session queued them (and before any frame queued after them)."""

    op: ControlOp
    slot: int
    owner: SlotOwner
    #: OPEN: what the backend is told about the session; PERSONA: the persona (checked, immutable).
    payload: SlotSession | Persona | None = None


class PutTicket:
    """One put handed to a worker thread, so that the trio side can settle it if it stops waiting.

    A trio task that abandons a thread (cancelled while it waits for room) must still know
    whether its frame went in: the thread could land it at any moment after.  Both sides look at
    the ticket under the inbox's lock, so exactly one of them decides: the thread queues the frame
    (``queued``), or the trio side withdraws it first and the thread then never will.
    """

    __slots__ = ("queued", "withdrawn")

    def __init__(self) -> None:
        self.queued = False
        self.withdrawn = False


@attrs.define
class Batch:
    """What the scheduler takes for one step: one frame per ready slot, slots ascending."""

    controls: list[Control]
    rows: list[int]
    owners: list[SlotOwner]
    frames: list[np.ndarray]
    stamps: list[int]


class Inbox:
    """Bounded per-slot frame queues plus the control queue, with the scheduler's wake-up rule."""

    def __init__(self, slots: int, depth: int, count_wake: Callable[[], None]) -> None:
        self.depth = depth
        self._count_wake = count_wake
        self._lock = threading.Lock()
        # The scheduler's sleep: a lock kept held, that a signal releases (and the scheduler takes
        # back on waking).  One sleeper only, so this is all a condition variable would do, without
        # the new lock and the waiter list a ``threading.Condition`` builds in Python per wait.
        self._wakeup = threading.Lock()
        self._wakeup.acquire()
        self._sleeping = False
        self._has_space = threading.Condition(self._lock)
        self._queues: list[deque[tuple[np.ndarray, int]]] = [deque() for _ in range(slots)]
        self._owners: list[SlotOwner | None] = [None] * slots
        self._accepting = [False] * slots
        self._open_slots: list[int] = []  # ascending
        self._controls: list[Control] = []
        #: Open slots with at least one frame queued: a step visits these, not every open slot
        #: (at paced load a step finds a few frames among hundreds of sessions).
        self._ready: set[int] = set()
        self._starved = 0  # slots still sending input that have nothing queued
        self._state = _State.BUSY
        self._space_waiters = 0
        self._stopping = False

    # -- trio side ---------------------------------------------------------------------------

    def open(self, slot: int, owner: SlotOwner, payload: SlotSession) -> None:
        with self._lock:
            if self._owners[slot] is not None:
                raise RuntimeError(f"slot {slot} is already open")
            self._owners[slot] = owner
            self._accepting[slot] = True
            self._starved += 1
            bisect.insort(self._open_slots, slot)
            self._controls.append(Control(ControlOp.OPEN, slot, owner, payload))
            if self._state is _State.IDLE:
                self._signal()

    def set_persona(self, slot: int, owner: SlotOwner, persona: Persona) -> None:
        """Queue the slot's persona: applied before any frame put after this call (controls are
        taken with the frames and applied first).  An idle scheduler is woken to apply it at once,
        so its prompt can run before the caller's first frame comes."""
        with self._lock:
            if self._owners[slot] is not owner:
                raise LookupError(f"slot {slot} is not open for this session")
            self._controls.append(Control(ControlOp.PERSONA, slot, owner, persona))
            if self._state is _State.IDLE:
                self._signal()

    def end_input(self, slot: int, owner: SlotOwner) -> None:
        """The session will send nothing more: stop waiting for it when gathering."""
        with self._lock:
            if self._owners[slot] is not owner or not self._accepting[slot]:
                return
            self._accepting[slot] = False
            if not self._queues[slot]:
                self._starved -= 1
                self._wake_gatherer()

    def close(self, slot: int, owner: SlotOwner) -> int:
        """Free the slot and drop whatever it still had queued.  Returns the frames dropped."""
        with self._lock:
            if self._owners[slot] is not owner:
                return 0
            queue = self._queues[slot]
            dropped = len(queue)
            if dropped:
                self._ready.discard(slot)
                queue.clear()
            elif self._accepting[slot]:
                self._starved -= 1
            self._accepting[slot] = False
            self._owners[slot] = None
            self._open_slots.remove(slot)
            self._controls.append(Control(ControlOp.CLOSE, slot, owner))
            if self._space_waiters:
                self._has_space.notify_all()  # an abandoned blocked put learns its slot is gone
            if self._state is _State.IDLE:
                self._signal()
            else:
                self._wake_gatherer()
            return dropped

    def put_nowait(self, slot: int, owner: SlotOwner, frame: np.ndarray, stamp: int) -> bool:
        """Queue a frame if there is room.  False when the slot's queue is full."""
        with self._lock:
            if self._owners[slot] is not owner or not self._accepting[slot]:
                raise LookupError(f"slot {slot} is not open for this session")
            queue = self._queues[slot]
            if len(queue) >= self.depth:
                return False
            self._append(slot, queue, frame, stamp)
            return True

    # -- worker thread (a submit that found its queue full) ----------------------------------

    def put_blocking(self, slot: int, owner: SlotOwner, frame: np.ndarray, stamp: int,
                     ticket: PutTicket | None = None) -> bool:
        """Wait for room, then queue.  False if the slot was closed, the inbox stopped or the
        ``ticket`` was withdrawn first."""
        with self._lock:
            queue = self._queues[slot]
            while True:
                if (self._stopping or self._owners[slot] is not owner or not self._accepting[slot]
                        or (ticket is not None and ticket.withdrawn)):
                    return False
                if len(queue) < self.depth:
                    self._append(slot, queue, frame, stamp)
                    if ticket is not None:
                        ticket.queued = True
                    return True
                self._space_waiters += 1
                try:
                    self._has_space.wait()
                finally:
                    self._space_waiters -= 1

    def withdraw(self, ticket: PutTicket) -> bool:
        """Called by a trio task that stopped waiting for its put: True if the frame was already
        queued; otherwise it never will be, and its thread returns as soon as it looks again."""
        with self._lock:
            if ticket.queued:
                return True
            ticket.withdrawn = True
            if self._space_waiters:
                self._has_space.notify_all()
            return False

    def _append(self, slot: int, queue: deque[tuple[np.ndarray, int]], frame: np.ndarray, stamp: int) -> None:
        # Lock held.  The wake rule lives here, so every kind of put obeys it.
        queue.append((frame, stamp))
        if len(queue) == 1:
            self._ready.add(slot)
            self._starved -= 1
            if self._state is _State.IDLE or (self._state is _State.GATHERING and self._starved == 0):
                self._signal()

    def _wake_gatherer(self) -> None:
        if self._state is _State.GATHERING and self._starved == 0:
            self._signal()

    def _signal(self) -> None:
        self._state = _State.BUSY  # signalled once: later puts need not signal again
        self._count_wake()
        self._rouse()

    def _rouse(self) -> None:
        # Lock held.  Released once per sleep: ``_sleeping`` is cleared with it.
        if self._sleeping:
            self._sleeping = False
            self._wakeup.release()

    def _sleep(self, timeout: float | None) -> None:
        """Lock held: let it go and sleep until roused or ``timeout`` seconds pass; returns with
        the lock held again and ``_wakeup`` held, as before."""
        self._sleeping = True
        self._lock.release()
        try:
            roused = self._wakeup.acquire() if timeout is None else self._wakeup.acquire(timeout=timeout)
        finally:
            self._lock.acquire()
        if not roused:
            if self._sleeping:
                self._sleeping = False  # nobody came
            else:
                self._wakeup.acquire()  # roused between the timeout and the lock: take it back

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._rouse()
            self._has_space.notify_all()

    # -- scheduler thread --------------------------------------------------------------------

    def queued_batch(self) -> Batch | None:
        """The frames waiting now (with any controls before them), without waiting: None when
        no frame is waiting, or once stopped."""
        with self._lock:
            if self._stopping or not self._ready:
                return None
            return self._take()

    def next_batch(self, gather_window: float, *, gather_queued: bool = True,
                   gather_until: float | None = None) -> Batch | None:
        """Block until there is a step to run (or controls to apply); None once stopped.

        With ``gather_queued=False``, frames already waiting when it is called are taken at once,
        without waiting for the slots that have none: they queued while the model was stepping
        and have waited that long already.  After an idle wait it gathers as usual.

        ``gather_until`` (``time.monotonic()``) gathers until then, whether or not a frame is
        waiting yet: the scheduler's next cycle after cheap steps, so that frames that keep coming
        are taken once a window, with no signal for any of them; if none came by then, it waits
        idle."""
        with self._lock:
            deadline: float | None = gather_until
            if not gather_queued and self._ready:
                gather_window = 0.0
            while True:
                if self._stopping:
                    return None
                if self._ready and (self._starved <= 0 or gather_window <= 0):
                    break
                if self._ready or deadline is not None:
                    now = time.monotonic()
                    if deadline is None:
                        deadline = now + gather_window
                    elif now >= deadline:
                        if self._ready:
                            break
                        deadline = None  # the window passed with nothing: wait idle
                        continue
                    self._state = _State.GATHERING
                    self._sleep(deadline - now)
                elif self._controls:
                    break  # apply opens, personas and closes now, while there is nothing else to do
                else:
                    self._state = _State.IDLE
                    self._sleep(None)
            return self._take()

    def _take(self) -> Batch:
        # Lock held: the controls so far, and one frame of every slot that has one.
        self._state = _State.BUSY
        controls, self._controls = self._controls, []
        rows = sorted(self._ready)
        # A ready slot always has its owner (set when it opens, cleared with its queue when it
        # closes): the cast drops the None that only a free slot holds.
        owners = cast("list[SlotOwner]", [self._owners[slot] for slot in rows])
        frames: list[np.ndarray] = []
        stamps: list[int] = []
        queues = self._queues
        ready = self._ready
        accepting = self._accepting
        for slot in rows:
            queue = queues[slot]
            frame, stamp = queue.popleft()
            frames.append(frame)
            stamps.append(stamp)
            if not queue:
                ready.discard(slot)
                if accepting[slot]:
                    self._starved += 1
        if self._space_waiters and rows:
            self._has_space.notify_all()
        return Batch(controls, rows, owners, frames, stamps)

    # -- inspection ----------------------------------------------------------------------------

    def queued(self, slot: int) -> int:
        with self._lock:
            return len(self._queues[slot])

    def total_queued(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queues)

    def open_count(self) -> int:
        with self._lock:
            return len(self._open_slots)

