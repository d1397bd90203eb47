"""Whole OpenAI Realtime sessions through the real runtime and the echo model, over the in-memory
transport: what the translator's plain-call tests (test_protocol_realtime.py) cannot show, the
session and the translator together (turn boundaries, held audio across a format switch, a
client that never reads)."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import threading
from functools import partial

import attrs
import numpy as np
import trio
import trio.testing

from conftest import PATIENCE, backend_info, wait_until
from duplexrt.audio import AudioSpec, make_decoder, make_encoder
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import load_config
from duplexrt.runtime import open_runtime
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.wire.transport import MemoryTransport, TransportClosed, memory_transport_pair
from realtime_helpers import (
    FRAME,
    MODEL_RATE,
    PCM_FRAME_BYTES,
    SCAFFOLD,
    ULAW_FRAME_BYTES,
    b64,
    both_namings,
    names,
    usage,
)
from realtime_schema import every_server_event_is_checked  # noqa: F401  (autouse)


class GatedEcho(EchoBackend):
    """FAKE (a test hook on the real echo model): while ``gate`` is clear, ``step`` waits on it.

    In turn mode the client hears only what the model outputs after ``response.create``; the echo
    model answers within a millisecond, so without the gate how much of the answer the response
    would carry depends on thread timing.  The test holds the model until ``response.created``
    has come back, then lets it run: bit for bit the echo model otherwise.
    """

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        self.gate = threading.Event()

    def step(self, rows, inputs, outputs):
        if not self.gate.wait(PATIENCE):
            raise RuntimeError("test gate never opened")
        return super().step(rows, inputs, outputs)


@attrs.define
class RealtimeClient:
    """A Realtime client over the in-memory transport: sends events, files every server event."""

    transport: MemoryTransport
    events: list[dict] = attrs.Factory(list)
    closed: TransportClosed | None = None
    _ids: itertools.count = attrs.Factory(lambda: itertools.count(1))
    _lot: trio.lowlevel.ParkingLot = attrs.Factory(trio.lowlevel.ParkingLot)

    async def send(self, kind: str, **fields) -> str:
        event_id = fields.pop("event_id", f"evt_client_{next(self._ids)}")
        await self.transport.send(json.dumps({"type": kind, "event_id": event_id, **fields}))
        return event_id

    async def receive_all(self) -> None:
        while True:
            try:
                message = await self.transport.receive()
            except TransportClosed as closed:
                self.closed = closed
                self._lot.unpark_all()
                return
            assert isinstance(message, str), "the Realtime protocol sends only text"
            self.events.append(json.loads(message))
            self._lot.unpark_all()

    async def wait_for(self, kind: str, count: int = 1) -> dict:
        with trio.fail_after(PATIENCE):
            while sum(e["type"] == kind for e in self.events) < count:
                assert self.closed is None, f"closed while waiting for {kind}: {self.closed}"
                await self._lot.park()
        return [e for e in self.events if e["type"] == kind][count - 1]

    async def wait_closed(self) -> TransportClosed:
        with trio.fail_after(PATIENCE):
            while self.closed is None:
                await self._lot.park()
        return self.closed

    def audio(self, beta: bool = False) -> bytes:
        kind = names(beta)["delta"]
        return b"".join(base64.b64decode(e["delta"]) for e in self.events if e["type"] == kind)

    def of_type(self, kind: str) -> list[dict]:
        return [e for e in self.events if e["type"] == kind]


def tones(samples: int, rate: int) -> np.ndarray:
    t = np.arange(samples) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * np.sin(2 * np.pi * 1250 * t)).astype(np.float32)


def encode(signal: np.ndarray, spec: AudioSpec) -> bytes:
    encoder = make_encoder(spec, spec.sample_rate)
    return encoder.encode(signal) + encoder.flush()


def best_alignment(sent: np.ndarray, heard: np.ndarray, max_lag: int) -> tuple[int, float]:
    """The lag (samples ``heard`` runs behind ``sent``) and the correlation there."""
    best = (0, -1.0)
    for lag in range(max_lag):
        a = sent[: len(heard) - lag]
        b = heard[lag: lag + len(a)]
        corr = float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))
        if corr > best[1]:
            best = (lag, corr)
    return best


@both_namings
async def test_turn_session_in_pcmu_echoes_the_committed_audio(beta):
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    backend = GatedEcho(config)
    ulaw = AudioSpec.create("g711_ulaw", model_rate=MODEL_RATE)
    frames = 6
    sent = encode(tones(frames * ULAW_FRAME_BYTES, 8000), ulaw)
    assert len(sent) == frames * ULAW_FRAME_BYTES
    chunks = [sent[:1280], sent[1280:1920], sent[1920:]]  # whole frames, unevenly grouped
    # The frames the session will have submitted when response.create arrives: the 8 -> 24 kHz
    # resampler holds a few samples back, so the last partial frame waits in the framer.
    decoder = make_decoder(ulaw, MODEL_RATE)
    expected_frames = sum(len(decoder.decode(c)) for c in chunks) // FRAME
    assert expected_frames in (frames - 1, frames)

    client_end, server_end = memory_transport_pair()
    client = RealtimeClient(client_end)
    result = {}
    try:
        async with open_runtime(config, backend) as runtime:
            async def serve() -> None:
                result["end"] = await runtime.serve(server_end, RealtimeTranslator(beta=beta))

            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(serve)
                    nursery.start_soon(client.receive_all)
                    await client.wait_for("session.created")
                    format_update = ({"input_audio_format": "g711_ulaw", "output_audio_format": "g711_ulaw"}
                                     if beta else
                                     {"type": "realtime", "audio": {"input": {"format": {"type": "audio/pcmu"}},
                                                                    "output": {"format": {"type": "audio/pcmu"}}}})
                    await client.send("session.update", session=format_update)
                    updated = await client.wait_for("session.updated")
                    await client.send("input_audio_buffer.append", audio=b64(chunks[0]))
                    bad = await client.send("transcription_session.update", session={})
                    await client.send("input_audio_buffer.append", audio=b64(chunks[1]))
                    bad_audio = await client.send("input_audio_buffer.append", audio="%%%")
                    await client.send("input_audio_buffer.append", audio=b64(chunks[2]))
                    await client.send("input_audio_buffer.commit")
                    await client.send("response.create")
                    created = await client.wait_for("response.created")
                    backend.gate.set()
                    done = await client.wait_for("response.done")
                    await client_end.close()
                    await client.wait_closed()
    finally:
        backend.gate.set()

    if beta:
        assert updated["session"]["input_audio_format"] == "g711_ulaw"
    else:
        assert updated["session"]["audio"]["input"]["format"] == {"type": "audio/pcmu"}
    errors = client.of_type("error")
    assert [(e["error"]["code"], e["error"]["event_id"]) for e in errors] == [
        ("unsupported_event", bad), ("invalid_base64", bad_audio)]
    [committed] = client.of_type("input_audio_buffer.committed")
    assert committed["previous_item_id"] is None

    response = done["response"]
    assert response["id"] == created["response"]["id"]
    assert response["status"] == "completed"
    assert response["usage"] == usage(expected_frames, expected_frames)
    assert client.of_type(names(beta)["done"])[0]["response_id"] == response["id"]
    kinds = [e["type"] for e in client.events]
    assert kinds.index("response.created") < kinds.index(names(beta)["delta"])
    assert kinds[-1] == "response.done"

    heard = client.audio(beta)
    # The 24 -> 8 kHz encoder holds its filter delay back until the stream ends (tens of samples).
    assert expected_frames * ULAW_FRAME_BYTES - 400 <= len(heard) <= expected_frames * ULAW_FRAME_BYTES
    # Same signal, delayed by the two resamplers (a few ms) and quantised twice by mu-law.
    sent_audio = make_decoder(ulaw, 8000).decode(sent)
    heard_audio = make_decoder(ulaw, 8000).decode(heard)
    lag, corr = best_alignment(sent_audio, heard_audio, 200)
    assert lag <= 2 and corr > 0.995, (lag, corr)
    assert result["end"].reason == "client_closed"
    assert result["end"].frames_out == expected_frames


async def test_duplex_session_in_pcm16_echoes_every_byte():
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    pcm = AudioSpec.create("pcm_s16le", 24000, model_rate=MODEL_RATE)
    frames = 7
    sent = encode(tones(frames * FRAME, MODEL_RATE), pcm)
    cuts = [0, 1000, 5002, 9000, 13000, 20000, len(sent)]  # even, but not on frame boundaries
    client_end, server_end = memory_transport_pair()
    client = RealtimeClient(client_end)
    result = {}
    async with open_runtime(config) as runtime:
        async def serve() -> None:
            result["end"] = await runtime.serve(server_end, RealtimeTranslator(duplex=True))

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(client.receive_all)
                created = await client.wait_for("response.created")
                for start, stop in itertools.pairwise(cuts):
                    await client.send("input_audio_buffer.append", audio=b64(sent[start:stop]))
                while len(client.audio()) < len(sent):
                    await client.wait_for(names(False)["delta"], len(client.of_type(names(False)["delta"])) + 1)
                await client.send("response.cancel")
                done = await client.wait_for("response.done")
                await client_end.close()
                await client.wait_closed()

    assert client.audio() == sent  # pcm16 at the model rate: exact
    assert done["response"]["id"] == created["response"]["id"]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["usage"] == usage(frames, frames)
    assert client.of_type("error") == []
    assert result["end"].reason == "client_closed"


async def test_a_binary_message_ends_the_session_with_1003():
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    client_end, server_end = memory_transport_pair()
    client = RealtimeClient(client_end)
    result = {}
    async with open_runtime(config) as runtime:
        async def serve() -> None:
            result["end"] = await runtime.serve(server_end, RealtimeTranslator(duplex=True))

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(client.receive_all)
                await client.wait_for("response.created")
                await client_end.send(b"\x00\x01")
                closed = await client.wait_closed()

    assert closed.code == 1003
    kinds = [e["type"] for e in client.events if e["type"] not in SCAFFOLD]
    assert kinds == ["session.created", "response.created", "error", "response.done"]
    assert client.of_type("error")[0]["error"]["code"] == "binary_not_supported"
    assert client.of_type("response.done")[0]["response"]["status"] == "failed"
    assert result["end"].reason == "error"


# -- hardening: cancelled answers, turn boundaries, format switches, unread replies -----------------


@contextlib.asynccontextmanager
async def realtime_session(config, backend=None, *, read: bool = True, **options):
    """One Realtime session on a real runtime: yields the client, the server's session and the
    nursery (to start the client's reader later when ``read`` is False).  Hangs up at the end."""
    client_end, server_end = memory_transport_pair()
    client = RealtimeClient(client_end)
    try:
        async with open_runtime(config, backend) as runtime:
            with trio.fail_after(PATIENCE):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(runtime.serve, server_end, RealtimeTranslator(**options))
                    if read:
                        nursery.start_soon(client.receive_all)
                    await wait_until(lambda: len(runtime.sessions) == 1, "the session started")
                    (session,) = runtime.sessions
                    yield client, session, nursery
                    await client_end.close()
                    if client.closed is None and read:
                        await client.wait_closed()
                    nursery.cancel_scope.cancel()
    finally:
        if isinstance(backend, GatedEcho):
            backend.gate.set()


def numbered_frames(count: int, start: int = 0) -> list[bytes]:
    """pcm16 frames at the model rate, each a different constant: the echo model returns them
    bit for bit, so every byte a response carries names the frame it came from."""
    return [np.full(FRAME, 1000 * (k + 1), dtype="<i2").tobytes() for k in range(start, start + count)]


def deltas_of(client: RealtimeClient, response_id: str) -> bytes:
    return b"".join(base64.b64decode(e["delta"]) for e in client.of_type(names(False)["delta"])
                    if e["response_id"] == response_id)


async def test_a_cancelled_answer_is_never_sent_later():
    """response.cancel: the model still produces the rest of that answer; it is dropped, not held
    and replayed as the start of the next response (it once was)."""
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    backend = GatedEcho(config)
    frames = numbered_frames(8)
    async with realtime_session(config, backend) as (client, session, _):
        for frame in frames[:6]:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await wait_until(lambda: session.frames_in == 6, "six frames submitted")
        await client.send("response.create")
        first = (await client.wait_for("response.created"))["response"]["id"]
        await client.send("response.cancel")
        cancelled = await client.wait_for("response.done")
        backend.gate.set()  # the model now answers all six frames: the cancelled answer
        await wait_until(lambda: session.frames_answered == 6, "the cancelled answer went through")
        for frame in frames[6:]:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await wait_until(lambda: session.frames_answered == 8, "the next answer came out")
        await client.send("response.create")
        second = (await client.wait_for("response.created", 2))["response"]["id"]
        done = await client.wait_for("response.done", 2)

    assert cancelled["response"]["id"] == first
    assert cancelled["response"]["status"] == "cancelled"
    assert cancelled["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert deltas_of(client, first) == b""
    assert done["response"]["id"] == second and done["response"]["status"] == "completed"
    assert deltas_of(client, second) == frames[6] + frames[7]  # exactly its own two frames
    assert client.audio() == frames[6] + frames[7]
    assert done["response"]["usage"]["output_token_details"]["audio_tokens"] == 2


async def test_a_batch_crossing_the_end_of_a_turn_is_split_between_the_responses():
    """A client that reads late finds six frames waiting at once, three for the open response and
    three after its end: each response gets exactly its own (the first once got all six)."""
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    backend = GatedEcho(config)
    frames = numbered_frames(6)
    async with realtime_session(config, backend, read=False) as (client, session, nursery):
        for frame in frames[:3]:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await wait_until(lambda: session.frames_in == 3, "three frames submitted")
        await client.send("response.create")  # target: those three frames
        for frame in frames[3:]:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await client.send("input_audio_buffer.commit")  # a reply the writer blocks on: nobody reads
        await wait_until(lambda: session.frames_in == 6, "six frames submitted")
        backend.gate.set()
        await wait_until(lambda: len(session.writer.outbox) == 6, "all six outputs waiting for the writer")
        nursery.start_soon(client.receive_all)
        first = await client.wait_for("response.done")
        await wait_until(lambda: session.frames_answered == 6, "the rest held for the next response")
        await client.send("response.create")
        second = await client.wait_for("response.done", 2)

    assert first["response"]["status"] == second["response"]["status"] == "completed"
    assert deltas_of(client, first["response"]["id"]) == b"".join(frames[:3])
    assert deltas_of(client, second["response"]["id"]) == b"".join(frames[3:])
    for done in (first, second):
        assert done["response"]["usage"]["output_token_details"]["audio_tokens"] == 3
    kinds = [e["type"] for e in client.events]
    assert kinds.index("response.done") < kinds.index("response.created", kinds.index("response.created") + 1)


async def test_held_audio_after_a_switch_to_pcmu_is_sent_in_pcmu():
    """Turn mode holds the model's answer until response.create; the client switches the output
    from pcm16 to G.711 mu-law in between: what the response carries is mu-law (it once was the
    held pcm16 bytes)."""
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    pcm = AudioSpec.create("pcm_s16le", 24000, model_rate=MODEL_RATE)
    frames = 3
    sent = encode(tones(frames * FRAME, MODEL_RATE), pcm)
    async with realtime_session(config) as (client, session, _):
        await client.send("input_audio_buffer.append", audio=b64(sent))
        await wait_until(lambda: session.frames_answered == frames, "the answer is held")
        await client.send("session.update", session={
            "type": "realtime", "audio": {"output": {"format": {"type": "audio/pcmu"}}}})
        updated = await client.wait_for("session.updated")
        await client.send("response.create")
        done = await client.wait_for("response.done")

    assert updated["session"]["audio"]["output"]["format"] == {"type": "audio/pcmu"}
    kinds = [e["type"] for e in client.events]
    assert kinds.index("session.updated") < kinds.index(names(False)["delta"])
    heard = client.audio()
    # mu-law at 8 kHz: one byte a sample, the resampler's delay still held back.
    assert frames * ULAW_FRAME_BYTES - 600 <= len(heard) <= frames * ULAW_FRAME_BYTES
    lag, corr = best_alignment(tones(frames * ULAW_FRAME_BYTES, 8000), make_decoder(
        AudioSpec.create("g711_ulaw", model_rate=MODEL_RATE), 8000).decode(heard), 200)
    assert corr > 0.99, (lag, corr)
    assert done["response"]["usage"]["output_token_details"]["audio_tokens"] == frames


async def test_after_session_updated_every_delta_is_in_the_new_format():
    """Duplex, output mu-law then pcm16: the mu-law encoder's tail goes out before session.updated,
    and everything after it is pcm16 (the tail once came after it)."""
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    first, second = numbered_frames(3), numbered_frames(2, start=3)
    delta = names(False)["delta"]
    async with realtime_session(config, duplex=True) as (client, session, _):
        await client.send("session.update", session={"audio": {"output": {"format": "audio/pcmu"}}})
        await client.wait_for("session.updated")
        for frame in first:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await wait_until(lambda: session.frames_out == 3, "three frames out in mu-law")
        await client.send("session.update", session={"audio": {"output": {"format": "audio/pcm"}}})
        await client.wait_for("session.updated", 2)
        for frame in second:
            await client.send("input_audio_buffer.append", audio=b64(frame))
        await wait_until(lambda: session.frames_out == 5, "two frames out in pcm16")
        await client.send("input_audio_buffer.clear")  # its reply comes after everything sent
        await client.wait_for("input_audio_buffer.cleared")

    switch = max(i for i, e in enumerate(client.events) if e["type"] == "session.updated")
    before = [base64.b64decode(e["delta"]) for e in client.events[:switch] if e["type"] == delta]
    after = b"".join(base64.b64decode(e["delta"]) for e in client.events[switch:] if e["type"] == delta)
    assert after == b"".join(second)  # pcm16 at the model rate: the echo, bit for bit
    assert sum(map(len, before)) == 3 * ULAW_FRAME_BYTES  # the tail came before the announcement


async def test_a_client_that_never_reads_holds_bounded_memory_and_others_are_unaffected():
    """Large control messages from a client that never reads: every reply is short (client values
    are quoted short, ignored settings not echoed) and the queue of replies is bounded in bytes,
    while another session is served as usual."""
    from duplexrt.session import outgoing as session_module

    limit = getattr(session_module, "MAX_PENDING_BYTES", 1 << 20)
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    big = "x" * 100_000
    floods = [
        lambda k: {"type": "session.update", "event_id": big, "session": {f"key_{k}": big, "instructions": big}},
        lambda k: {"type": "response.cancel", "event_id": big, "response_id": big},
        lambda k: {"type": big, "event_id": big},
        lambda k: {"type": "session.update", "session": {"type": big}},
        lambda k: {"type": "session.update", "session": {"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                       "rate": big}}}}},
        lambda k: {"type": "session.update", "session": {"output_audio_format": big}},
    ]
    flood_end, flood_server = memory_transport_pair()
    other_end, other_server = memory_transport_pair()
    other = RealtimeClient(other_end)
    frames = numbered_frames(5)
    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(partial(runtime.serve, flood_server, RealtimeTranslator(), session_id=1))
                nursery.start_soon(partial(runtime.serve, other_server, RealtimeTranslator(duplex=True), session_id=2))
                nursery.start_soon(other.receive_all)
                await wait_until(lambda: len(runtime.sessions) == 2, "both sessions started")
                flooded = next(s for s in runtime.sessions if s.lease.session_id == 1)

                async def flood() -> None:
                    with contextlib.suppress(TransportClosed):
                        for k in range(600):
                            await flood_end.send(json.dumps(floods[k % len(floods)](k)))

                nursery.start_soon(flood)
                for frame in frames:
                    await other.send("input_audio_buffer.append", audio=b64(frame))
                while len(other.audio()) < len(frames) * PCM_FRAME_BYTES:
                    await other.wait_for(names(False)["delta"], len(other.of_type(names(False)["delta"])) + 1)
                await trio.testing.wait_all_tasks_blocked()  # the flood is stuck: nobody reads
                queued = list(flooded.outgoing.pending)
                await flood_end.close()
                await other_end.close()
                await other.wait_closed()

    assert len(queued) > 10  # the reader did stop on a full queue
    assert sum(len(m) for m in queued) <= limit + 4096
    assert max(len(m) for m in queued) < 2000
    assert other.audio() == b"".join(frames)
    assert other.of_type("error") == []
