"""The thread-shared Inbox: bounded queues, batch order, controls, wake rules, blocking puts."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from duplexrt.core.inbox import Batch, ControlOp, Inbox, _State

JOIN_TIMEOUT = 5.0
#: A gather window long enough that a test finishing before it proves a wake, not a timeout.
LONG_WINDOW = 60.0


class WakeCounter:
    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


class Owner:
    """A stand-in session: compared by identity, as the inbox does."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Owner({self.name})"


class InThread:
    """Runs ``fn`` on a daemon thread and keeps its result."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.result: Any = None
        self.error: BaseException | None = None
        self.done = threading.Event()

        def main() -> None:
            try:
                self.result = fn()
            except BaseException as exc:  # noqa: BLE001 - reported by join()
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=main, daemon=True)
        self.thread.start()

    def join(self) -> Any:
        self.thread.join(timeout=JOIN_TIMEOUT)
        assert not self.thread.is_alive(), "the thread did not finish"
        if self.error is not None:
            raise self.error
        return self.result


@pytest.fixture
def wakes() -> WakeCounter:
    return WakeCounter()


@pytest.fixture
def make_inbox(wakes):
    """Inboxes built here are stopped at the end, so a failed test leaves no thread waiting."""
    made: list[Inbox] = []

    def make(slots: int = 8, depth: int = 4) -> Inbox:
        inbox = Inbox(slots, depth, wakes)
        made.append(inbox)
        return inbox

    yield make
    for inbox in made:
        inbox.stop()


def wait_for_state(inbox: Inbox, state: _State) -> None:
    """Poll until the scheduler thread has settled in ``state`` (it sets it under the lock, just
    before waiting, so once seen, the next locked call runs while the thread waits)."""
    deadline = time.monotonic() + JOIN_TIMEOUT
    while inbox._state is not state:
        assert time.monotonic() < deadline, f"inbox never reached {state}, is {inbox._state}"
        time.sleep(0.0002)  # lets go of the GIL: a pure spin starves the thread it waits for


def wait_until(predicate: Callable[[], bool]) -> None:
    deadline = time.monotonic() + JOIN_TIMEOUT
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        time.sleep(0.0002)


def open_slots(inbox: Inbox, slots) -> dict[int, Owner]:
    """Open ``slots`` and let the scheduler take the OPEN controls, as it would before stepping."""
    owners = {}
    for slot in slots:
        owners[slot] = Owner(f"s{slot}")
        inbox.open(slot, owners[slot], payload=f"session-{slot}")
    batch = inbox.next_batch(0)
    assert [c.slot for c in batch.controls] == list(slots) and batch.rows == []
    return owners


def frames_by_slot(batch: Batch) -> dict[int, Any]:
    return dict(zip(batch.rows, batch.frames))


# -- capacity --------------------------------------------------------------------------------------


def test_put_nowait_refuses_once_slot_holds_depth_frames(make_inbox):
    inbox = make_inbox(depth=3)
    owners = open_slots(inbox, [0, 1])
    assert [inbox.put_nowait(0, owners[0], f"f{i}", i) for i in range(3)] == [True, True, True]
    assert inbox.put_nowait(0, owners[0], "f3", 3) is False
    assert inbox.queued(0) == 3
    # A full slot does not block its neighbour.
    assert inbox.put_nowait(1, owners[1], "g0", 0) is True
    assert inbox.total_queued() == 4


def test_put_nowait_accepts_again_once_a_frame_is_taken(make_inbox):
    inbox = make_inbox(depth=2)
    owners = open_slots(inbox, [0])
    assert inbox.put_nowait(0, owners[0], "a", 0)
    assert inbox.put_nowait(0, owners[0], "b", 1)
    assert not inbox.put_nowait(0, owners[0], "c", 2)
    assert inbox.next_batch(0).frames == ["a"]
    assert inbox.put_nowait(0, owners[0], "c", 2)
    assert not inbox.put_nowait(0, owners[0], "d", 3)


def test_put_nowait_into_a_slot_not_open_for_the_caller_raises(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    with pytest.raises(LookupError, match="slot 1 is not open for this session"):
        inbox.put_nowait(1, owners[0], "x", 0)  # never opened
    with pytest.raises(LookupError):
        inbox.put_nowait(0, Owner("stranger"), "x", 0)  # someone else's slot
    inbox.end_input(0, owners[0])
    with pytest.raises(LookupError):
        inbox.put_nowait(0, owners[0], "x", 0)  # input ended


def test_opening_an_open_slot_raises(make_inbox):
    inbox = make_inbox()
    inbox.open(2, Owner("a"), None)
    with pytest.raises(RuntimeError, match="slot 2 is already open"):
        inbox.open(2, Owner("b"), None)
    assert inbox.open_count() == 1


def test_end_input_from_anyone_but_the_slots_owner_changes_nothing(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    inbox.end_input(0, Owner("stranger"))
    assert inbox.put_nowait(0, owners[0], "x", 0)  # still taking the owner's input
    assert inbox.queued(0) == 1


# -- batches and controls ------------------------------------------------------------------------------


def test_next_batch_takes_one_frame_per_ready_slot_in_ascending_order(make_inbox):
    inbox = make_inbox(slots=8)
    owners = {5: Owner("five"), 2: Owner("two"), 7: Owner("seven"), 4: Owner("four")}
    for slot, owner in owners.items():
        inbox.open(slot, owner, payload=slot * 10)
    for slot in (7, 2, 5):
        for i in range(2):
            assert inbox.put_nowait(slot, owners[slot], (slot, i), 100 * slot + i)
    batch = inbox.next_batch(0)
    assert [(c.op, c.slot, c.owner, c.payload) for c in batch.controls] == [
        (ControlOp.OPEN, slot, owner, slot * 10) for slot, owner in owners.items()
    ]
    assert batch.rows == [2, 5, 7]  # slot 4 is open but has nothing queued
    assert batch.owners == [owners[2], owners[5], owners[7]]
    assert batch.frames == [(2, 0), (5, 0), (7, 0)]
    assert batch.stamps == [200, 500, 700]
    second = inbox.next_batch(0)
    assert second.controls == []
    assert second.rows == [2, 5, 7]
    assert second.frames == [(2, 1), (5, 1), (7, 1)]


def test_controls_come_in_the_order_they_were_made(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1, 2])
    newcomer = Owner("newcomer")
    inbox.close(1, owners[1])
    inbox.open(1, newcomer, payload="again")
    inbox.close(0, owners[0])
    batch = inbox.next_batch(0)
    assert [(c.op, c.slot, c.owner) for c in batch.controls] == [
        (ControlOp.CLOSE, 1, owners[1]),
        (ControlOp.OPEN, 1, newcomer),
        (ControlOp.CLOSE, 0, owners[0]),
    ]
    assert batch.controls[1].payload == "again"
    assert batch.rows == []
    assert inbox.open_count() == 2


def test_controls_are_delivered_with_the_frames_that_follow_them(make_inbox):
    inbox = make_inbox()
    owner = Owner("a")
    inbox.open(3, owner, payload="hello")
    inbox.put_nowait(3, owner, "first", 1)
    batch = inbox.next_batch(0)
    assert [(c.op, c.slot) for c in batch.controls] == [(ControlOp.OPEN, 3)]
    assert batch.rows == [3] and batch.frames == ["first"]
    assert inbox.total_queued() == 0


def test_frames_of_one_slot_come_out_fifo_across_batches(make_inbox):
    inbox = make_inbox(depth=5)
    owners = open_slots(inbox, [1, 6])
    for i in range(5):
        inbox.put_nowait(1, owners[1], f"a{i}", i)
    for i in range(2):
        inbox.put_nowait(6, owners[6], f"b{i}", i)
    seen: dict[int, list[str]] = {1: [], 6: []}
    for _ in range(5):
        batch = inbox.next_batch(0)
        for slot, frame in frames_by_slot(batch).items():
            seen[slot].append(frame)
    assert seen == {1: [f"a{i}" for i in range(5)], 6: ["b0", "b1"]}
    assert inbox.total_queued() == 0


# -- wake rules --------------------------------------------------------------------------------------


def test_puts_with_no_waiting_scheduler_do_not_signal(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    for i in range(3):
        inbox.put_nowait(0, owners[0], i, i)
        inbox.put_nowait(1, owners[1], i, i)
    assert wakes.count == 0


def test_put_into_idle_scheduler_wakes_it_exactly_once(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    assert wakes.count == 0
    inbox.put_nowait(0, owners[0], "first", 1)
    assert wakes.count == 1
    # The scheduler is no longer idle: puts before it even runs again cost no signal.
    inbox.put_nowait(1, owners[1], "second", 2)
    inbox.put_nowait(0, owners[0], "third", 3)
    assert wakes.count == 1
    batch = waiter.join()
    assert batch.rows[0] == 0 and batch.frames[0] == "first"
    taken = len(batch.rows)
    assert taken + inbox.total_queued() == 3


def test_puts_into_a_busy_scheduler_do_not_signal(make_inbox, wakes):
    inbox = make_inbox(depth=8)
    owners = open_slots(inbox, [0, 1])
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    inbox.put_nowait(0, owners[0], "wake", 0)
    waiter.join()
    # The scheduler is now stepping (not in next_batch): a burst of puts costs nothing.
    for i in range(6):
        inbox.put_nowait(i % 2, owners[i % 2], i, i)
    assert wakes.count == 1


def test_gather_is_completed_by_the_put_that_readies_every_open_sending_slot(make_inbox, wakes):
    inbox = make_inbox(depth=4)
    owners = open_slots(inbox, [0, 1, 2, 3])
    inbox.end_input(3, owners[3])  # slot 3 sends nothing more: not waited for
    inbox.put_nowait(0, owners[0], "a", 0)
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.GATHERING)
    inbox.put_nowait(1, owners[1], "b", 1)
    inbox.put_nowait(0, owners[0], "a2", 2)  # a slot that was already ready
    assert wakes.count == 0
    assert inbox._state is _State.GATHERING
    inbox.put_nowait(2, owners[2], "c", 3)
    assert wakes.count == 1
    batch = waiter.join()
    assert batch.rows == [0, 1, 2]
    assert batch.frames == ["a", "b", "c"]


def test_gather_waits_again_for_a_slot_drained_by_the_previous_batch(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a0", 0)
    inbox.put_nowait(1, owners[1], "b0", 0)
    assert inbox.next_batch(LONG_WINDOW).rows == [0, 1]  # both ready: no waiting
    inbox.put_nowait(0, owners[0], "a1", 1)
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.GATHERING)  # slot 1 is empty again and still sending
    inbox.put_nowait(1, owners[1], "b1", 1)
    assert wakes.count == 1
    assert waiter.join().frames == ["a1", "b1"]


def test_end_input_of_the_last_missing_slot_completes_the_gather(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a", 0)
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.GATHERING)
    inbox.end_input(1, owners[1])
    assert wakes.count == 1
    batch = waiter.join()
    assert batch.rows == [0] and batch.frames == ["a"]


def test_close_of_the_last_missing_slot_completes_the_gather(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a", 0)
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.GATHERING)
    assert inbox.close(1, owners[1]) == 0
    assert wakes.count == 1
    batch = waiter.join()
    assert batch.rows == [0]
    assert [(c.op, c.slot) for c in batch.controls] == [(ControlOp.CLOSE, 1)]


def test_end_input_of_a_slot_with_queued_frames_stops_waiting_for_it_once_drained(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a0", 0)
    inbox.put_nowait(1, owners[1], "last", 0)
    inbox.end_input(1, owners[1])
    assert inbox.next_batch(LONG_WINDOW).frames == ["a0", "last"]  # queued frames still go out
    inbox.put_nowait(0, owners[0], "a1", 1)
    # Slot 1 is drained and sends nothing more, so slot 0 alone completes the gather at once.
    batch = InThread(lambda: inbox.next_batch(LONG_WINDOW)).join()
    assert batch.rows == [0] and batch.frames == ["a1"]


def test_gather_window_elapsing_gives_a_partial_batch(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a", 0)
    batch = InThread(lambda: inbox.next_batch(0.001)).join()
    assert batch.rows == [0]
    assert wakes.count == 0


def test_frames_queued_before_the_call_are_taken_at_once_when_not_gathering_queued(make_inbox, wakes):
    # What the scheduler asks for after a step that cost more than the window: the frames that
    # queued during it go now, the slots still empty are not waited for.
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1, 2])
    inbox.put_nowait(0, owners[0], "a", 0)
    inbox.put_nowait(2, owners[2], "c", 0)
    batch = InThread(lambda: inbox.next_batch(LONG_WINDOW, gather_queued=False)).join()
    assert batch.rows == [0, 2] and batch.frames == ["a", "c"]
    assert wakes.count == 0


def test_not_gathering_queued_frames_still_gathers_after_an_idle_wait(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW, gather_queued=False))
    wait_for_state(inbox, _State.IDLE)
    inbox.put_nowait(0, owners[0], "a", 0)
    wait_for_state(inbox, _State.GATHERING)  # nothing was queued on the call: gathers as usual
    inbox.put_nowait(1, owners[1], "b", 1)
    batch = waiter.join()
    assert batch.rows == [0, 1] and batch.frames == ["a", "b"]
    assert wakes.count == 2


def test_zero_gather_window_takes_a_batch_as_soon_as_any_frame_is_ready(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1, 2])
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    inbox.put_nowait(1, owners[1], "only", 0)
    batch = waiter.join()
    assert batch.rows == [1] and batch.frames == ["only"]
    assert wakes.count == 1
    # And without waiting at all when a frame is already there.
    inbox.put_nowait(2, owners[2], "next", 1)
    assert inbox.next_batch(0).rows == [2]


# -- blocking puts -------------------------------------------------------------------------------------


def test_put_blocking_waits_while_full_and_completes_once_a_frame_is_taken(make_inbox):
    inbox = make_inbox(depth=1)
    owners = open_slots(inbox, [0])
    assert inbox.put_nowait(0, owners[0], "first", 0)
    putter = InThread(lambda: inbox.put_blocking(0, owners[0], "second", 1))
    wait_until(lambda: inbox._space_waiters == 1)
    assert not putter.done.is_set()
    assert inbox.queued(0) == 1
    assert inbox.next_batch(0).frames == ["first"]
    assert putter.join() is True
    assert inbox.next_batch(0).frames == ["second"]


def test_put_blocking_with_room_queues_at_once(make_inbox):
    inbox = make_inbox(depth=2)
    owners = open_slots(inbox, [4])
    assert inbox.put_blocking(4, owners[4], "x", 9) is True
    batch = inbox.next_batch(0)
    assert batch.rows == [4] and batch.frames == ["x"] and batch.stamps == [9]


def test_put_blocking_into_idle_scheduler_wakes_it(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    assert inbox.put_blocking(0, owners[0], "x", 0) is True
    assert wakes.count == 1
    assert waiter.join().frames == ["x"]


def test_put_blocking_returns_false_when_its_slot_is_closed_while_waiting(make_inbox):
    inbox = make_inbox(depth=1)
    owners = open_slots(inbox, [0])
    inbox.put_nowait(0, owners[0], "first", 0)
    putter = InThread(lambda: inbox.put_blocking(0, owners[0], "second", 1))
    wait_until(lambda: inbox._space_waiters == 1)
    assert inbox.close(0, owners[0]) == 1
    assert putter.join() is False
    assert inbox.total_queued() == 0


def test_put_blocking_returns_false_for_a_closed_slot(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    inbox.close(0, owners[0])
    assert inbox.put_blocking(0, owners[0], "late", 0) is False
    # Even when the slot has been given to someone else since.
    inbox.open(0, Owner("next"), None)
    assert inbox.put_blocking(0, owners[0], "late", 0) is False
    assert inbox.queued(0) == 0


def test_put_blocking_returns_false_when_stopped_while_waiting(make_inbox):
    inbox = make_inbox(depth=1)
    owners = open_slots(inbox, [0])
    inbox.put_nowait(0, owners[0], "first", 0)
    putter = InThread(lambda: inbox.put_blocking(0, owners[0], "second", 1))
    wait_until(lambda: inbox._space_waiters == 1)
    inbox.stop()
    assert putter.join() is False


def test_put_blocking_returns_false_after_stop(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    inbox.stop()
    assert inbox.put_blocking(0, owners[0], "x", 0) is False
    assert inbox.queued(0) == 0


# -- close and stop ------------------------------------------------------------------------------------


def test_close_drops_queued_frames_and_returns_how_many(make_inbox):
    inbox = make_inbox(depth=4)
    owners = open_slots(inbox, [0, 1])
    for i in range(3):
        inbox.put_nowait(0, owners[0], f"a{i}", i)
    inbox.put_nowait(1, owners[1], "b0", 0)
    assert inbox.close(0, owners[0]) == 3
    assert inbox.queued(0) == 0
    assert inbox.open_count() == 1
    batch = inbox.next_batch(0)
    assert batch.rows == [1] and batch.frames == ["b0"]
    assert [(c.op, c.slot) for c in batch.controls] == [(ControlOp.CLOSE, 0)]


def test_close_by_another_owner_does_nothing(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    inbox.put_nowait(0, owners[0], "a", 0)
    assert inbox.close(0, Owner("stranger")) == 0
    assert inbox.queued(0) == 1
    assert inbox.open_count() == 1
    batch = inbox.next_batch(0)
    assert batch.controls == [] and batch.frames == ["a"]


def test_close_of_the_only_ready_slot_leaves_no_phantom_work(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a", 0)
    inbox.close(0, owners[0])
    assert [(c.op, c.slot) for c in inbox.next_batch(0).controls] == [(ControlOp.CLOSE, 0)]
    # Nothing is queued any more: the scheduler goes idle, and slot 1's put wakes it.
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    inbox.put_nowait(1, owners[1], "b", 0)
    assert waiter.join().rows == [1]
    assert wakes.count == 1


def test_reopened_slot_starts_with_an_empty_queue(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [2])
    inbox.put_nowait(2, owners[2], "old", 0)
    inbox.close(2, owners[2])
    newcomer = Owner("new")
    inbox.open(2, newcomer, None)
    inbox.put_nowait(2, newcomer, "new", 1)
    batch = inbox.next_batch(0)
    assert batch.frames == ["new"] and batch.owners == [newcomer]


def test_stop_makes_an_idle_next_batch_return_none(make_inbox):
    inbox = make_inbox()
    open_slots(inbox, [0])
    waiter = InThread(lambda: inbox.next_batch(0))
    wait_for_state(inbox, _State.IDLE)
    inbox.stop()
    assert waiter.join() is None


def test_stop_makes_a_gathering_next_batch_return_none(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0, 1])
    inbox.put_nowait(0, owners[0], "a", 0)
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.GATHERING)
    inbox.stop()
    assert waiter.join() is None


def test_next_batch_after_stop_returns_none_even_with_frames_queued(make_inbox):
    inbox = make_inbox()
    owners = open_slots(inbox, [0])
    inbox.put_nowait(0, owners[0], "a", 0)
    inbox.stop()
    assert inbox.next_batch(0) is None


def test_opening_a_slot_wakes_an_idle_scheduler_to_apply_it_before_any_frame(make_inbox, wakes):
    inbox = make_inbox()
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.IDLE)
    owner = Owner("new")
    inbox.open(3, owner, payload="session-3")
    batch = waiter.join()
    assert wakes.count == 1
    assert [(c.op, c.slot, c.owner) for c in batch.controls] == [(ControlOp.OPEN, 3, owner)]
    assert batch.rows == []


def test_closing_a_slot_wakes_an_idle_scheduler_to_apply_it(make_inbox, wakes):
    inbox = make_inbox()
    owners = open_slots(inbox, [1])
    waiter = InThread(lambda: inbox.next_batch(LONG_WINDOW))
    wait_for_state(inbox, _State.IDLE)
    inbox.close(1, owners[1])
    batch = waiter.join()
    assert wakes.count == 1
    assert [(c.op, c.slot) for c in batch.controls] == [(ControlOp.CLOSE, 1)]
