"""Caller transcripts on the routes, over real sockets on loopback: what a client receives is
the package's own inference's text, in the route's events, before the session's end."""

from __future__ import annotations

import numpy as np
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("moshi")

from conftest import PATIENCE  # noqa: E402
from realtime_schema import every_server_event_is_checked  # noqa: E402,F401  (autouse: the SDK checks every event)
from test_protocol_live import _converse, _server, check_sequence  # noqa: E402
from test_transcribe import FRAME, Reference, voice  # noqa: E402

TINY = ("transcriber.enabled=true", "transcriber.tiny=true")


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def pcm16(frames: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``frames`` as the pcm16 a client sends, and the float frames the model then steps."""
    wire = (np.clip(frames.reshape(-1), -1.0, 32767 / 32768) * 32768).round().astype("<i2")
    return wire.tobytes(), (wire.astype(np.float32) / 32768).reshape(-1, FRAME)


async def test_the_live_route_streams_the_callers_words_before_it_closes(nursery, reference):
    server = await _server(nursery, None, "backend.options.delay_frames=0", "runtime.slots=2",
                           "runtime.late_input=wait", *TINY)
    audio, frames = pcm16(voice(40, 10))
    with trio.fail_after(PATIENCE * 3):
        events = await _converse(f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions", audio)
    check_sequence(events)
    deltas = [e for e in events if e["type"] == "session.input_transcript.delta"]
    expected = reference.text(frames)
    assert [e["delta"] for e in deltas] == expected and expected
    # The caller's last words come before session.closed (the flush after session.close).
    assert events.index(deltas[-1]) < len(events) - 1
    delay_ms = 500
    assert [e["start_ms"] for e in deltas] == sorted(e["start_ms"] for e in deltas)
    assert all(e["end_ms"] - e["start_ms"] == 80 for e in deltas)
    assert all(e["start_ms"] <= 10 * 80 - delay_ms + 80 for e in deltas)
    # The mark that flushes it is one frame of the model's, not of the caller's.
    assert events[-1]["usage"]["frames_in"] == 10 and events[-1]["usage"]["frames_out"] == 11


# -- /v1/realtime ------------------------------------------------------------------------------


def _split_by_step(reference: Reference, audio: np.ndarray, cut: int) -> tuple[list[str], list[str]]:
    """The reference's pieces of ``audio`` (flushed at its end), those of the steps before
    ``cut`` and the rest."""
    table = reference.table
    texts = [table[t] for t in reference.tokens(audio)]
    return [t for t in texts[:cut] if t], [t for t in texts[cut:] if t]


async def test_the_realtime_route_transcribes_each_user_item_as_livekit_and_pipecat_read_it(start_server, reference):
    import json

    import trio_websocket

    from realtime_helpers import b64

    served = await start_server("runtime.slots=2", "realtime.turn_detection=none", *TINY)
    first, first_frames = pcm16(voice(41, 10))
    second, second_frames = pcm16(voice(42, 7))
    events: list[dict] = []

    async def until(kind: str, count: int = 1) -> None:
        while sum(e["type"] == kind for e in events) < count:
            events.append(json.loads(await ws.get_message()))

    with trio.fail_after(PATIENCE * 3):
        async with trio_websocket.open_websocket_url(served.url("/v1/realtime")) as ws:
            await until("session.created")
            await ws.send_message(json.dumps({"type": "session.update", "session": {
                "type": "realtime", "audio": {"input": {"transcription": {"model": "gpt-4o-mini-transcribe"},
                                                        "turn_detection": None}}}}))
            await until("session.updated")
            for audio in (first, second):
                for start in range(0, len(audio), 4800):  # 100 ms appends, as LiveKit sends
                    await ws.send_message(json.dumps({"type": "input_audio_buffer.append",
                                                      "audio": b64(audio[start:start + 4800])}))
                await ws.send_message(json.dumps({"type": "input_audio_buffer.commit"}))
                await until("input_audio_buffer.committed", 1 + (audio is second))
            await until("conversation.item.input_audio_transcription.completed", 2)
    kinds = [e["type"] for e in events]
    assert "error" not in kinds
    [updated] = [e for e in events if e["type"] == "session.updated"]
    assert updated["session"]["audio"]["input"]["transcription"] == {"model": "stt-tiny"}
    items = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    assert len(items) == 2
    # The caller's stream as the transcriber heard it: each commit flushed the delay's silence.
    model = reference.model
    silence = np.zeros((model.delay_frames, FRAME), dtype=np.float32)
    expected = _split_by_step(reference, np.concatenate([first_frames, silence, second_frames]),
                              len(first_frames) + model.delay_frames)
    for item, texts in zip(items, expected):
        deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"
                  and e["item_id"] == item]
        [completed] = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
                       and e["item_id"] == item]
        assert [d["delta"] for d in deltas] == texts and texts
        # What both plugins read: ids, content_index, text; completed after the last delta and
        # after the item itself was added (LiveKit attaches the transcript to it).
        assert all(d["content_index"] == 0 and d["event_id"] for d in deltas)
        assert completed["content_index"] == 0 and completed["event_id"]
        assert completed["transcript"] == "".join(texts).strip()
        assert completed["usage"]["type"] == "duration" and completed["usage"]["seconds"] > 0
        position = events.index(completed)
        assert all(events.index(d) < position for d in deltas)
        added = [i for i, e in enumerate(events) if e["type"] == "conversation.item.added" and e["item"]["id"] == item]
        assert added and added[0] < position


async def test_the_moshi_tiny_stt_preset_serves_the_callers_words_beside_the_models(nursery, reference):
    from pathlib import Path

    import torch

    preset = Path(__file__).resolve().parent.parent / "configs" / "moshi-tiny-stt.toml"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        server = await _server(nursery, preset, "runtime.slots=1", "backend.options.warmup_steps=1",
                               "runtime.late_input=wait")
        audio, frames = pcm16(voice(43, 8))
        with trio.fail_after(PATIENCE * 3):
            events = await _converse(f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions", audio)
    finally:
        torch.set_num_threads(threads)
    check_sequence(events)
    said = [e["delta"] for e in events if e["type"] == "session.input_transcript.delta"]
    assert said == reference.text(frames)  # the caller's, whatever the dialogue model said
    assert any(e["type"] == "session.output_transcript.delta" for e in events)


async def test_the_duplex_route_sends_input_text_before_its_end(start_server, reference):
    import json

    import trio_websocket

    served = await start_server("runtime.slots=2", *TINY)
    frames = np.clip(voice(44, 6), -1.0, 1.0)  # pcm_f32le: the server clips to full scale
    events: list[dict] = []
    with trio.fail_after(PATIENCE * 3):
        async with trio_websocket.open_websocket_url(served.url("/v1/duplex")) as ws:
            await ws.send_message(np.ascontiguousarray(frames, dtype="<f4").tobytes())
            await ws.send_message(json.dumps({"type": "input.end"}))
            try:
                while True:
                    message = await ws.get_message()
                    if isinstance(message, str):
                        events.append(json.loads(message))
            except trio_websocket.ConnectionClosed:
                pass
    said = [e for e in events if e["type"] == "input_text"]
    assert [e["text"] for e in said] == reference.text(frames)
    assert all(e["audio_ms"] == max(0.0, e["frame"] * 80 - 500) for e in said)
    assert events[-1]["type"] == "session.end" and events[-1]["usage"]["frames_flushed"] == 1


async def test_server_vad_items_get_their_words_and_complete_once_the_output_passes_them(start_server, reference):
    """LiveKit's default: server VAD finds the turns (real speech, espeak-ng), no client commit,
    so no flush: each item completes once the model's output is the delay past its end."""
    import json

    import trio_websocket

    import speech
    from realtime_helpers import b64

    talk = speech.speech_24k()  # int16 at 24 kHz, about four seconds
    silence = np.zeros(24000, dtype="<i2")
    wire = np.concatenate([silence[:12000], talk, silence, silence]).astype("<i2")
    wire = wire[:len(wire) // FRAME * FRAME]
    frames = (wire.astype(np.float32) / 32768).reshape(-1, FRAME)
    served = await start_server("runtime.slots=2", *TINY)
    events: list[dict] = []
    with trio.fail_after(PATIENCE * 3):
        async with trio_websocket.open_websocket_url(served.url("/v1/realtime")) as ws:
            finished = trio.Event()

            def every_committed_item_is_complete() -> bool:
                committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
                done = [e["item_id"] for e in events
                        if e["type"] == "conversation.item.input_audio_transcription.completed"]
                return bool(committed) and sorted(done) == sorted(committed)

            async def receive() -> None:
                while True:
                    events.append(json.loads(await ws.get_message()))
                    if events[-1]["type"].endswith(".completed") and every_committed_item_is_complete():
                        finished.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(receive)
                await ws.send_message(json.dumps({"type": "session.update", "session": {
                    "type": "realtime", "audio": {"input": {"transcription": {"model": "whisper-1"}}}}}))
                data = wire.tobytes()
                for start in range(0, len(data), 4800):
                    await ws.send_message(json.dumps({"type": "input_audio_buffer.append",
                                                      "audio": b64(data[start:start + 4800])}))
                await finished.wait()
                nursery.cancel_scope.cancel()
    committed = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.committed"]
    assert not [e for e in events if e["type"] == "error"]
    started = [e["item_id"] for e in events if e["type"] == "input_audio_buffer.speech_started"]
    assert committed and set(committed) <= set(started)
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas and {d["item_id"] for d in deltas} <= set(committed)
    # The words, item after item, are the reference's from the start of the call.
    expected = reference.text(frames, flush=False)
    assert [d["delta"] for d in deltas] == expected[:len(deltas)]
    for item in committed:
        [completed] = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"
                       and e["item_id"] == item]
        mine = [d for d in deltas if d["item_id"] == item]
        assert all(events.index(d) < events.index(completed) for d in mine)
        assert completed["transcript"] == "".join(d["delta"] for d in mine).strip()
