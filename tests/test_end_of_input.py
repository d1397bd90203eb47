"""End of input for translation models: Hibiki's end-of-stream codes, then silence, after the
caller's last frame, so that its output holds the whole translation.

The tiny seeded Moshi stands in for Hibiki (``backend.options.flush_frames`` opts it in).  Every
end of input a client can give triggers the flush: ``input.end`` on /v1/duplex, a commit in the
Realtime protocol's turn mode, endTurn on /api/chat.  The echo and synthetic backends take no
flush (``flush_frames`` 0): their sessions are exactly as before, which their own tests check.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
import sphn
import trio

from conftest import PATIENCE, run_session, wait_until, duplex_session
from duplexrt.backends.base import BackendInfo, SlotSession
from duplexrt.config import ConfigError, load_config
from duplexrt.runtime import open_runtime
from duplexrt.protocols.events import SessionEnd
from duplexrt.protocols.moshi import MoshiTranslator
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.wire.transport import TransportClosed, memory_transport_pair

pytest.importorskip("moshi")

from duplexrt.backends.moshi import MoshiBackend  # noqa: E402
from duplexrt.backends.moshi.backend import HIBIKI_FLUSH_FRAMES  # noqa: E402

FRAME = 1920
RATE = 24000
FLUSH = 4
TINY = Path(__file__).resolve().parent.parent / "configs" / "moshi-tiny.toml"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def signal(seed: int, frames: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


def tiny_backend(slots: int, **options) -> MoshiBackend:
    b = MoshiBackend(BackendInfo(name="moshi", sample_rate=RATE, frame_size=FRAME, slots=slots),
                     {"tiny": True, "warmup_steps": 1, **options})
    b.load()
    return b


def tiny_config(*overrides: str):
    return load_config(TINY, ["runtime.slots=1", "runtime.gather_window_ms=1", "backend.options.warmup_steps=1",
                              f"backend.options.flush_frames={FLUSH}", "runtime.late_input=wait", *overrides])


# -- the backend ----------------------------------------------------------------------------------


def test_flush_frames_default_from_the_model_type_and_can_be_set():
    plain = tiny_backend(1)
    assert plain.info.flush_frames == 0, "Moshi answers as it hears: nothing to flush"
    assert tiny_backend(1, flush_frames=3).info.flush_frames == 3
    guided = tiny_backend(1, cfg_coef=2.0)  # the tiny model with Hibiki's conditioning
    assert guided.description["model_type"] == "hibiki"
    assert guided.info.flush_frames == HIBIKI_FLUSH_FRAMES


@pytest.mark.parametrize("value", [-1, 1.5, True, "75", 10001])
def test_a_bad_flush_frames_names_its_key(value):
    with pytest.raises(ConfigError, match="backend.options.flush_frames"):
        MoshiBackend(BackendInfo(name="moshi", sample_rate=RATE, frame_size=FRAME, slots=1),
                     {"tiny": True, "flush_frames": value})


def _run(b: MoshiBackend, a_frames: np.ndarray, b_frames: np.ndarray, mark: int | None
         ) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Slots 0 and 1 stepped together through their frames, fresh sessions 5 and 6; before step
    ``mark`` slot 0 is told its input ended.  Returns both slots' outputs and slot 0's text."""
    b.open_slot(0, SlotSession(5))
    b.open_slot(1, SlotSession(6))
    rows = np.array([0, 1], dtype=np.int64)
    outs, texts = [], []
    for k in range(len(a_frames)):
        if k == mark:
            b.end_input(0)
        out = np.full((2, FRAME), np.nan, dtype=np.float32)
        texts.append(b.step(rows, np.stack([a_frames[k], b_frames[k]]), out)[0])
        outs.append(out)
    b.close_slot(0)
    b.close_slot(1)
    both = np.stack(outs)
    return both[:, 0], both[:, 1], texts


def test_end_input_feeds_the_end_of_stream_codes_on_that_step_of_that_row_only():
    """The same session twice, its input ending in silence: told of the end at the first silent
    step, its output is the same up to there and differs after (the model heard the end-of-stream
    codes, not silence); the row stepped beside it hears nothing of it, bit for bit."""
    b = tiny_backend(2, greedy=True)
    speech = 4
    a_frames = np.concatenate([signal(1, speech), np.zeros((8, FRAME), np.float32)])
    b_frames = signal(2, len(a_frames))
    plain_a, plain_b, plain_text = _run(b, a_frames, b_frames, None)
    again_a, again_b, _ = _run(b, a_frames, b_frames, None)
    assert np.array_equal(plain_a, again_a) and np.array_equal(plain_b, again_b), "the runs must repeat"
    ended_a, ended_b, ended_text = _run(b, a_frames, b_frames, speech)
    assert np.array_equal(ended_a[:speech], plain_a[:speech])
    assert not np.array_equal(ended_a[speech:], plain_a[speech:]) or ended_text != plain_text
    assert np.array_equal(ended_b, plain_b), "another row's step changed"
    b.close()


# -- /v1/duplex: input.end ------------------------------------------------------------------------


async def test_input_end_on_v1_duplex_gets_the_flush_and_ends_with_stop(nursery):
    from duplexrt.server import Server

    server = Server(tiny_config("server.port=0"))
    await nursery.start(server.run)
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex?format=pcm_f32le"
    caller = 5
    audio = signal(3, caller).reshape(-1)[:-FRAME // 2]  # the last frame is half a frame
    with trio.fail_after(PATIENCE * 2):
        received, events = await duplex_session(url, audio, chunk=len(audio))  # one message
    closed = events.pop()
    assert closed["code"] == 1000
    end = events[-1]
    assert end["type"] == "session.end" and end["reason"] == "stop"
    usage = end["usage"]
    assert (usage["frames_in"], usage["frames_flushed"], usage["frames_out"]) == (caller, FLUSH, caller + FLUSH)
    assert usage["seconds_in"] == pytest.approx(caller * 0.08)
    assert len(received) == (caller + FLUSH) * FRAME * 4, "one output frame per frame, flush included"


async def test_the_flush_starts_with_the_end_mark_on_the_step_after_the_last_frame():
    """The same session (same slot, same sampling stream) twice: its input, then the flush; its
    input and as much silence, then the flush.  Up to the end of the input the two are the same
    bit for bit; on the next frames only the first heard the end-of-stream codes."""
    caller = 4
    frames = signal(5, caller)
    async with open_runtime(tiny_config()) as runtime:
        wire = runtime.audio_spec("pcm_f32le")
        flushed = await run_session(runtime, [frames.tobytes()], wire, session_id=7)
        padded = await run_session(runtime, [frames.tobytes(), np.zeros(FLUSH * FRAME, np.float32).tobytes()],
                                   wire, session_id=7)
    a = np.frombuffer(bytes(flushed.client.audio), np.float32).reshape(-1, FRAME)
    b = np.frombuffer(bytes(padded.client.audio), np.float32).reshape(-1, FRAME)
    assert (len(a), len(b)) == (caller + FLUSH, caller + 2 * FLUSH)
    assert np.array_equal(a[:caller], b[:caller])
    assert not np.array_equal(a[caller:], b[caller:caller + FLUSH]), "the model never heard the end mark"
    assert flushed.end.frames_flushed == padded.end.frames_flushed == FLUSH


# -- the Realtime protocol, turn mode: input_audio_buffer.commit --------------------------------


async def test_a_commit_in_turn_mode_feeds_the_flush_and_the_response_carries_it():
    caller = 6  # five whole frames and a half one: the commit submits the framer's tail too
    pcm16 = (signal(4, caller).reshape(-1)[:-FRAME // 2] * 8000).astype("<i2").tobytes()
    ended: list[SessionEnd] = []
    async with open_runtime(tiny_config()) as runtime:
        client, server = memory_transport_pair()

        async def serve() -> None:
            ended.append(await runtime.serve(server, RealtimeTranslator()))

        audio = bytearray()
        done: dict | None = None
        with trio.fail_after(PATIENCE * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                for event in ({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16).decode()},
                              {"type": "input_audio_buffer.commit"}, {"type": "response.create"}):
                    await client.send(json.dumps(event))
                while done is None:
                    event = json.loads(await client.receive())
                    assert event["type"] != "error", event
                    if event["type"] == "response.output_audio.delta":
                        audio += base64.b64decode(event["delta"])
                    elif event["type"] == "response.done":
                        done = event
                await client.close()
    assert done["response"]["status"] == "completed"
    assert len(audio) == (caller + FLUSH) * FRAME * 2, "the response holds the flush's output"
    end = ended[0]
    assert (end.frames_in, end.frames_flushed, end.frames_out) == (caller, FLUSH, caller + FLUSH)


# -- /api/chat: endTurn ---------------------------------------------------------------------------


async def test_end_turn_on_api_chat_feeds_the_flush_and_the_session_goes_on():
    """The Moshi protocol has no end of input (a client that hangs up can hear nothing more), so
    its endTurn control message is the signal: the flush follows, and the session stays open."""
    t = np.arange(int(0.6 * RATE)) / RATE
    voice = (0.3 * np.sin(2 * np.pi * (220 * t + 150 * t * t))).astype(np.float32)
    writer = sphn.OpusStreamWriter(RATE)
    messages = [b"\x01" + data for start in range(0, len(voice), 960)
                if (data := writer.append_pcm(voice[start:start + 960]))]
    ended: list[SessionEnd] = []
    async with open_runtime(tiny_config()) as runtime:
        client, server = memory_transport_pair()

        async def serve() -> None:
            ended.append(await runtime.serve(server, MoshiTranslator()))

        async def drain() -> None:
            try:
                while True:
                    await client.receive()
            except TransportClosed:
                pass

        with trio.fail_after(PATIENCE * 2):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(drain)
                for message in messages:
                    await client.send(message)
                await client.send(b"\x03\x01")  # control: endTurn
                await wait_until(lambda: runtime.sessions, "the session is open")
                session = next(iter(runtime.sessions))
                await wait_until(lambda: session.frames_flushed == FLUSH and session.frames_out == session.frames_in,
                                 "the flush is fed and answered")
                await client.close()
    end = ended[0]
    assert end.reason == "client_closed"
    assert end.frames_flushed == FLUSH and end.frames_out == end.frames_in + FLUSH


async def test_the_flush_stops_at_the_sessions_frame_limit_with_reason_length():
    """The flush is model input: a session's frame limit bounds it like any frame."""
    caller = 3
    async with open_runtime(tiny_config("runtime.max_session_seconds=0.4")) as runtime:  # 5 frames
        run = await run_session(runtime, [signal(6, caller).tobytes()], runtime.audio_spec("pcm_f32le"))
    end = run.end
    assert end.reason == "length"
    assert (end.frames_in, end.frames_flushed, end.frames_out) == (caller, 2, caller + 2)
    assert len(run.client.audio) == (caller + 2) * FRAME * 4
