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


# -- /api/chat ---------------------------------------------------------------------------------


async def _moshi_call(url: str, frames: np.ndarray, steps: int) -> tuple[list[bytes], np.ndarray]:
    """A Moshi client's call: ``frames`` as Ogg Opus (sphn, as Kyutai's clients send it), held
    open until the echo's audio says the server has stepped ``steps`` frames (the protocol has no
    end of input: a client that hangs up earlier hears no more).  Returns every message received
    and the frames the server decoded from the Opus stream (the same decoder, the same bytes)."""
    import sphn
    import trio_websocket

    from test_protocol_moshi import RATE

    writer = sphn.OpusStreamWriter(RATE)
    payloads = [data for frame in frames if (data := writer.append_pcm(frame))]
    decoded = np.concatenate([sphn.OpusStreamReader(RATE).append_bytes(b"".join(payloads))])
    received: list[bytes] = []
    reader = sphn.OpusStreamReader(RATE)
    heard = 0
    async with trio_websocket.open_websocket_url(url) as ws:
        first = await ws.get_message()
        assert first[0] == 0  # the handshake first, as the web client waits for it
        received.append(first)
        for data in payloads:
            await ws.send_message(b"\x01" + data)
        while heard < steps * FRAME:
            message = await ws.get_message()
            assert isinstance(message, bytes)
            received.append(message)
            if message[0] == 1:
                heard += len(reader.append_bytes(message[1:]))
    return received, decoded[:len(decoded) // FRAME * FRAME].reshape(-1, FRAME)


def _input_text(received: list[bytes]) -> list[dict]:
    import json

    bodies = [json.loads(m[1:]) for m in received if m[0] == 4]  # strict JSON, as the web client parses
    return [b for b in bodies if b.get("type") == "input_text"]


async def test_api_chat_sends_the_callers_words_as_metadata_to_a_client_that_asks(start_server, reference):
    from test_protocol_moshi import SERVER_KINDS

    served = await start_server("runtime.slots=2", *TINY)
    delay = reference.model.delay_frames
    spoken = 10
    frames = np.concatenate([np.clip(voice(45, spoken), -1.0, 1.0), np.zeros((delay + 8, FRAME), np.float32)])
    steps = spoken + delay  # every step whose text is about the voice
    with trio.fail_after(PATIENCE * 3):
        received, decoded = await _moshi_call(served.url("/api/chat?input_text=1"), frames, steps)
    assert {m[0] for m in received} <= SERVER_KINDS  # no kind the web clients' decoders throw on
    said = _input_text(received)
    # Token for token the package's own inference on the audio the server decoded, for every
    # step the server is known to have taken (later ones may or may not have come yet).
    expected = [reference.table[t] for t in reference.tokens(decoded[:steps], flush=False)]
    assert [e["text"] for e in said if e["frame"] < steps] == [t for t in expected if t] != []
    assert all(e["audio_ms"] == max(0.0, e["frame"] * 80 - 500) for e in said)
    assert [e["frame"] for e in said] == sorted(e["frame"] for e in said)


async def test_api_chat_sends_no_words_to_a_client_that_did_not_ask(start_server, reference):
    """Kyutai's and NVIDIA's web clients as published: not one message more than before."""
    from test_protocol_moshi import SERVER_KINDS

    served = await start_server("runtime.slots=2", *TINY)
    frames = np.concatenate([np.clip(voice(45, 10), -1.0, 1.0), np.zeros((15, FRAME), np.float32)])
    with trio.fail_after(PATIENCE * 3):
        for url in ("/api/chat", "/api/chat?input_text=0"):
            received, _ = await _moshi_call(served.url(url), frames, 17)
            assert not _input_text(received)
            assert {m[0] for m in received} <= SERVER_KINDS
