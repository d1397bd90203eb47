"""Order: what a client sees comes in the order the translator decided, whatever the wire and
however the messages fall against the credits.  Sessions over real sockets (a ``NativeWebSocket``
read by the session's own reader, a native client on the other end, the real runtime between)
give the same output, in the same order, as over the in-memory transport (tests/test_session.py)."""

from __future__ import annotations

import json

import numpy as np
import trio

from conftest import (
    FRAME,
    INPUT_END,
    PATIENCE,
    ControlledBackend,
    make_config,
    model_frames,
    noise_frames,
    run_socket_session,
    start_socket_session,
    synthetic_wire,
    wait_until,
)
from test_session import SYNTHETIC, pcm_workload
from duplexrt.protocols.events import Reply
from duplexrt.protocols.raw import RawTranslator
from duplexrt.runtime import open_runtime


async def test_sixteen_sessions_over_sockets_get_exactly_their_own_output():
    async with open_runtime(make_config("runtime.slots=16", "runtime.inbox_depth=3", "runtime.outbox_depth=2",
                              *SYNTHETIC)) as runtime:
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


async def test_control_messages_and_bad_audio_are_answered_in_order_between_audio():
    async with open_runtime(make_config("runtime.slots=1", *SYNTHETIC)) as runtime:
        wire = pcm_workload("pcm_f32le", 1, seed=5)[1]
        frames = noise_frames(4, seed=8)
        audio = [frame.astype("<f4").tobytes() for frame in frames]
        nan = np.full(FRAME, np.nan, dtype="<f4").tobytes()
        messages = [audio[0], audio[1], json.dumps({"type": "ping"}), nan, audio[2], audio[3]]
        end, log = await run_socket_session(runtime, messages, wire, session_id=2)
    assert log.pongs == 1 and [e["code"] for e in log.errors] == ["invalid_audio"]
    assert end.reason == "stop" and end.frames_in == 4
    assert bytes(log.audio) == synthetic_wire(frames, 2, wire)


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
            client, outcome = start_socket_session(nursery, runtime, 1, protocol=protocol)
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


async def test_a_session_whose_messages_all_go_through_a_worker_thread_gets_all_its_output():
    """With ``offload = "always"`` (as with Opus, decoded on a worker thread) every message waits
    for a worker thread, and every batch goes out through the writer."""
    async with open_runtime(make_config("runtime.slots=1", "runtime.offload=always", *SYNTHETIC)) as runtime:
        messages, wire = pcm_workload("pcm_f32le", 4.5, seed=14)
        end, log = await run_socket_session(runtime, messages, wire, session_id=8)
        stats = runtime.statistics()
    frames = model_frames(messages, wire)
    assert end.reason == "stop" and bytes(log.audio) == synthetic_wire(frames, 8, wire)
    assert stats.handoffs.offloads > 0 and stats.frames.direct_batches == 0
