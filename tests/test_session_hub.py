"""Sessions whose messages are taken where the server's read hub reads them (``serve_messages``
and ``Session._take_nowait``), over real sockets: a ``NativeWebSocket`` on a running ``ReadHub``
on the server side, a native WebSocket client on the other, the real runtime in between.

The read path must make no difference a client can see: the same output, in the same order,
the same usage, the same errors and limits, as a session that reads every message in its own
task (tests/test_session.py); and the messages that can be taken where they are read must be."""

from __future__ import annotations

import contextlib
import json
import time

import numpy as np
import pytest
import trio
import trio.testing

from conftest import (
    FRAME,
    INPUT_END,
    PATIENCE,
    ControlledBackend,
    ClientLog,
    make_config,
    noise,
    model_frames,
    run_client,
    send_all,
    receive_all,
    synthetic_out,
    synthetic_wire,
    wait_until,
)
from test_session import SYNTHETIC, pcm_workload
from duplexrt.core.runtime import open_runtime
from duplexrt.protocols.events import Reply
from duplexrt.protocols.raw import RawTranslator
from duplexrt.readhub import ReadHub
from duplexrt.transport import Taken
from duplexrt.wsnative import NativeWebSocket

def noise_frames(count: int, seed: int) -> list[np.ndarray]:
    return list(noise(count * FRAME, seed).astype(np.float32).reshape(count, FRAME))


pytestmark = pytest.mark.skipif(not ReadHub.available(), reason="the read hub needs epoll (Linux)")


@contextlib.asynccontextmanager
async def served_runtime(*overrides: str):
    """A runtime and a read hub running beside it, as ``duplexrt serve`` has them."""
    config = make_config(*overrides)
    hub = ReadHub()
    async with open_runtime(config) as runtime:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            yield runtime, hub
            nursery.cancel_scope.cancel()


def socket_pair(hub: ReadHub) -> tuple[NativeWebSocket, NativeWebSocket]:
    """``(client, server)``: the server end on ``hub``."""
    a, b = trio.socket.socketpair()
    server = NativeWebSocket(trio.SocketStream(a), hub=hub)
    client = NativeWebSocket(trio.SocketStream(b), client=True)
    return client, server


def start_session(nursery: trio.Nursery, runtime, hub: ReadHub, session_id: int, wire=None, protocol=None):
    """Serve one session over the hub in ``nursery``: ``(client, outcome)``, where ``outcome["end"]``
    is the session's end once it is over."""
    client, server = socket_pair(hub)
    outcome: dict = {}

    async def serve() -> None:
        outcome["end"] = await runtime.serve(server, protocol, input_spec=wire, output_spec=wire,
                                             session_id=session_id)

    nursery.start_soon(serve)
    return client, outcome


async def run_hub_session(runtime, hub, messages, wire, session_id=None, *, client_log=None, transform=None):
    """One session over the hub; ``transform(session)`` may change the server session first."""
    log = client_log if client_log is not None else ClientLog()
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            client, outcome = start_session(nursery, runtime, hub, session_id, wire)
            if transform is not None:
                await trio.testing.wait_all_tasks_blocked()
                transform(next(iter(runtime.sessions)))
            await run_client(client, messages, log)
    return outcome["end"], log


async def test_sixteen_sessions_over_the_hub_get_exactly_their_own_output_and_most_messages_are_taken_inline():
    async with served_runtime("runtime.slots=16", "runtime.inbox_depth=3", "runtime.outbox_depth=2",
                              *SYNTHETIC) as (runtime, hub):
        workloads = [(*pcm_workload("pcm_f32le", 9 + (i * 5) % 11 + 0.37, seed=i), 1 + 3 * i) for i in range(16)]
        results: list = [None] * 16

        async def one(i: int) -> None:
            messages, wire, session_id = workloads[i]
            results[i] = await run_hub_session(runtime, hub, messages, wire, session_id)

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        stats = runtime.statistics()
    sent = 0
    for (messages, wire, session_id), (end, log) in zip(workloads, results, strict=True):
        frames = model_frames(messages, wire)
        sent += len(messages)
        assert end.reason == "stop" and end.frames_in == end.frames_out == len(frames)
        assert log.end["usage"]["frames_out"] == len(frames) and log.errors == [] and log.close_code == 1000
        assert bytes(log.audio) == synthetic_wire(frames, session_id, wire)
    assert stats.handoffs.offloads == 0
    # The first message of each session is its reader's (it has the first-message deadline);
    # a client that sends as fast as it can outruns the credits now and then, and those wait
    # in the reader: the rest were taken where they were read.
    assert 0 < stats.frames.messages_taken_inline <= sent - 16
    assert hub.callbacks > 0


async def test_a_message_with_more_frames_than_the_credits_is_left_to_the_reader_and_answered_whole():
    async with served_runtime("runtime.slots=2", "runtime.inbox_depth=2", "runtime.outbox_depth=2",
                              *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(11, seed=6)
        big = np.concatenate(frames).astype("<f4").tobytes()  # eleven frames, credit for two
        messages = [frames[0].astype("<f4").tobytes(), big, frames[1].astype("<f4").tobytes()]
        end, log = await run_hub_session(runtime, hub, messages, wire, session_id=9)
    sent_frames = [frames[0], *frames, frames[1]]
    assert end.reason == "stop" and end.frames_out == len(sent_frames)
    assert bytes(log.audio) == synthetic_wire(sent_frames, 9, wire)


async def test_frames_past_a_decoder_bound_that_was_short_are_submitted_by_the_reader():
    """``samples_at_most`` is what lets a message be taken inline; were it ever short, the frames
    past the credits must still go in, in order (here it is made to say one frame)."""
    async with served_runtime("runtime.slots=1", "runtime.inbox_depth=2", "runtime.outbox_depth=2",
                              *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(9, seed=7)
        messages = [frames[0].astype("<f4").tobytes()] + [
            np.concatenate(frames[k:k + 4]).astype("<f4").tobytes() for k in (1, 5)]

        def short_bound(session) -> None:
            class ShortBound(type(session._decoder)):
                __slots__ = ()

                def samples_at_most(self, size: int) -> int:
                    return FRAME

            session._decoder.__class__ = ShortBound

        end, log = await run_hub_session(runtime, hub, messages, wire, session_id=4, transform=short_bound)
    assert end.reason == "stop" and end.frames_out == 9
    assert bytes(log.audio) == synthetic_wire(frames, 4, wire)


async def test_control_messages_and_bad_audio_are_answered_in_order_between_audio_taken_inline():
    async with served_runtime("runtime.slots=1", *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(4, seed=8)
        audio = [frame.astype("<f4").tobytes() for frame in frames]
        nan = np.full(FRAME, np.nan, dtype="<f4").tobytes()
        messages = [audio[0], audio[1], json.dumps({"type": "ping"}), nan, audio[2], audio[3]]
        end, log = await run_hub_session(runtime, hub, messages, wire, session_id=2)
    assert log.pongs == 1 and [e["code"] for e in log.errors] == ["invalid_audio"]
    assert end.reason == "stop" and end.frames_in == 4
    assert bytes(log.audio) == synthetic_wire(frames, 2, wire)


async def test_the_length_limit_reached_inline_ends_the_session_with_every_taken_frame_answered():
    async with served_runtime("runtime.slots=1", "runtime.max_session_seconds=0.4", *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(8, seed=9)
        messages = [frame.astype("<f4").tobytes() for frame in frames]
        end, log = await run_hub_session(runtime, hub, messages, wire, session_id=3)
    assert end.reason == "length" and end.frames_in == end.frames_out == 5
    assert log.end["reason"] == "length"
    assert bytes(log.audio) == synthetic_wire(frames[:5], 3, wire)


async def test_a_shutdown_answers_every_frame_the_hub_took_and_nothing_after():
    async with served_runtime("runtime.slots=1", *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(6, seed=10)
        log = ClientLog()
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                client, outcome = start_session(nursery, runtime, hub, 5, wire)
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


class FlippingProtocol(RawTranslator):
    """A translator whose ``parse`` changes what ``audio_out`` says, as Realtime's
    ``response.create`` does (it opens the response the next deltas belong to): after the text
    message "flip" it answers "flipped", and every later batch of audio is announced by "after"."""

    def __init__(self, spec) -> None:
        super().__init__(spec)
        self.flipped = False

    def parse(self, message):
        if message == "flip":
            self.flipped = True
            return Reply((json.dumps({"type": "flipped"}),))
        return super().parse(message)

    def audio_out(self, payload: bytes, frames: int):
        return [json.dumps({"type": "after"}), *super().audio_out(payload, frames)] if self.flipped else \
            super().audio_out(payload, frames)


async def test_output_delivered_while_a_read_event_waits_for_the_reader_goes_out_after_what_the_event_says():
    """The hub parsed "flip" (the translator's state moved on) and left it for the reader; a
    step's delivery lands before the reader runs.  What the translator said for "flip" must still
    reach the client before the output that came after it (Realtime: response.created before the
    response's first delta)."""
    config = make_config("runtime.slots=1")
    backend = ControlledBackend(config, stalled=True)
    hub = ReadHub()
    wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
    frame = noise_frames(1, seed=11)[0]
    texts: list[str] = []
    async with open_runtime(config, backend=backend) as runtime:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hub.run)
            client, outcome = start_session(nursery, runtime, hub, 1, protocol=FlippingProtocol(wire))
            await wait_until(lambda: runtime.sessions, "the session to open")
            session = next(iter(runtime.sessions))
            real_take = session._take_nowait

            def take_then_deliver(message):
                taken = real_take(message)
                if isinstance(session._held, Reply):  # "flip", left for the reader: a delivery now
                    backend.release()
                    scheduler = runtime.scheduler
                    deadline = time.monotonic() + PATIENCE
                    while not scheduler._undelivered:
                        assert time.monotonic() < deadline, "the step never finished"
                        time.sleep(0.001)
                    scheduler._take_deliveries()  # as the crossing would, before the reader runs
                return taken

            session._take_nowait = take_then_deliver  # before the reader first serves
            await client.send(frame.astype("<f4").tobytes())  # the first message: the reader's
            await backend.wait_stalled()
            backend.release()  # the first step goes; the second frame will stall it again
            await wait_until(lambda: runtime.metrics.frames_out == 1, "the first frame out")
            backend.stall()
            await client.send(frame.astype("<f4").tobytes())  # taken where read: stalls the model
            await backend.wait_stalled()
            await client.send("flip")
            with trio.fail_after(PATIENCE):
                while "after" not in texts:
                    message = await client.receive()
                    if isinstance(message, str):
                        texts.append(json.loads(message)["type"])
            await client.send(INPUT_END)
            with trio.fail_after(PATIENCE):
                while "session.end" not in texts:
                    message = await client.receive()
                    if isinstance(message, str):
                        texts.append(json.loads(message)["type"])
            nursery.cancel_scope.cancel()
    assert texts.index("flipped") < texts.index("after")


async def test_a_shutdown_right_after_the_hub_left_a_message_to_the_reader_still_answers_all_of_it():
    """The hub read a message the credits could not take at once (six frames, inbox depth 2) and
    left it to the reader; a shutdown lands before the reader runs.  That message was read: the
    reader finishes it, every frame answered, and stops after it."""
    async with served_runtime("runtime.slots=1", "runtime.inbox_depth=2", "runtime.outbox_depth=2",
                              *SYNTHETIC) as (runtime, hub):
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(7, seed=13)
        log = ClientLog()
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                client, outcome = start_session(nursery, runtime, hub, 6, wire)
                await wait_until(lambda: runtime.sessions, "the session to open")
                session = next(iter(runtime.sessions))
                real_take = session._take_nowait

                def take_then_stop(message):
                    taken = real_take(message)
                    if taken is Taken.HELD:
                        session.shutdown()  # before the reader gets the message it was left
                    return taken

                session._take_nowait = take_then_stop
                nursery.start_soon(receive_all, client, log)
                await client.send(frames[0].astype("<f4").tobytes())  # the reader's, as the first
                await wait_until(lambda: runtime.metrics.frames_out == 1, "the first frame out")
                await client.send(np.concatenate(frames[1:]).astype("<f4").tobytes())
    end = outcome["end"]
    assert end.reason == "shutdown" and end.frames_in == end.frames_out == 7
    assert bytes(log.audio) == synthetic_wire(frames, 6, wire)[:7 * FRAME * 4]


async def test_a_session_whose_messages_all_go_through_a_worker_thread_reads_its_own_socket():
    """With ``offload = "always"`` (as with Opus, decoded on a worker thread) nothing could be taken
    where the hub reads it: the session reads its own socket, and the hub never calls it back."""
    async with served_runtime("runtime.slots=1", "runtime.offload=always", *SYNTHETIC) as (runtime, hub):
        messages, wire = pcm_workload("pcm_f32le", 4.5, seed=14)
        end, log = await run_hub_session(runtime, hub, messages, wire, session_id=8)
        stats = runtime.statistics()
    frames = model_frames(messages, wire)
    assert end.reason == "stop" and bytes(log.audio) == synthetic_wire(frames, 8, wire)
    assert hub.callbacks == 0 and stats.frames.messages_taken_inline == 0
