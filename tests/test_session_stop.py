"""Stopping a session while it is in the middle of something: exact frames, exact order, no hang.

A stop (``Session.shutdown``, as the server's drain calls it) must finish what the reader took:
every frame of every message it read, in order, then the framer's tail, and nothing after.  And a
submit that waits on a worker thread (``runtime.offload = "always"``, or a full inbox) must never
land behind the session's back once the session has moved on.

Real runtime, real scheduler thread, real synthetic model.  Two test hooks decide *when* things
happen: ``ControlledBackend`` (conftest) stalls the model, and ``GatedPuts`` holds chosen
worker-thread puts before or after they queue their frame.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from functools import partial

import numpy as np
import trio
import trio.testing

from conftest import (
    FRAME,
    GATE_TIMEOUT,
    PATIENCE,
    ClientLog,
    ControlledBackend,
    RecordingOwner,
    frame_of,
    make_config,
    model_frames,
    noise,
    noise_frames,
    receive_all,
    send_all,
    spec,
    start_socket_session,
    synthetic_out,
    synthetic_wire,
    wait_until,
    wire_messages,
)
from test_session import SYNTHETIC, pcm_workload
from duplexrt.core.handoffs import HandoffKind
from duplexrt.core.inbox import Inbox
from duplexrt.runtime import Runtime, open_runtime
from duplexrt.session.session import Session
from duplexrt.protocols.events import SessionEnd
from duplexrt.wire.transport import memory_transport_pair


class GatedPuts:
    """FAKE (a test hook on the real inbox): worker-thread puts (``Inbox.put_blocking``, the call
    a submit makes on a worker thread), numbered from 1 in the order they start, wait on a gate
    ``before`` they try to queue their frame or ``after`` they did; every other put runs as is."""

    def __init__(self, inbox: Inbox, *, before: Iterable[int] = (), after: Iterable[int] = ()) -> None:
        self._real = inbox.put_blocking
        inbox.put_blocking = self._put  # type: ignore[method-assign]
        self._before = {n: threading.Event() for n in before}
        self._after = {n: threading.Event() for n in after}
        self._lock = threading.Lock()
        self.calls = 0
        self.waiting: set[int] = set()  # puts held at a gate now
        self.returned: dict[int, bool] = {}  # put number -> what it returned

    def _put(self, *args: object) -> bool:
        with self._lock:
            self.calls += 1
            number = self.calls
        self._hold(number, self._before.get(number))
        queued = self._real(*args)
        self._hold(number, self._after.get(number))
        with self._lock:
            self.returned[number] = queued
        return queued

    def _hold(self, number: int, gate: threading.Event | None) -> None:
        if gate is None:
            return
        with self._lock:
            self.waiting.add(number)
        opened = gate.wait(GATE_TIMEOUT)
        with self._lock:
            self.waiting.discard(number)
        if not opened:
            raise RuntimeError(f"test gate of put {number} never opened")

    def open(self, number: int) -> None:
        for gates in (self._before, self._after):
            if number in gates:
                gates[number].set()

    def open_all(self) -> None:
        for gate in [*self._before.values(), *self._after.values()]:
            gate.set()

    async def wait_held(self, number: int) -> None:
        await wait_until(lambda: number in self.waiting, f"put {number} held at its gate")

    async def wait_returned(self, number: int) -> None:
        await wait_until(lambda: number in self.returned, f"put {number} returned")

    async def wait_settled(self, runtime: Runtime) -> None:
        """Every put trio has handed to a thread so far has returned or is held at a gate."""
        await trio.testing.wait_all_tasks_blocked()
        started = runtime.handoffs.statistics()
        offloaded = started[HandoffKind.SUBMIT_OFFLOAD] + started[HandoffKind.FULL_INBOX_OFFLOAD]

        def settled() -> bool:
            with self._lock:
                return self.calls >= offloaded and len(self.returned) + len(self.waiting) >= offloaded

        await wait_until(settled, "the puts already handed to threads settled")


class InputRecordingBackend(ControlledBackend):
    """FAKE (test hooks on the real synthetic model, see ControlledBackend), which also keeps
    every input frame the model is given, in the order it steps them."""

    def __init__(self, config, **kwargs) -> None:
        super().__init__(config, **kwargs)
        self.seen: list[np.ndarray] = []

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> None:
        self.seen.extend(np.array(inputs[i]) for i in range(len(rows)))
        return super().step(rows, inputs, outputs)


class StoppedSession:
    """One session served over a memory transport; the client sends ``messages`` and no
    input.end (only a stop ends it) and reads everything back until the server closes."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.client = ClientLog()
        self.end: SessionEnd | None = None
        self.done = trio.Event()

    async def run(self, messages: list[bytes], wire, session_id: int, task_status=trio.TASK_STATUS_IGNORED):
        client, server = memory_transport_pair()

        async def serve() -> None:
            self.end = await self.runtime.serve(server, input_spec=wire, output_spec=wire, session_id=session_id)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            nursery.start_soon(partial(send_all, end_input=False), client, messages, self.client)
            await wait_until(lambda: len(self.runtime.sessions) == 1, "the session started")
            task_status.started()
            await receive_all(client, self.client)
            nursery.cancel_scope.cancel()
        self.done.set()

    @property
    def session(self) -> Session:
        (session,) = self.runtime.sessions
        return session

    async def wait_done(self) -> None:
        with trio.fail_after(PATIENCE):
            await self.done.wait()


def assert_exactly(run: StoppedSession, frames: list[np.ndarray], session_id: int, wire) -> None:
    """The client got the output of exactly ``frames``, in order, and usage says so."""
    assert run.end is not None and run.end.reason == "shutdown", run.end
    assert run.client.end is not None and run.client.end["reason"] == "shutdown", run.client.end
    assert run.client.close_code == 1001
    got = np.frombuffer(bytes(run.client.audio), dtype="<f4").reshape(-1, FRAME)
    expected = np.frombuffer(synthetic_wire(frames, session_id, wire), dtype="<f4").reshape(-1, FRAME)
    assert got.shape[0] == len(frames), f"{got.shape[0]} frames out, {len(frames)} expected"
    for k in range(len(frames)):
        np.testing.assert_array_equal(got[k], expected[k], err_msg=f"frame {k}")
    assert run.end.frames_in == run.end.frames_out == len(frames), run.end
    usage = run.client.end["usage"]
    assert usage["frames_in"] == usage["frames_out"] == len(frames), usage


def message_of(frames: float, seed: int, wire) -> bytes:
    (message,) = wire_messages(noise(int(frames * FRAME), seed), wire, [int(frames * FRAME)])
    return message


# -- a stop in the middle of a message (issue 8, defect 10) ---------------------------------------------


async def test_shutdown_in_the_middle_of_a_message_answers_every_frame_of_it_and_nothing_after():
    config = make_config("runtime.slots=2", "runtime.inbox_depth=2", "runtime.outbox_depth=2")
    wire = spec("pcm_f32le")
    taken = message_of(5.5, seed=1, wire=wire)  # five frames and a half
    later = [message_of(2.0, seed=2, wire=wire), message_of(1.25, seed=3, wire=wire)]
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        run = StoppedSession(runtime)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(run.run, [taken, *later], wire, 7)
                await backend.wait_stalled()
                await trio.testing.wait_all_tasks_blocked()
                session = run.session
                # The reader is inside the first message, waiting for credit to submit its third frame.
                assert session.frames_in == 2
                session.shutdown()
                await trio.testing.wait_all_tasks_blocked()
                backend.release()
                await run.wait_done()
        finally:
            backend.release()
    # Five whole frames, then the half frame padded: the message's own tail, right after it.
    assert_exactly(run, model_frames([taken], wire), 7, wire)


async def test_shutdown_waiting_for_the_next_message_ends_at_once_with_what_was_taken():
    config = make_config("runtime.slots=2", "backend.name=synthetic")
    wire = spec("pcm_f32le")
    taken = [message_of(1.5, seed=4, wire=wire), message_of(2.25, seed=5, wire=wire)]
    async with open_runtime(config) as runtime:
        run = StoppedSession(runtime)
        async with trio.open_nursery() as nursery:
            await nursery.start(run.run, taken, wire, 8)
            await wait_until(lambda: run.session.frames_answered == 3, "both messages' whole frames answered")
            await trio.testing.wait_all_tasks_blocked()
            run.session.shutdown()
            await run.wait_done()
    assert_exactly(run, model_frames(taken, wire), 8, wire)


async def test_shutdown_while_a_message_is_decoded_on_a_worker_thread_answers_all_of_it():
    config = make_config("runtime.slots=2", "runtime.offload=always", "backend.name=synthetic")
    wire = spec("pcm_f32le")
    message = message_of(2.5, seed=6, wire=wire)
    async with open_runtime(config) as runtime:
        # Hold the message's decode (a conversion on a worker thread with offload = "always").
        held, gate = threading.Event(), threading.Event()
        offload = runtime.handoffs.offload

        def held_decode(decode, payload):
            held.set()
            if not gate.wait(GATE_TIMEOUT):
                raise RuntimeError("test gate never opened")
            return decode(payload)

        async def gated_offload(kind, fn, *args, **kwargs):
            if kind is HandoffKind.CONVERT_OFFLOAD and not held.is_set():
                return await offload(kind, held_decode, fn, *args, **kwargs)
            return await offload(kind, fn, *args, **kwargs)

        runtime.handoffs.offload = gated_offload
        run = StoppedSession(runtime)
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(run.run, [message], wire, 9)
                await wait_until(held.is_set, "the message's decode is held")
                run.session.shutdown()
                await trio.testing.wait_all_tasks_blocked()
                gate.set()
                await run.wait_done()
        finally:
            gate.set()
    assert_exactly(run, model_frames([message], wire), 9, wire)


# -- a stop while a submit waits on a worker thread (issue 8, defect 9) -----------------------------------
#
# offload = "always": every submit is a put on a worker thread.  The message is two frames and a
# half: f0 (put 1), f1 (put 2), and the padded tail T (put 3).  The stop comes while put 2 is held
# on its thread.  Before the fix the stop cancelled the reader there and abandoned put 2, which
# then landed after the session had gone on: each test below lines up one of the ways that went.

ALWAYS = ("runtime.slots=2", "runtime.offload=always")


async def _stop_during_put_2(runtime: Runtime, puts: GatedPuts, run: StoppedSession, wire, nursery) -> list[np.ndarray]:
    message = message_of(2.5, seed=10, wire=wire)
    await nursery.start(run.run, [message], wire, 5)
    await puts.wait_held(2)
    run.session.shutdown()
    await puts.wait_settled(runtime)
    return model_frames([message], wire)


async def test_a_put_held_on_its_thread_through_a_shutdown_reaches_the_model_before_the_tail():
    config = make_config(*ALWAYS)
    wire = spec("pcm_f32le")
    backend = InputRecordingBackend(config, stalled=True)  # f0's step stalls: the rest stays queued
    async with open_runtime(config, backend=backend) as runtime:
        # T's put, once in, is held before it returns: the session cannot end its input yet.
        puts = GatedPuts(runtime.scheduler.inbox, before=[2], after=[3])
        run = StoppedSession(runtime)
        try:
            async with trio.open_nursery() as nursery:
                frames = await _stop_during_put_2(runtime, puts, run, wire, nursery)
                puts.open(2)
                await puts.wait_returned(2)
                puts.open(3)
                await puts.wait_settled(runtime)
                backend.release()
                await run.wait_done()
        finally:
            puts.open_all()
            backend.release()
    # Before the fix the model saw f0, T, f1: T had gone in while f1's put was held.
    assert len(backend.seen) == len(frames) == 3
    for k, frame in enumerate(frames):
        np.testing.assert_array_equal(backend.seen[k], frame, err_msg=f"model input {k}")
    assert_exactly(run, frames, 5, wire)


async def test_a_put_held_on_its_thread_through_a_shutdown_does_not_cost_the_last_output():
    config = make_config(*ALWAYS)
    wire = spec("pcm_f32le")
    backend = ControlledBackend(config)
    async with open_runtime(config, backend=backend) as runtime:
        puts = GatedPuts(runtime.scheduler.inbox, before=[2, 3])
        run = StoppedSession(runtime)
        try:
            async with trio.open_nursery() as nursery:
                frames = await _stop_during_put_2(runtime, puts, run, wire, nursery)
                puts.open(2)  # f1 goes in and is answered before T goes in
                await puts.wait_held(3)
                await wait_until(lambda: run.session.frames_answered == 2, "f0 and f1 answered")
                backend.stall()  # T's output comes only after its submit has returned
                puts.open(3)
                await puts.wait_returned(3)
                await backend.wait_stalled()
                await trio.testing.wait_all_tasks_blocked()
                backend.release()
                await run.wait_done()
        finally:
            puts.open_all()
            backend.release()
    assert_exactly(run, frames, 5, wire)


async def test_a_put_held_on_its_thread_through_a_shutdown_does_not_hang_the_session():
    config = make_config(*ALWAYS, "backend.name=synthetic")
    wire = spec("pcm_f32le")
    async with open_runtime(config) as runtime:
        puts = GatedPuts(runtime.scheduler.inbox, before=[2], after=[3])
        run = StoppedSession(runtime)
        try:
            async with trio.open_nursery() as nursery:
                frames = await _stop_during_put_2(runtime, puts, run, wire, nursery)
                puts.open(2)
                await puts.wait_held(3)  # T is queued; its submit has not returned yet
                await wait_until(lambda: run.session.frames_answered == 3, "all three frames answered")
                puts.open(3)
                await run.wait_done()
        finally:
            puts.open_all()
    assert_exactly(run, frames, 5, wire)


# -- the lease: a cancelled threaded submit is settled, never left to land later -------------------------


async def _lease_with_put_2_held(runtime: Runtime, backend: ControlledBackend, puts: GatedPuts):
    """A lease whose first frame is stalled in the model and whose second submit is held on its
    worker thread; returns the lease, the submit's cancel scope and what became of the submit."""
    owner = RecordingOwner()
    lease = runtime.scheduler.open_slot(owner)
    await lease.submit(frame_of(0.1))
    await backend.wait_stalled()
    outcome: list[str] = []

    async def submit(task_status=trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as scope:
            task_status.started(scope)
            await lease.submit(frame_of(0.2))
            outcome.append("submitted")
        outcome.append("cancelled" if scope.cancelled_caught else "ended")

    return lease, submit, outcome


async def test_a_cancelled_threaded_submit_whose_frame_went_in_returns_as_submitted():
    config = make_config(*ALWAYS)
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        inbox = runtime.scheduler.inbox
        puts = GatedPuts(inbox, after=[2])
        try:
            lease, submit, outcome = await _lease_with_put_2_held(runtime, backend, puts)
            async with trio.open_nursery() as nursery:
                scope = await nursery.start(submit)
                await puts.wait_held(2)
                assert inbox.queued(lease.slot) == 1  # the frame is in
                scope.cancel()
            # It went in, so the submit reports it (and the cancellation lands after).
            assert outcome == ["submitted", "ended"]
            assert inbox.queued(lease.slot) == 1
        finally:
            puts.open_all()
            backend.release()
        lease.release()


async def test_a_cancelled_threaded_submit_whose_frame_had_not_gone_in_never_queues_it():
    config = make_config(*ALWAYS)
    backend = ControlledBackend(config, stalled=True)
    async with open_runtime(config, backend=backend) as runtime:
        inbox = runtime.scheduler.inbox
        puts = GatedPuts(inbox, before=[2])
        try:
            lease, submit, outcome = await _lease_with_put_2_held(runtime, backend, puts)
            async with trio.open_nursery() as nursery:
                scope = await nursery.start(submit)
                await puts.wait_held(2)
                scope.cancel()
            assert outcome == ["cancelled"]
            # The abandoned thread goes on: it must find its put withdrawn, with room right there.
            puts.open(2)
            await puts.wait_returned(2)
            assert puts.returned[2] is False
            assert inbox.queued(lease.slot) == 0
        finally:
            puts.open_all()
            backend.release()
        lease.release()


# -- over real sockets ----------------------------------------------------------------------------


async def test_a_shutdown_answers_every_frame_taken_and_nothing_after():
    async with open_runtime(make_config("runtime.slots=1", *SYNTHETIC)) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(6, seed=10)
        log = ClientLog()
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                client, outcome = start_socket_session(nursery, runtime, 5, wire)
                nursery.start_soon(receive_all, client, log)
                await send_all(client, [frame.astype("<f4").tobytes() for frame in frames[:4]], log,
                               end_input=False)
                await wait_until(lambda: runtime.metrics.frames_in >= 4, "the four frames in")
                next(iter(runtime.sessions)).shutdown()
    end = outcome["end"]
    assert end.reason == "shutdown" and end.frames_in == end.frames_out == 4
    got = np.frombuffer(bytes(log.audio), dtype="<f4").reshape(-1, FRAME)
    for k in range(4):
        np.testing.assert_array_equal(got[k], synthetic_out(frames[k], 5, k))


async def test_a_shutdown_while_a_message_waits_for_credit_still_answers_all_of_it():
    """A message of six frames, credit for two, the model stalled: the reader waits for credit
    in the middle of it when a shutdown lands.  That message was read: the reader finishes it,
    every frame answered, and stops after it."""
    config = make_config("runtime.slots=1", "runtime.inbox_depth=2", "runtime.outbox_depth=2", *SYNTHETIC)
    wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
    frames = noise_frames(7, seed=13)
    log = ClientLog()
    backend = ControlledBackend(config)
    async with open_runtime(config, backend=backend) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                client, outcome = start_socket_session(nursery, runtime, 6, wire)
                nursery.start_soon(receive_all, client, log)
                await client.send(frames[0].astype("<f4").tobytes())
                await wait_until(lambda: runtime.metrics.frames_out == 1, "the first frame out")
                backend.stall()
                await client.send(np.concatenate(frames[1:]).astype("<f4").tobytes())
                await backend.wait_stalled()
                await wait_until(lambda: runtime.metrics.frames_in == 3, "the credits used up")
                await trio.testing.wait_all_tasks_blocked()  # the reader waits for credit
                next(iter(runtime.sessions)).shutdown()
                backend.release()
    end = outcome["end"]
    assert end.reason == "shutdown" and end.frames_in == end.frames_out == 7
    assert bytes(log.audio) == synthetic_wire(frames, 6, wire)[:7 * FRAME * 4]
