"""Sessions over real sockets: a ``NativeWebSocket`` on the server side, read by the session's
own reader, a native WebSocket client on the other, the real runtime in between.

The socket must make no difference a client can see: the same output, in the same order, the
same usage, the same errors and limits, as a session over the in-memory transport
(tests/test_session.py), however the messages fall against the credits."""

from __future__ import annotations

import contextlib
import json

import numpy as np
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
from duplexrt.runtime import open_runtime
from duplexrt.protocols.events import Reply
from duplexrt.protocols.raw import RawProtocol
from duplexrt.wire.native import NativeWebSocket

def noise_frames(count: int, seed: int) -> list[np.ndarray]:
    return list(noise(count * FRAME, seed).astype(np.float32).reshape(count, FRAME))


@contextlib.asynccontextmanager
async def served_runtime(*overrides: str):
    """A runtime, as ``duplexrt serve`` has it."""
    async with open_runtime(make_config(*overrides)) as runtime:
        yield runtime


def socket_pair() -> tuple[NativeWebSocket, NativeWebSocket]:
    """``(client, server)`` over a socket pair."""
    a, b = trio.socket.socketpair()
    server = NativeWebSocket(trio.SocketStream(a))
    client = NativeWebSocket(trio.SocketStream(b), client=True)
    return client, server


def start_session(nursery: trio.Nursery, runtime, session_id: int, wire=None, protocol=None):
    """Serve one session over a socket pair in ``nursery``: ``(client, outcome)``, where
    ``outcome["end"]`` is the session's end once it is over."""
    client, server = socket_pair()
    outcome: dict = {}

    async def serve() -> None:
        outcome["end"] = await runtime.serve(server, protocol, input_spec=wire, output_spec=wire,
                                             session_id=session_id)

    nursery.start_soon(serve)
    return client, outcome


async def run_socket_session(runtime, messages, wire, session_id=None, *, client_log=None):
    """One session over a socket pair."""
    log = client_log if client_log is not None else ClientLog()
    with trio.fail_after(PATIENCE):
        async with trio.open_nursery() as nursery:
            client, outcome = start_session(nursery, runtime, session_id, wire)
            await run_client(client, messages, log)
    return outcome["end"], log


async def test_sixteen_sessions_over_sockets_get_exactly_their_own_output():
    async with served_runtime("runtime.slots=16", "runtime.inbox_depth=3", "runtime.outbox_depth=2",
                              *SYNTHETIC) as runtime:
        workloads = [(*pcm_workload("pcm_f32le", 9 + (i * 5) % 11 + 0.37, seed=i), 1 + 3 * i) for i in range(16)]
        results: list = [None] * 16

        async def one(i: int) -> None:
            messages, wire, session_id = workloads[i]
            results[i] = await run_socket_session(runtime, messages, wire, session_id)

        async with trio.open_nursery() as nursery:
            for i in range(16):
                nursery.start_soon(one, i)
        stats = runtime.statistics()
    for (messages, wire, session_id), (end, log) in zip(workloads, results, strict=True):
        frames = model_frames(messages, wire)
        assert end.reason == "stop" and end.frames_in == end.frames_out == len(frames)
        assert log.end["usage"]["frames_out"] == len(frames) and log.errors == [] and log.close_code == 1000
        assert bytes(log.audio) == synthetic_wire(frames, session_id, wire)
    assert stats.handoffs.offloads == 0


async def test_a_message_with_more_frames_than_the_credits_waits_for_them_and_is_answered_whole():
    async with served_runtime("runtime.slots=2", "runtime.inbox_depth=2", "runtime.outbox_depth=2",
                              *SYNTHETIC) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(11, seed=6)
        big = np.concatenate(frames).astype("<f4").tobytes()  # eleven frames, credit for two
        messages = [frames[0].astype("<f4").tobytes(), big, frames[1].astype("<f4").tobytes()]
        end, log = await run_socket_session(runtime, messages, wire, session_id=9)
    sent_frames = [frames[0], *frames, frames[1]]
    assert end.reason == "stop" and end.frames_out == len(sent_frames)
    assert bytes(log.audio) == synthetic_wire(sent_frames, 9, wire)


async def test_control_messages_and_bad_audio_are_answered_in_order_between_audio():
    async with served_runtime("runtime.slots=1", *SYNTHETIC) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(4, seed=8)
        audio = [frame.astype("<f4").tobytes() for frame in frames]
        nan = np.full(FRAME, np.nan, dtype="<f4").tobytes()
        messages = [audio[0], audio[1], json.dumps({"type": "ping"}), nan, audio[2], audio[3]]
        end, log = await run_socket_session(runtime, messages, wire, session_id=2)
    assert log.pongs == 1 and [e["code"] for e in log.errors] == ["invalid_audio"]
    assert end.reason == "stop" and end.frames_in == 4
    assert bytes(log.audio) == synthetic_wire(frames, 2, wire)


async def test_the_length_limit_ends_the_session_with_every_taken_frame_answered():
    async with served_runtime("runtime.slots=1", "runtime.max_session_seconds=0.4", *SYNTHETIC) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(8, seed=9)
        messages = [frame.astype("<f4").tobytes() for frame in frames]
        end, log = await run_socket_session(runtime, messages, wire, session_id=3)
    assert end.reason == "length" and end.frames_in == end.frames_out == 5
    assert log.end["reason"] == "length"
    assert bytes(log.audio) == synthetic_wire(frames[:5], 3, wire)


async def test_a_shutdown_answers_every_frame_taken_and_nothing_after():
    async with served_runtime("runtime.slots=1", *SYNTHETIC) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(6, seed=10)
        log = ClientLog()
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                client, outcome = start_session(nursery, runtime, 5, wire)
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


class FlippingProtocol(RawProtocol):
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


async def test_output_delivered_after_a_read_event_goes_out_after_what_the_event_says():
    """"flip" moves the translator's state on while a step is in the model; that step's output
    is delivered after it.  What the translator said for "flip" must reach the client before the
    output that came after it (Realtime: response.created before the response's first delta)."""
    config = make_config("runtime.slots=1")
    backend = ControlledBackend(config, stalled=True)
    frame = noise_frames(1, seed=11)[0]
    texts: list[str] = []
    wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
    async with open_runtime(config, backend=backend) as runtime:
        async with trio.open_nursery() as nursery:
            protocol = FlippingProtocol(wire)
            client, outcome = start_session(nursery, runtime, 1, protocol=protocol)
            await client.send(frame.astype("<f4").tobytes())
            await backend.wait_stalled()
            backend.release()  # the first step goes; the second frame will stall it again
            await wait_until(lambda: runtime.metrics.frames_out == 1, "the first frame out")
            backend.stall()
            await client.send(frame.astype("<f4").tobytes())  # stalls the model
            await backend.wait_stalled()
            await client.send("flip")
            await wait_until(lambda: protocol.flipped, "the flip read")
            backend.release()  # the stalled step's output comes after the flip
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
                client, outcome = start_session(nursery, runtime, 6, wire)
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


async def test_a_session_whose_messages_all_go_through_a_worker_thread_gets_all_its_output():
    """With ``offload = "always"`` (as with Opus, decoded on a worker thread) every message waits
    for a worker thread, and every batch goes out through the writer."""
    async with served_runtime("runtime.slots=1", "runtime.offload=always", *SYNTHETIC) as runtime:
        messages, wire = pcm_workload("pcm_f32le", 4.5, seed=14)
        end, log = await run_socket_session(runtime, messages, wire, session_id=8)
        stats = runtime.statistics()
    frames = model_frames(messages, wire)
    assert end.reason == "stop" and bytes(log.audio) == synthetic_wire(frames, 8, wire)
    assert stats.handoffs.offloads > 0 and stats.frames.direct_batches == 0
