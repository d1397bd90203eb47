"""One timer for many paced senders.

A paced sender sleeps until its next message is due, 12.5 times a second.  ``trio.sleep_until``
does that with a cancel scope of its own: entering it registers a deadline, and its expiry cancels
the sleeper, which unwinds a ``Cancelled`` exception through the scope.  With hundreds of
virtual sessions on one load generator that machinery cost more CPU than sending the message
(``benchmarks/server.py`` reports the load generator's CPU per frame beside the server's).

A ``Pacer`` keeps every waiting sender in one heap and one task sleeps for all of them: it wakes
when the earliest is due and reschedules every sender whose time has come, so a sender's wait
costs a park and a reschedule.  Where the transport can send without yielding (``send_nowait``),
``send_due`` goes further: the pacer's task sends each due message itself, and the sender's task
wakes only when a message cannot go at once (or all went).  With ``tick`` the pacer wakes at most once per tick (on a grid of
``tick`` seconds), so senders whose times fall in one tick share one wake-up; none is woken
before its time, and none later than one tick after it (plus whatever the event loop adds).
"""

from __future__ import annotations

import heapq
import itertools
import math

from collections.abc import Callable

import attrs
import outcome
import trio

__all__ = ["Pacer", "PacerStatistics"]


@attrs.frozen
class PacerStatistics:
    #: Times the pacer's task woke to release senders.
    wakes: int
    #: Senders woken (each wait that ended on time, not cancelled).
    released: int
    #: Messages the pacer's task sent itself (``send_due``).
    sent: int
    #: Senders waiting now.
    waiting: int


class _Job:
    """One sender's messages, sent by the pacer's task (``Pacer.send_due``)."""

    __slots__ = ("index", "count", "due", "send", "task", "entry")

    def __init__(self, index: int, count: int, due: Callable[[int], float], send: Callable[[int], bool],
                 task: trio.lowlevel.Task) -> None:
        self.index = index
        self.count = count
        self.due = due
        self.send = send
        self.task = task
        self.entry: list = []


async def _sleep_out(scope: trio.CancelScope) -> None:
    """Sleep until ``scope``, the innermost scope around the caller, is cancelled (its deadline
    came), and return then instead of raising.

    ``trio.sleep_forever`` in a scope with a deadline wakes by a ``Cancelled`` that unwinds
    through the scope: an exception made, raised and caught on every wake-up, a share of every
    wake-up's cost that buys nothing (the load generator's CPU per frame: ``benchmarks/server.py``).
    Here the abort answers its own scope's cancellation by rescheduling the task with no error, which
    ``wait_task_rescheduled`` allows ("ignore the cancellation ... reschedule and continue as
    normal"); a cancellation from further out, with ``scope`` not cancelled, aborts as usual
    and raises ``Cancelled``.  Should both come at once the task wakes quietly, and the outer
    cancellation is raised at its next wait, in a scope of its own that is not cancelled."""
    task = trio.lowlevel.current_task()

    def abort(raise_cancel: object) -> trio.lowlevel.Abort:
        if scope.cancel_called:
            trio.lowlevel.reschedule(task)
            return trio.lowlevel.Abort.FAILED
        return trio.lowlevel.Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)


class Pacer:
    """Wakes tasks waiting in ``wait_until`` when their time comes; ``run`` must be running (in
    a nursery that outlives the waiters) for any of them to wake."""

    def __init__(self, *, tick: float = 0.0) -> None:
        if tick < 0 or not math.isfinite(tick):
            raise ValueError(f"tick must be a finite number of seconds >= 0, got {tick!r}")
        self._tick = tick
        #: [when, sequence, task, job]; the task is None once woken or cancelled (left in the
        #: heap); the job is None for a plain wait.
        self._heap: list[list] = []
        self._sequence = itertools.count()
        self._sleep: trio.CancelScope | None = None
        self._wakes = 0
        self._released = 0
        self._sent = 0
        self._waiting = 0

    def statistics(self) -> PacerStatistics:
        return PacerStatistics(wakes=self._wakes, released=self._released, sent=self._sent,
                               waiting=self._waiting)

    def _wake_time(self, when: float) -> float:
        """When the pacer wakes for something due at ``when``: the next grid point (never before)."""
        tick = self._tick
        if not tick:
            return when
        at = math.ceil(when / tick) * tick
        return at if at >= when else when  # a rounding error must not wake it early for good

    async def wait_until(self, when: float) -> None:
        """Return once ``trio.current_time() >= when`` (and the pacer has ticked); a checkpoint,
        like ``trio.sleep_until``: it can be cancelled, and it yields even when already due."""
        if when <= trio.current_time():
            await trio.lowlevel.checkpoint()
            return
        entry = [when, next(self._sequence), trio.lowlevel.current_task(), None]
        self._schedule(entry)
        await trio.lowlevel.wait_task_rescheduled(self._withdraw(entry))

    async def send_due(self, first: int, count: int, due: Callable[[int], float],
                       send: Callable[[int], bool]) -> int:
        """Paced sending with no wake-up of the sender per message: the pacer's own task calls
        ``send(i)`` once message ``i`` is due (``due(i)``), for ``i`` = ``first``, ``first + 1``, ...
        as long as ``send`` answers True (sent without waiting).  Returns the index of the first
        message not sent: ``count`` once all went, else the one ``send`` answered False for,
        which the caller sends itself.  What ``send`` raises is raised here.  ``send`` must not
        yield (it runs in the pacer's task) and must take nothing when it answers False."""
        if first >= count:
            await trio.lowlevel.checkpoint()
            return count
        job = _Job(first, count, due, send, trio.lowlevel.current_task())
        self._push(due(first), job)
        # The job is pushed anew for each message: a cancel withdraws whichever entry it has then.
        return await trio.lowlevel.wait_task_rescheduled(lambda raise_cancel: self._withdraw(job.entry)(raise_cancel))

    def _withdraw(self, entry: list) -> Callable[[object], trio.lowlevel.Abort]:
        """The abort for a cancelled wait: its entry stays in the heap, marked as nobody's."""
        def abort(_raise_cancel: object) -> trio.lowlevel.Abort:
            entry[2] = None
            self._waiting -= 1
            return trio.lowlevel.Abort.SUCCEEDED
        return abort

    def _push(self, when: float, job: _Job) -> None:
        job.entry = [when, next(self._sequence), job.task, job]
        self._schedule(job.entry)

    def _schedule(self, entry: list) -> None:
        """Into the heap, and the pacer's next wake-up moved earlier if this one is due first."""
        when = entry[0]
        heapq.heappush(self._heap, entry)
        self._waiting += 1
        sleep = self._sleep
        if sleep is not None:
            at = self._wake_time(when)
            if at < sleep.deadline:
                sleep.deadline = at

    def _serve(self, job: _Job) -> None:
        """A sender's message is due: send it here, and schedule its next, or hand the sender
        back its turn (sent all, could not send without waiting, or failed)."""
        index = job.index
        try:
            sent = job.send(index)
        except BaseException as exc:  # the sender's to handle, never the pacer's
            trio.lowlevel.reschedule(job.task, outcome.Error(exc))
            return
        if not sent:
            trio.lowlevel.reschedule(job.task, outcome.Value(index))
            return
        self._sent += 1
        index += 1
        job.index = index
        if index >= job.count:
            trio.lowlevel.reschedule(job.task, outcome.Value(index))
        else:
            self._push(job.due(index), job)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The pacer's task: runs until cancelled."""
        heap = self._heap
        reschedule = trio.lowlevel.reschedule
        heappop = heapq.heappop
        task_status.started()
        while True:
            deadline = self._wake_time(heap[0][0]) if heap else math.inf
            with trio.CancelScope(deadline=deadline) as self._sleep:
                await _sleep_out(self._sleep)
            self._sleep = None
            self._wakes += 1
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                entry = heappop(heap)
                task = entry[2]
                if task is not None:
                    entry[2] = None
                    self._waiting -= 1
                    job = entry[3]
                    if job is None:
                        self._released += 1
                        reschedule(task)
                    else:
                        self._serve(job)
