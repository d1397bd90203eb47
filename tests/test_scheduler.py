"""The scheduler thread: its life, slot leases, failures, backpressure and thread-crossing counts.

Real scheduler thread, real inbox, real synthetic model; ``ControlledBackend`` (conftest) adds a
stall gate and injected failures to the synthetic model where a test needs them.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import trio
import trio.testing

from conftest import (
    FRAME,
    PATIENCE,
    ControlledBackend,
    RecordingOwner,
    SessionRun,
    backend_info,
    cut_points,
    frame_of,
    make_config,
    model_frames,
    noise,
    run_session,
    scheduler_threads,
    spec,
    synthetic_out,
    synthetic_wire,
    wait_until,
    wire_messages,
)
from duplexrt.backends.echo import EchoBackend
from duplexrt.core.handoffs import HandoffKind
from duplexrt.core.inbox import _State
from duplexrt.runtime import open_runtime
from duplexrt.core.scheduler import CHEAP_STEP_CYCLE_MS, BackendStepError, NoFreeSlotError, SlotClosedError


class FailingLoadBackend(EchoBackend):
    """FAKE: a model whose weights cannot be loaded."""

    def load(self) -> None:
        raise OSError("model weights not found at /nowhere")


def _group_leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _group_leaves(inner)]
    return [exc]


# -- life of the thread ----------------------------------------------------------------------------


async def test_exactly_one_scheduler_thread_while_running_and_none_after():
    assert scheduler_threads() == []
    config = make_config("runtime.slots=4")
    async with open_runtime(config, backend=None) as runtime:
        threads = scheduler_threads()
        assert len(threads) == 1
        assert threads[0].is_alive()
        assert runtime.scheduler.ready
        # and it really is the thread that serves: a session works.
        wire = spec("pcm_f32le")
        messages = wire_messages(noise(3 * FRAME, seed=1), wire, [FRAME * 3])
        run = await run_session(runtime, messages, wire, session_id=1)
        assert run.end.reason == "stop" and run.end.frames_out == 3
        assert len(scheduler_threads()) == 1
    assert scheduler_threads() == []
    assert not threads[0].is_alive()
    assert not runtime.scheduler.ready


async def test_backend_load_failure_leaves_no_thread_and_names_the_backend():
    config = make_config("runtime.slots=2")
    with pytest.raises(BaseException) as info:  # noqa: PT011 - the exact shape is checked below
        async with open_runtime(config, backend=FailingLoadBackend(backend_info(config, "echo"), {})):
            pytest.fail("open_runtime must not start a runtime whose backend failed to load")
    leaves = _group_leaves(info.value)
    assert len(leaves) == 1, leaves
    error = leaves[0]
    assert isinstance(error, RuntimeError)
    assert "'echo'" in str(error) and "failed to load" in str(error)
    assert isinstance(error.__cause__, OSError)
    assert "model weights not found" in str(error.__cause__)
    assert scheduler_threads() == []


async def test_backend_load_failure_raises_a_plain_runtime_error():
    # A caller (the CLI, a server's start-up code) should be able to write
    # `except RuntimeError` around open_runtime; an exception group nested twice is not "a clear
    # RuntimeError".
    config = make_config("runtime.slots=2")
    with pytest.raises(RuntimeError, match=r"backend 'echo' failed to load"):
        async with open_runtime(config, backend=FailingLoadBackend(backend_info(config, "echo"), {})):
            pytest.fail("open_runtime must not start a runtime whose backend failed to load")
    assert scheduler_threads() == []


# -- slots -------------------------------------------------------------------------------------------


async def test_no_free_slot_until_one_is_released():
    config = make_config("runtime.slots=3", "backend.name=synthetic")
    async with open_runtime(config) as runtime:
        scheduler = runtime.scheduler
        owners = [RecordingOwner() for _ in range(3)]
        leases = [scheduler.open_slot(owner) for owner in owners]
        assert [lease.slot for lease in leases] == [0, 1, 2]
        assert scheduler.free_slots == 0
        with pytest.raises(NoFreeSlotError):
            scheduler.open_slot(RecordingOwner())
        assert scheduler.free_slots == 0

        assert leases[1].release() == 0
        assert leases[1].release() == 0  # idempotent: the slot is not freed twice
        assert scheduler.free_slots == 1
        with pytest.raises(SlotClosedError):
            leases[1].submit_nowait(frame_of(0.1))

        newcomer = RecordingOwner()
        lease = scheduler.open_slot(newcomer)
        assert lease.slot == 1
        with pytest.raises(NoFreeSlotError):
            scheduler.open_slot(RecordingOwner())

        # The reused slot serves its new owner (fresh synthetic state: frame index 0).
        frame = frame_of(0.25)
        await lease.submit(frame)
        await newcomer.wait_for(outputs=1)
        np.testing.assert_array_equal(newcomer.outputs[0], synthetic_out(frame, lease.session_id, 0))
        assert owners[1].outputs == []
        for held in (leases[0], leases[2], lease):
            held.release()
        assert scheduler.free_slots == 3


# -- gathering ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("step_ms", "gathers"), [(0.5, True), (5, False)])
async def test_frames_queued_during_a_step_dearer_than_the_gather_window_are_not_held_for_it(step_ms, gathers):
    # The synthetic model's configured cost seeds the capacity estimate, so whether a step costs
    # more than the 2 ms window is known before any step runs: no timing in the test.
    config = make_config("runtime.slots=2", "backend.name=synthetic", f"backend.options.step_ms={step_ms}")
    wire = spec("pcm_f32le")
    async with open_runtime(config, backend=None) as runtime:
        scheduler = runtime.scheduler
        assert scheduler.gathers_after(1) is gathers
        assert not scheduler.drains_after(1)  # each step goes through next_batch, as spied below
        inbox = scheduler.inbox
        real_next_batch = inbox.next_batch
        #: Each call the thread made: whether it asked to gather queued frames, and how many rows
        #: the batch it got had.  Only a call that follows a step is decided by the step's cost
        #: (a batch of controls alone, such as the slot opening, leaves the flag as it was).
        calls: list[list] = []

        def next_batch(window: float, *, gather_queued: bool = True, **rest):
            calls.append([gather_queued, 0])  # at the call: the last one may still be waiting
            batch = real_next_batch(window, gather_queued=gather_queued, **rest)
            calls[-1][1] = len(batch.rows) if batch is not None else 0
            return batch

        inbox.next_batch = next_batch  # the thread looks it up on every call
        # One message of three frames: they queue together, so steps two and three find their
        # frame already waiting.
        messages = wire_messages(noise(3 * FRAME, seed=2), wire, [FRAME * 3])
        run = await run_session(runtime, messages, wire, session_id=1)
        assert run.end.reason == "stop" and run.end.frames_out == 3
    after_a_step = [asked for (asked, _), (_, rows) in zip(calls[1:], calls) if rows]
    assert len(after_a_step) >= 2  # the thread went through the spy after its steps
    assert all(a is gathers for a in after_a_step)


async def test_frames_queued_behind_a_cheap_step_are_stepped_in_the_same_wake_up_and_cross_in_one_delivery():
    """A client's message of three frames: three steps, in order, one frame each, and one crossing
    into trio for all three (the wake-up and the crossing are most of what a cheap step costs)."""
    config = make_config("runtime.slots=2", "backend.name=synthetic", "runtime.gather_window_ms=1000")
    async with open_runtime(config) as runtime:
        scheduler = runtime.scheduler
        sender, quiet = RecordingOwner(), RecordingOwner()
        lease, quiet_lease = scheduler.open_slot(sender), scheduler.open_slot(quiet)
        await trio.testing.wait_all_tasks_blocked()  # the slots are open on the thread
        assert scheduler.gathers_after(1) and scheduler.drains_after(1)
        deliveries = runtime.handoffs.statistics()[HandoffKind.OUTPUT_DELIVERY]
        frames = [frame_of(0.1 * k) for k in (1, 2, 3)]
        for frame in frames:  # queued while the scheduler gathers for the quiet slot
            assert lease.submit_nowait(frame)
        quiet_lease.end_input()  # nothing more to gather for: it steps now
        await sender.wait_for(outputs=3)
        assert runtime.handoffs.statistics()[HandoffKind.OUTPUT_DELIVERY] == deliveries + 1
        assert scheduler.statistics().steps == 3
        for k, (output, frame) in enumerate(zip(sender.outputs, frames, strict=True)):
            np.testing.assert_array_equal(output, synthetic_out(frame, lease.session_id, k))
        lease.release()
        quiet_lease.release()


async def test_after_a_cheap_cycle_the_next_one_gathers_until_a_cycle_period_after_it_began():
    """``CHEAP_STEP_CYCLE_MS`` bounds how long a frame waits between cycles of cheap steps,
    whatever the gather window (here 30 ms): the call after a cycle gathers until that long after
    the cycle began, frame or no frame yet."""
    expected_s = CHEAP_STEP_CYCLE_MS / 1e3
    config = make_config("runtime.slots=1", "backend.name=synthetic", "runtime.gather_window_ms=30")
    async with open_runtime(config) as runtime:
        scheduler = runtime.scheduler
        assert scheduler.cheap_cycle == pytest.approx(expected_s)
        inbox = scheduler.inbox
        real_next_batch = inbox.next_batch
        asked: list[float | None] = []

        def next_batch(window: float, *, gather_queued: bool = True, gather_until=None):
            asked.append(None if gather_until is None else gather_until - time.monotonic())
            return real_next_batch(window, gather_queued=gather_queued, gather_until=gather_until)

        inbox.next_batch = next_batch
        owner = RecordingOwner()
        lease = scheduler.open_slot(owner)
        assert lease.submit_nowait(frame_of(0.2))
        await owner.wait_for(outputs=1)
        await trio.testing.wait_all_tasks_blocked()
        lease.release()
    after_the_step = [left for left in asked if left is not None]
    assert after_the_step and 0 < after_the_step[0] <= expected_s


# -- failures ------------------------------------------------------------------------------------------


async def test_step_error_reaches_exactly_that_steps_sessions_and_the_scheduler_survives():
    config = make_config("runtime.slots=4")
    # Step 1 is stalled so that step 2 is known to hold exactly A and B; step 2 fails.
    backend = ControlledBackend(config, stalled=True, fail_on=[2])
    async with open_runtime(config, backend=backend) as runtime:
        scheduler = runtime.scheduler
        a, b, c = RecordingOwner(), RecordingOwner(), RecordingOwner()
        lease_a, lease_b, lease_c = (scheduler.open_slot(o) for o in (a, b, c))
        try:
            c_first = frame_of(0.1)
            await lease_c.submit(c_first)
            await backend.wait_stalled()  # step 1 = [C], held
            await lease_a.submit(frame_of(0.2))
            await lease_b.submit(frame_of(0.3))
        finally:
            backend.release()
        await a.wait_for(failures=1)
        await b.wait_for(failures=1)
        await c.wait_for(outputs=1)
        assert backend.step_rows[:2] == [[lease_c.slot], sorted([lease_a.slot, lease_b.slot])]
        for owner in (a, b):
            assert len(owner.failures) == 1
            assert isinstance(owner.failures[0], BackendStepError)
            # What a client may be told is generic; the backend's own error is only the cause.
            assert str(owner.failures[0]) == f"the model failed on this step (error id {owner.failures[0].error_id})"
            assert "injected failure on step 2" in str(owner.failures[0].__cause__)
            assert owner.outputs == []
        assert a.failures[0].error_id == b.failures[0].error_id  # one step, one id
        assert c.failures == []
        np.testing.assert_array_equal(c.outputs[0], synthetic_out(c_first, lease_c.session_id, 0))

        # Later steps work, for a session that was not in the failed step and for a new one.
        d = RecordingOwner()
        lease_d = scheduler.open_slot(d)
        c_second, d_first = frame_of(-0.4), frame_of(0.5)
        await lease_c.submit(c_second)
        await lease_d.submit(d_first)
        await c.wait_for(outputs=2)
        await d.wait_for(outputs=1)
        np.testing.assert_array_equal(c.outputs[1], synthetic_out(c_second, lease_c.session_id, 1))
        np.testing.assert_array_equal(d.outputs[0], synthetic_out(d_first, lease_d.session_id, 0))
        assert c.failures == [] and d.failures == []
        assert scheduler.ready
        # The failed step was delivered like any other: at most one crossing per step.
        stats = runtime.handoffs.statistics()
        assert scheduler.statistics().steps == len(backend.step_rows)
        assert 1 <= stats[HandoffKind.OUTPUT_DELIVERY] <= len(backend.step_rows)
        for lease in (lease_a, lease_b, lease_c, lease_d):
            lease.release()


async def test_consecutive_step_failures_are_counted_and_reset_by_a_step_that_works(caplog):
    config = make_config("runtime.slots=2", "runtime.max_consecutive_step_failures=3")
    backend = ControlledBackend(config, fail_on=[1, 2, 3, 4, 6])
    async with open_runtime(config, backend=backend) as runtime:
        scheduler = runtime.scheduler
        owner = RecordingOwner()
        lease = scheduler.open_slot(owner)
        expected = [(1, 1, False), (2, 2, False), (3, 3, True), (4, 4, True), (4, 0, False), (5, 1, False)]
        for step, (failed, in_a_row, failing) in enumerate(expected, start=1):
            await lease.submit(frame_of(0.1 * step))
            await owner.wait_for(outputs=step - failed, failures=failed)
            stats = scheduler.statistics()
            assert (stats.failed_steps, stats.consecutive_step_failures, scheduler.failing) == (
                failed, in_a_row, failing), step
        assert scheduler.ready  # failing is a state of the model, not of the thread
        lease.release()
    # Every failure is in the log with its id and the backend's own error.
    records = [r for r in caplog.records if r.name == "duplexrt.scheduler" and r.exc_info]
    assert len(records) == 5
    for record, failure in zip(records, owner.failures, strict=True):
        assert failure.error_id in record.getMessage()
        assert "injected failure" in str(record.exc_info[1])


# -- backpressure ----------------------------------------------------------------------------------------


async def test_stalled_backend_stops_sessions_at_inbox_depth_then_everything_completes():
    depth = 4
    sessions = 3
    config = make_config("runtime.slots=4", f"runtime.inbox_depth={depth}", "runtime.outbox_depth=4")
    backend = ControlledBackend(config, stalled=True)
    wire = spec("pcm_f32le")
    workloads = []
    for i in range(sessions):
        samples = 5 * depth * FRAME + 777 * (i + 1)  # many more frames than the queue holds
        workloads.append(wire_messages(noise(samples, seed=10 + i), wire, cut_points(samples, seed=20 + i)))

    async with open_runtime(config, backend=backend) as runtime:
        inbox = runtime.scheduler.inbox
        runs: dict[int, SessionRun] = {}

        async def session(i: int) -> None:
            runs[i] = await run_session(runtime, workloads[i], wire, session_id=i + 1)

        async with trio.open_nursery() as nursery:
            try:
                for i in range(sessions):
                    nursery.start_soon(session, i)
                await backend.wait_stalled()
                # Every trio task is now blocked: nothing moves while the model is stalled.
                await trio.testing.wait_all_tasks_blocked()
                in_step = len(backend.step_rows[0])
                queued = [inbox.queued(slot) for slot in range(config.runtime.slots)]
                assert max(queued) <= depth, queued
                # Each session submitted exactly inbox_depth frames and then stopped by itself ...
                assert runtime.metrics.frames_in == sessions * depth
                # ... every one of them either queued or in the stalled step ...
                assert sum(queued) + in_step == sessions * depth
                # ... and without a single submit waiting on a worker thread.
                assert runtime.handoffs.statistics()[HandoffKind.FULL_INBOX_OFFLOAD] == 0
                # Still nothing moves a moment later.
                await trio.testing.wait_all_tasks_blocked()
                assert runtime.metrics.frames_in == sessions * depth
                assert len(backend.step_rows) == 1
            finally:
                backend.release()
        # (the nursery ends only when every session has finished)

        stats = runtime.handoffs.statistics()
        assert stats.offloads == 0
        for i in range(sessions):
            frames = model_frames(workloads[i], wire)
            run = runs[i]
            assert run.end.reason == "stop"
            assert run.end.frames_in == run.end.frames_out == len(frames)
            assert run.client.errors == []
            assert bytes(run.client.audio) == synthetic_wire(frames, i + 1, wire), f"session {i + 1}"
        assert inbox.total_queued() == 0
        assert runtime.scheduler.free_slots == config.runtime.slots


async def test_submit_into_full_inbox_waits_on_a_counted_worker_thread():
    depth = 3
    config = make_config("runtime.slots=2", f"runtime.inbox_depth={depth}")
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        owner = RecordingOwner()
        lease = runtime.scheduler.open_slot(owner)
        inbox = runtime.scheduler.inbox
        frames = [frame_of(0.01 * (k + 1)) for k in range(depth + 2)]
        done = trio.Event()
        try:
            await lease.submit(frames[0])
            await backend.wait_stalled()  # frames[0] is in the stalled step; the queue is empty
            for frame in frames[1:depth + 1]:
                await lease.submit(frame)
            assert inbox.queued(lease.slot) == depth
            assert runtime.handoffs.statistics()[HandoffKind.FULL_INBOX_OFFLOAD] == 0
            assert not lease.submit_nowait(frames[-1])  # full

            async def extra_submit() -> None:
                await lease.submit(frames[-1])
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(extra_submit)
                await trio.testing.wait_all_tasks_blocked()
                stats = runtime.handoffs.statistics()
                assert stats[HandoffKind.FULL_INBOX_OFFLOAD] == 1
                assert stats.by_kind["full_inbox_offload"] == 1
                assert stats.offloads == 1
                assert not done.is_set()
                assert inbox.queued(lease.slot) == depth
                backend.release()
                with trio.fail_after(PATIENCE):
                    await done.wait()
        finally:
            backend.release()
        await owner.wait_for(outputs=len(frames))
        assert owner.failures == []
        assert len(owner.outputs) == len(frames)
        for k, frame in enumerate(frames):  # complete and in order
            np.testing.assert_array_equal(owner.outputs[k], synthetic_out(frame, lease.session_id, k))
        assert runtime.handoffs.statistics()[HandoffKind.FULL_INBOX_OFFLOAD] == 1
        lease.release()
        assert runtime.scheduler.free_slots == 2


async def test_cancelled_full_inbox_submit_returns_promptly_and_release_frees_the_slot():
    depth = 2
    config = make_config("runtime.slots=2", f"runtime.inbox_depth={depth}")
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        scheduler = runtime.scheduler
        inbox = scheduler.inbox
        owner = RecordingOwner()
        lease = scheduler.open_slot(owner)
        slot = lease.slot
        try:
            await lease.submit(frame_of(0.1))
            await backend.wait_stalled()
            for _ in range(depth):
                await lease.submit(frame_of(0.2))
            assert inbox.queued(slot) == depth

            outcome: list[str] = []
            finished = trio.Event()

            async def blocked_submit(task_status=trio.TASK_STATUS_IGNORED) -> None:
                with trio.CancelScope() as scope:
                    task_status.started(scope)
                    await lease.submit(frame_of(0.3))
                    outcome.append("submitted")
                outcome.append("cancelled" if scope.cancelled_caught else "ended")
                finished.set()

            async with trio.open_nursery() as nursery:
                scope = await nursery.start(blocked_submit)
                await trio.testing.wait_all_tasks_blocked()
                assert runtime.handoffs.statistics()[HandoffKind.FULL_INBOX_OFFLOAD] == 1
                assert outcome == []
                scope.cancel()
                # The model stays stalled (the gate opens only in `finally` below), so the
                # cancelled submit must return without waiting for room in the inbox.
                with trio.fail_after(PATIENCE):
                    await finished.wait()
            assert outcome == ["cancelled"]
            assert inbox.queued(slot) == depth

            # Releasing the lease drops what was queued, frees the slot, and wakes the abandoned
            # worker thread (its limiter token comes back only once that thread has returned).
            assert lease.release() == depth
            assert inbox.queued(slot) == 0
            assert scheduler.free_slots == 2
            await wait_until(lambda: runtime.handoffs._limiter.borrowed_tokens == 0,
                             "the abandoned submit's worker thread returned")
        finally:
            backend.release()

        # The freed slot serves a new owner, and the abandoned frame never reaches it.
        newcomer = RecordingOwner()
        new_lease = scheduler.open_slot(newcomer)
        assert new_lease.slot == slot
        fresh = [frame_of(-0.5), frame_of(0.6)]
        for frame in fresh:
            await new_lease.submit(frame)
        await newcomer.wait_for(outputs=2)
        await trio.testing.wait_all_tasks_blocked()
        assert len(newcomer.outputs) == 2
        for k, frame in enumerate(fresh):
            np.testing.assert_array_equal(newcomer.outputs[k], synthetic_out(frame, new_lease.session_id, k))
        assert inbox.queued(slot) == 0
        new_lease.release()
        assert scheduler.free_slots == 2


# -- thread crossings ------------------------------------------------------------------------------------


async def test_idle_scheduler_is_woken_exactly_once_per_frame_and_each_step_is_one_delivery():
    config = make_config("runtime.slots=4", "backend.name=synthetic")
    async with open_runtime(config) as runtime:
        scheduler = runtime.scheduler
        inbox = scheduler.inbox
        handoffs = runtime.handoffs

        def idle() -> bool:
            # The scheduler thread is asleep with nothing to do (no trio-side effect marks this).
            with inbox._lock:
                return inbox._state is _State.IDLE and not inbox._controls

        assert handoffs.statistics()[HandoffKind.LIFECYCLE] == 1  # "started"
        owner = RecordingOwner()
        lease = scheduler.open_slot(owner)
        for k in range(3):
            await wait_until(idle, "the scheduler went idle")
            before = handoffs.statistics()
            steps_before = scheduler.statistics().steps
            frame = frame_of(0.1 * (k + 1))
            assert lease.submit_nowait(frame)
            await owner.wait_for(outputs=k + 1)
            after = handoffs.statistics()
            # one frame into an idle scheduler: one wake, one step, one delivery, nothing else
            assert after[HandoffKind.SCHEDULER_WAKE] - before[HandoffKind.SCHEDULER_WAKE] == 1
            assert scheduler.statistics().steps - steps_before == 1
            assert after[HandoffKind.OUTPUT_DELIVERY] - before[HandoffKind.OUTPUT_DELIVERY] == 1
            assert after.offloads == 0
            np.testing.assert_array_equal(owner.outputs[k], synthetic_out(frame, lease.session_id, k))
        lease.release()


async def test_a_busy_scheduler_is_not_woken_by_puts():
    config = make_config("runtime.slots=4", "runtime.inbox_depth=4", "runtime.gather_window_ms=0")
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        scheduler = runtime.scheduler
        handoffs = runtime.handoffs
        owners = [RecordingOwner() for _ in range(3)]
        leases = [scheduler.open_slot(owner) for owner in owners]
        frames = {i: [frame_of(0.1 * i + 0.01 * k) for k in range(3)] for i in range(3)}
        try:
            leases[0].submit_nowait(frames[0][0])
            await backend.wait_stalled()  # the scheduler thread is busy inside step 1
            before = handoffs.statistics()[HandoffKind.SCHEDULER_WAKE]
            for i, lease in enumerate(leases):
                for frame in frames[i][1 if i == 0 else 0:]:
                    assert lease.submit_nowait(frame)
            # A burst of puts (several first-in-queue among them) into a busy scheduler: no wakes.
            assert handoffs.statistics()[HandoffKind.SCHEDULER_WAKE] == before
        finally:
            backend.release()
        for i, owner in enumerate(owners):
            await owner.wait_for(outputs=3)
            for k, frame in enumerate(frames[i]):
                np.testing.assert_array_equal(owner.outputs[k], synthetic_out(frame, leases[i].session_id, k))
        # it went on to step without being woken: 1 + 3 steps of up to 3 rows each
        assert backend.step_rows[0] == [leases[0].slot]
        assert sum(len(rows) for rows in backend.step_rows) == 9
        assert handoffs.statistics()[HandoffKind.SCHEDULER_WAKE] == before
        for lease in leases:
            lease.release()


async def test_every_step_is_delivered_once_in_order_with_at_most_one_crossing_each():
    config = make_config("runtime.slots=8", "backend.name=synthetic")
    wire = spec("pcm_f32le")
    async with open_runtime(config) as runtime:
        workloads = []
        for i in range(6):
            samples = 12 * FRAME + 101 * i
            workloads.append(wire_messages(noise(samples, seed=40 + i), wire, cut_points(samples, seed=50 + i)))

        runs = [None] * len(workloads)

        async def one(i: int) -> None:
            runs[i] = await run_session(runtime, workloads[i], wire, session_id=100 + i)

        async with trio.open_nursery() as nursery:
            for i in range(len(workloads)):
                nursery.start_soon(one, i)
        frames = sum(run.end.frames_out for run in runs)
        sched = runtime.scheduler.statistics()
        stats = runtime.handoffs.statistics()
        assert sched.frames == frames == sum(len(model_frames(w, wire)) for w in workloads)
        # At most one crossing per step (one exactly while trio keeps up, fewer when several
        # finished steps ride along with one delivery) ...
        assert 1 <= stats[HandoffKind.OUTPUT_DELIVERY] <= sched.steps <= frames
        # ... and wakes only for puts, opens and closes that found the scheduler waiting.
        assert 1 <= stats[HandoffKind.SCHEDULER_WAKE] <= frames + 2 * len(workloads)
        assert stats.offloads == 0
        for i, run in enumerate(runs):
            assert bytes(run.client.audio) == synthetic_wire(model_frames(workloads[i], wire), 100 + i, wire)



async def test_puts_that_find_the_scheduler_busy_wake_nothing():
    """docs/architecture.md: the scheduler is woken only by a put (or open, close) that finds it
    waiting; frames queued while it steps cost no wake.  Counted exactly, with the model held
    in a step while the frames arrive (the bound in the test above allows one wake per frame)."""
    depth = 6
    config = make_config("runtime.slots=2", f"runtime.inbox_depth={depth}", "runtime.gather_window_ms=0")
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        def wakes() -> int:
            return runtime.handoffs.statistics()[HandoffKind.SCHEDULER_WAKE]

        owner = RecordingOwner()
        try:
            await wait_until(lambda: runtime.scheduler.inbox._state is _State.IDLE, "scheduler idle")
            before_open = wakes()
            lease = runtime.scheduler.open_slot(owner)
            await wait_until(lambda: runtime.scheduler.inbox._state is _State.IDLE, "open applied")
            assert wakes() == before_open + 1  # the open found it waiting
            await lease.submit(frame_of(0.1))
            await backend.wait_stalled()
            assert wakes() == before_open + 2  # so did the first frame
            for k in range(depth):
                await lease.submit(frame_of(0.2 + 0.01 * k))  # the scheduler is busy stepping
            assert wakes() == before_open + 2  # none of them woke it
            backend.release()
            await owner.wait_for(outputs=depth + 1)
            assert wakes() == before_open + 2  # nor did stepping what they queued
        finally:
            backend.release()
        lease.release()


async def test_pinning_puts_the_trio_and_scheduler_threads_on_one_cpu_and_restores_it():
    import os

    from duplexrt.core.scheduler import THREAD_NAME

    before = os.sched_getaffinity(0)
    config = make_config("runtime.pin_host_threads=true")
    async with open_runtime(config) as runtime:
        cpu = runtime.scheduler.pin_cpu
        assert cpu == min(before)
        assert os.sched_getaffinity(0) == {cpu}
        (thread,) = [t for t in threading.enumerate() if t.name == THREAD_NAME]
        with trio.fail_after(10):
            while os.sched_getaffinity(thread.native_id) != {cpu}:
                await trio.sleep(0.01)
    assert os.sched_getaffinity(0) == before


async def test_without_pinning_affinity_is_left_alone():
    import os

    before = os.sched_getaffinity(0)
    async with open_runtime(make_config("runtime.pin_host_threads=false")) as runtime:
        assert runtime.scheduler.pin_cpu is None
        assert os.sched_getaffinity(0) == before


async def test_the_model_loads_with_every_cpu_before_the_scheduler_thread_pins_itself():
    import os

    from duplexrt.backends.echo import EchoBackend

    seen = {}

    class RecordingLoad(EchoBackend):
        """FAKE load(): records the affinity a model's thread pool would inherit."""

        def load(self):
            seen["cpus"] = os.sched_getaffinity(0)

    before = os.sched_getaffinity(0)
    config = make_config("runtime.pin_host_threads=true")
    async with open_runtime(config, RecordingLoad(backend_info(config, "echo"), {})):
        pass
    assert seen["cpus"] == before


def test_the_way_back_is_typed_by_the_slot_owner_protocol():
    """Every structure a slot's owner travels through, from a lease to ``Scheduler._deliver``,
    names it as a ``SlotOwner``: the way back from a step to ``Session.step_output`` can be
    followed by reading the types."""
    import typing

    from duplexrt.core.inbox import Batch, Control
    from duplexrt.core.scheduler import SlotLease, StepOutcome
    from duplexrt.core.slot_owner import SlotOwner
    from duplexrt.session.session import Session

    assert typing.get_type_hints(Control)["owner"] is SlotOwner
    assert typing.get_type_hints(Batch)["owners"] == list[SlotOwner]
    assert typing.get_args(typing.get_type_hints(StepOutcome)["owners"]) == (SlotOwner,)
    assert typing.get_type_hints(SlotLease.__init__)["owner"] is SlotOwner
    for name in ("step_output", "step_failed", "persona_set"):  # the session is one, by its shape
        assert callable(getattr(Session, name))
        assert (list(typing.get_type_hints(getattr(Session, name)))
                == list(typing.get_type_hints(getattr(SlotOwner, name))))


async def test_submit_nowait_carries_the_callers_stamp_to_the_delivery():
    # The session stamps a frame once and submits it with a plain call: the latency figures
    # must measure from that stamp, as they do through the awaited submit.
    config = make_config("runtime.slots=2")
    async with open_runtime(config) as runtime:
        stamps: list[int] = []

        class StampOwner(RecordingOwner):
            def step_output(self, output, text, submitted_ns, stepped_ns) -> None:
                stamps.append(submitted_ns)
                super().step_output(output, text, submitted_ns, stepped_ns)

        owner = StampOwner()
        lease = runtime.scheduler.open_slot(owner)
        assert lease.submit_nowait(frame_of(0.1), 12345)
        await lease.submit(frame_of(0.2), 67890)
        await owner.wait_for(outputs=2)
        assert stamps == [12345, 67890]
        lease.release()
