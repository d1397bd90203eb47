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
from duplexrt.runtime import open_runtime
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.wire.transport import TransportClosed, memory_transport_pair


async def settle(session) -> None:
    """Wait until nothing more can happen on its own: every trio task is blocked and every frame
    the session submitted has come back from the scheduler thread (so no step is in flight)."""
    with trio.fail_after(PATIENCE):
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if session.credits.all_delivered:
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
            outbox_len = len(session.writer.outbox)
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

    Guards the text-before-audio order in Session._tell (the writer's and the delivery's)."""
    frames = 4
    config = make_config("backend.options.delay_frames=0", "runtime.slots=2")
    backend = TextEcho(config)
    pcm = (np.sin(np.arange(frames * FRAME) / 7.0) * 8000).astype("<i2").tobytes()
    client_end, server_end = memory_transport_pair()
    client = _RealtimeClient(client_end)
    client.reading.set()
    events = client.events
    try:
        async with open_runtime(config, backend) as runtime:
            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(runtime.serve, server_end, RealtimeTranslator())
                    nursery.start_soon(client.receive_all)
                    await client.send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                    await client.send("input_audio_buffer.commit")
                    await client.send("response.create")
                    await client.wait_for("response.created")
                    backend.gate.set()
                    await client.wait_for("response.done")
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
    client = _RealtimeClient(client_end)
    client.reading.set()
    events = client.events
    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.serve, server_end, RealtimeTranslator())
                nursery.start_soon(client.receive_all)
                await client.send("input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
                await client.send("input_audio_buffer.commit")
                while not runtime.sessions:
                    await trio.sleep(0.001)
                (session,) = runtime.sessions
                while session.frames_in < frames:
                    await trio.sleep(0.001)
                await settle(session)
                assert session.frames_answered == frames  # all said, none of it sent yet
                assert not [e for e in events if e["type"] == "response.output_audio.delta"]
                await client.send("response.create")
                await client.wait_for("response.done")
                await client_end.close()
    heard = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert heard == pcm
    [response_done] = [e for e in events if e["type"] == "response.done"]
    assert response_done["response"]["status"] == "completed"
    assert response_done["response"]["usage"]["output_token_details"]["audio_tokens"] == frames


class _RealtimeClient:
    """A minimal Realtime client over the in-memory transport: sends events, files what comes."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.events: list[dict] = []
        self.reading = trio.Event()  # until set, the client does not read (a stalled reader)
        self._lot = trio.lowlevel.ParkingLot()

    async def send(self, kind: str, **fields) -> None:
        await self.transport.send(json.dumps({"type": kind, **fields}))

    async def receive_all(self) -> None:
        await self.reading.wait()
        try:
            while True:
                self.events.append(json.loads(await self.transport.receive()))
                self._lot.unpark_all()
        except TransportClosed:
            self._lot.unpark_all()

    async def wait_for(self, kind: str) -> dict:
        with trio.fail_after(PATIENCE):
            while not any(e["type"] == kind for e in self.events):
                await self._lot.park()
        return next(e for e in self.events if e["type"] == kind)

    def audio(self) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in self.events
                        if e["type"] == "response.output_audio.delta")


async def test_realtime_input_clear_drops_the_partial_frame_and_the_session_goes_on():
    """README (realtime): ``input_audio_buffer.clear`` drops what the server holds of the input
    not yet made into frames; the session goes on with the next audio, and the client is told
    (``input_audio_buffer.cleared``)."""
    config = make_config("backend.options.delay_frames=0", "runtime.slots=2")
    rng = np.random.default_rng(7)
    half = (rng.standard_normal(FRAME // 2) * 3000).astype("<i2").tobytes()
    whole = (rng.standard_normal(2 * FRAME) * 3000).astype("<i2").tobytes()
    client_end, server_end = memory_transport_pair()
    client = _RealtimeClient(client_end)
    client.reading.set()
    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.serve, server_end, RealtimeTranslator(duplex=True))
                nursery.start_soon(client.receive_all)
                await client.wait_for("response.created")
                await client.send("input_audio_buffer.append", audio=base64.b64encode(half).decode())
                await client.send("input_audio_buffer.clear")
                await client.wait_for("input_audio_buffer.cleared")
                await client.send("input_audio_buffer.append", audio=base64.b64encode(whole).decode())
                (session,) = runtime.sessions
                while session.frames_in < 2:
                    await trio.sleep(0.001)
                await settle(session)
                await client.send("response.cancel")
                done = await client.wait_for("response.done")
                await client_end.close()
    assert client.audio() == whole  # the half frame before the clear is gone, nothing else
    assert done["response"]["usage"]["input_tokens"] == 2
    assert [e for e in client.events if e["type"] == "error"] == []


async def test_realtime_output_clear_drops_what_is_waiting_and_keeps_the_accounts():
    """README (realtime): ``output_audio_buffer.clear`` drops the model's output not yet sent;
    what was dropped counts as answered (so turn accounting stays right), frees the session's
    credits, and the session goes on.  Forced, not raced: the client does not read until the
    clear, so the writer is blocked with stepped output waiting behind it."""
    frames = 6
    config = make_config("backend.options.delay_frames=0", "runtime.slots=2")
    pcm = (np.random.default_rng(8).standard_normal(frames * FRAME) * 3000).astype("<i2").tobytes()
    client_end, server_end = memory_transport_pair()
    client = _RealtimeClient(client_end)
    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(runtime.serve, server_end, RealtimeTranslator(duplex=True))
                nursery.start_soon(client.receive_all)
                first = 2 * FRAME  # one frame of pcm16: the writer takes it and blocks sending it
                await client.send("input_audio_buffer.append", audio=base64.b64encode(pcm[:first]).decode())
                while not runtime.sessions:
                    await trio.sleep(0.001)
                (session,) = runtime.sessions
                while session.frames_in < 1:
                    await trio.sleep(0.001)
                await settle(session)
                await client.send("input_audio_buffer.append", audio=base64.b64encode(pcm[first:]).decode())
                while session.frames_in < frames:
                    await trio.sleep(0.001)
                await settle(session)
                waiting = len(session.writer.outbox)
                assert waiting > 0  # stepped, not sent: the writer is blocked on the client
                await client.send("output_audio_buffer.clear")
                await settle(session)
                assert len(session.writer.outbox) == 0
                client.reading.set()
                await client.wait_for("output_audio_buffer.cleared")
                await settle(session)
                assert session.frames_answered == session.frames_in == frames
                assert session.credits.in_flight == 0  # every frame sent or dropped: all credits back
                await client.send("response.cancel")
                await client.wait_for("response.done")
                await client_end.close()
    heard = client.audio()
    assert len(heard) == (frames - waiting) * FRAME * 2  # what was not dropped was heard
    assert heard == pcm[:len(heard)]


async def test_a_session_whose_own_code_fails_ends_with_1011_and_harms_no_other():
    """Standards: bad input or a bug in one session gives a clear end, never a crash, a held
    slot or harm to other sessions.  FAKE: a translator that raises on one message, as a bug
    would; the session ends with reason ``error`` ("internal error", close 1011), its slot is
    freed, and a concurrent session is served to the end."""
    from duplexrt.protocols.raw import RawTranslator

    class Exploding(RawTranslator):
        def parse(self, message):
            if message == "boom":
                raise ValueError("a bug in the translator")
            return super().parse(message)

    config = make_config("runtime.slots=2", "backend.options.delay_frames=0")
    frame = np.full(FRAME, 0.5, dtype=np.float32).tobytes()
    async with open_runtime(config) as runtime:
        wire = runtime.audio_spec()
        bad_client, bad_server = memory_transport_pair()
        good_client, good_server = memory_transport_pair()
        ends = {}
        got: dict[str, list] = {"bad": [], "good": []}

        async def serve(name, transport, protocol) -> None:
            try:
                ends[name] = await runtime.serve(transport, protocol)
            except* ValueError:  # handed to the caller to log (the server's handler does)
                ends[name] = "raised"

        async def client(name, transport, messages) -> None:
            for message in messages:
                await transport.send(message)
            try:
                while True:
                    got[name].append(await transport.receive())
            except TransportClosed as closed:
                got[name].append(closed)

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve, "bad", bad_server, Exploding(wire))
                nursery.start_soon(serve, "good", good_server, RawTranslator(wire))
                nursery.start_soon(client, "bad", bad_client, [frame, "boom", frame])
                nursery.start_soon(client, "good", good_client, [frame, frame, json.dumps({"type": "input.end"})])
        assert runtime.scheduler.free_slots == 2 and runtime.sessions == set()
    closed = got["bad"][-1]
    assert closed.code == 1011
    [end] = [json.loads(m) for m in got["bad"] if isinstance(m, str) and '"session.end"' in m]
    assert end["reason"] == "error" and end["error"] == "internal error"
    assert ends == {"bad": "raised", "good": ends["good"]} and ends["good"].reason == "stop"
    assert got["good"][-1].code == 1000
    assert b"".join(m for m in got["good"] if isinstance(m, bytes)) == frame * 2
