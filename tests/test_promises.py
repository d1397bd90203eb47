"""Promises the README makes about a session, each guarded by a test that fails when the line of
code keeping it is removed (checked by mutating that line; see docs/promises.md and
docs/mutation.md).

Real runtime, real scheduler thread, in-memory transports: no ``autojump_clock`` (a clock that
jumps while the scheduler thread works would fire timeouts), and no sleeps; quiescence is read
from the session's own counters.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import trio
import trio.testing

from conftest import FRAME, PATIENCE, backend_info, make_config
from duplexrt.backends.echo import EchoBackend
from duplexrt.protocols.realtime import RealtimeProtocol
from duplexrt.runtime import open_runtime
from duplexrt.transport import TransportClosed, memory_transport_pair


async def settle(session) -> None:
    """Wait until nothing more can happen on its own: every trio task is blocked and every frame
    the session submitted has come back from the scheduler thread (so no step is in flight)."""
    with trio.fail_after(PATIENCE):
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if session._delivered == session._submitted:
                return
            await trio.sleep(0.001)  # the scheduler thread is stepping: let it deliver


async def test_a_client_that_never_reads_stops_its_own_input_and_holds_bounded_memory():
    """README: "a client that stops reading stops its own input, not anyone else's" — a session
    holds at most inbox_depth + outbox_depth frames submitted and not yet sent.

    Guards the ``_in_flight >= _max_in_flight`` check in Session._submit: without it the reader
    takes all 200 frames and the outbox grows without bound (186 frames held, measured)."""
    inbox, outbox, sent_frames = 8, 8, 200
    config = make_config("runtime.slots=2", f"runtime.inbox_depth={inbox}",
                         f"runtime.outbox_depth={outbox}", "backend.name=synthetic")
    frame = np.full(FRAME, 0.25, dtype=np.float32).tobytes()
    async with open_runtime(config) as runtime:
        client, server = memory_transport_pair()
        sent = 0
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runtime.serve, server)

            async def flood() -> None:
                nonlocal sent
                try:
                    for _ in range(sent_frames):
                        await client.send(frame)
                        sent += 1
                except TransportClosed:
                    pass

            nursery.start_soon(flood)
            with trio.fail_after(PATIENCE):
                while not runtime.sessions:
                    await trio.sleep(0.001)
            (session,) = runtime.sessions
            await settle(session)
            held = session.frames_in - session.frames_out
            taken = session.frames_in
            outbox_len = len(session._outbox)
            await client.close(1000, "bye")
    assert held <= inbox + outbox, f"{held} frames held for a client that never reads"
    assert outbox_len <= inbox + outbox  # stepped, waiting for the blocked writer
    assert taken < sent_frames and sent < sent_frames  # the client's sends were stopped too
    assert taken > 0


class TextEcho(EchoBackend):
    """FAKE (a test hook on the real echo model): every row also says one piece of text, the
    step's number, so the client can tell which piece went missing; and while ``gate`` is clear
    ``step`` waits on it (turn mode only hears what the model says after response.create)."""

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        import threading

        self.gate = threading.Event()
        self.steps = 0

    def step(self, rows, inputs, outputs):
        if not self.gate.wait(PATIENCE):
            raise RuntimeError("test gate never opened")
        super().step(rows, inputs, outputs)
        self.steps += 1
        return [f"<{self.steps}>" for _ in rows]


async def test_realtime_turn_carries_every_text_piece_including_the_last():
    """README (realtime): a response carries the model's audio and its transcript; the turn
    closes on its last audio.  Text goes to the translator before the audio of the same batch,
    so the last piece is inside the response, not dropped after response.done.

    Guards the text-before-audio order in Session._write_loop."""
    frames = 4
    config = make_config("backend.options.delay_frames=0", "runtime.slots=2")
    backend = TextEcho(config)
    pcm = (np.sin(np.arange(frames * FRAME) / 7.0) * 8000).astype("<i2").tobytes()
    client_end, server_end = memory_transport_pair()
    events: list[dict] = []
    done = trio.Event()
    created = trio.Event()
    try:
        async with open_runtime(config, backend) as runtime:
            async def receive() -> None:
                try:
                    while True:
                        event = json.loads(await client_end.receive())
                        events.append(event)
                        if event["type"] == "response.created":
                            created.set()
                        if event["type"] == "response.done":
                            done.set()
                except TransportClosed:
                    pass

            async def send(kind: str, **fields) -> None:
                await client_end.send(json.dumps({"type": kind, **fields}))

            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(runtime.serve, server_end, RealtimeProtocol())
                    nursery.start_soon(receive)
                    await send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                    await send("input_audio_buffer.commit")
                    await send("response.create")
                    await created.wait()
                    backend.gate.set()
                    await done.wait()
                    await client_end.close()
    finally:
        backend.gate.set()
    pieces = [e["delta"] for e in events if e["type"] == "response.output_audio_transcript.delta"]
    assert pieces == [f"<{k}>" for k in range(1, frames + 1)]
    kinds = [e["type"] for e in events]
    last_text = max(i for i, kind in enumerate(kinds) if kind == "response.output_audio_transcript.delta")
    assert last_text < kinds.index("response.done")
    [transcript_done] = [e for e in events if e["type"] == "response.output_audio_transcript.done"]
    assert transcript_done["transcript"] == "".join(pieces)
    [response_done] = [e for e in events if e["type"] == "response.done"]
    usage = response_done["response"]["usage"]
    assert usage["output_token_details"] == {"audio_tokens": frames, "text_tokens": frames}


async def test_realtime_turn_reply_said_before_response_create_is_not_lost():
    """README (realtime, turn mode): a response answers all the input submitted so far.  A fast
    model may have said its whole answer before the client's response.create arrives; that
    audio is held and becomes the response's first deltas.  The order is forced, not raced:
    response.create is sent only once every frame has been stepped and handed to the translator.
    (tests/test_client.py's turn test once repeated itself five times to hit this order.)"""
    frames = 3
    config = make_config("backend.options.delay_frames=0", "runtime.slots=2")
    pcm = (np.sin(np.arange(frames * FRAME) / 5.0) * 9000).astype("<i2").tobytes()
    client_end, server_end = memory_transport_pair()
    events: list[dict] = []
    done = trio.Event()
    async with open_runtime(config) as runtime:
        async def receive() -> None:
            try:
                while True:
                    event = json.loads(await client_end.receive())
                    events.append(event)
                    if event["type"] == "response.done":
                        done.set()
            except TransportClosed:
                pass

        async def send(kind: str, **fields) -> None:
            await client_end.send(json.dumps({"type": kind, **fields}))

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.serve, server_end, RealtimeProtocol())
                nursery.start_soon(receive)
                await send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                await send("input_audio_buffer.commit")
                while not runtime.sessions:
                    await trio.sleep(0.001)
                (session,) = runtime.sessions
                while session.frames_in < frames:
                    await trio.sleep(0.001)
                await settle(session)
                assert session.frames_answered == frames  # all said, none of it sent yet
                assert not [e for e in events if e["type"] == "response.output_audio.delta"]
                await send("response.create")
                await done.wait()
                await client_end.close()
    heard = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert heard == pcm
    [response_done] = [e for e in events if e["type"] == "response.done"]
    assert response_done["response"]["status"] == "completed"
    assert response_done["response"]["usage"]["output_token_details"]["audio_tokens"] == frames
