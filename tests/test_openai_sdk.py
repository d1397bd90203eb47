"""The official `openai` SDK's realtime client, unmodified, against a real `duplexrt serve`.

The SDK client is synchronous (it uses the `websockets` library's sync client), so it runs in a
worker thread while the server runs on trio in the test.
"""

from __future__ import annotations

import base64

import numpy as np
import trio

from duplexrt.config import load_config
from duplexrt.server import Server
from realtime_schema import every_server_event_is_checked  # noqa: F401  (autouse)

KEY = "sk-duplexrt-test"


async def _server(nursery, *overrides: str) -> int:
    config = load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0",
                                f'server.api_key="{KEY}"', "metrics.log_stats=false", *overrides])
    server = Server(config)
    await nursery.start(server.run)
    return server.ports[0]


def _one_turn(connection, session: dict, audio: bytes, chunk: int) -> list:
    """What every SDK test does once connected: set formats, send a turn, ask for a response,
    and read events until it is done."""
    connection.session.update(session=session)
    for start in range(0, len(audio), chunk):
        connection.input_audio_buffer.append(audio=base64.b64encode(audio[start:start + chunk]).decode())
    connection.input_audio_buffer.commit()
    connection.response.create()
    events = []
    for event in connection:
        events.append(event)
        if event.type == "response.done":
            break
    return events


def _pcm16(seconds: float, seed: int) -> bytes:
    samples = (np.random.default_rng(seed).standard_normal(int(24000 * seconds)) * 3000).astype("<i2")
    return samples.tobytes()


async def test_ga_realtime_client_streams_audio_and_gets_a_response(nursery):
    from openai import OpenAI

    port = await _server(nursery)
    audio = _pcm16(0.8, seed=1)  # ten whole frames

    def client() -> list:
        sdk = OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1")
        with sdk.realtime.connect(model="duplexrt-echo") as connection:
            return _one_turn(connection, {
                "type": "realtime",
                "output_modalities": ["audio"],
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}},
                          "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
            }, audio, chunk=9600)

    with trio.fail_after(30):
        events = await trio.to_thread.run_sync(client)
    types = [e.type for e in events]
    assert types[0] == "session.created"
    assert "session.updated" in types and "input_audio_buffer.committed" in types
    assert "response.created" in types and types[-1] == "response.done"
    returned = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.output_audio.delta")
    assert returned == audio  # echo, no delay: the very same pcm16
    done = events[-1].response
    assert done.status == "completed"
    assert done.usage.input_token_details.audio_tokens == 10
    assert done.usage.output_token_details.audio_tokens == 10


async def test_sdk_with_a_wrong_key_is_refused(nursery):
    from openai import OpenAI

    port = await _server(nursery)

    def client() -> str:
        sdk = OpenAI(api_key="wrong", base_url=f"http://127.0.0.1:{port}/v1")
        try:
            with sdk.realtime.connect(model="x"):
                return "connected"
        except Exception as exc:  # websockets' InvalidStatus, surfaced by the SDK
            return repr(exc)

    outcome = await trio.to_thread.run_sync(client)
    assert "401" in outcome


async def test_beta_realtime_client_uses_beta_event_names(nursery):
    from openai import OpenAI

    port = await _server(nursery)
    audio = _pcm16(0.32, seed=2)

    def client() -> list:
        sdk = OpenAI(api_key=KEY, base_url=f"http://127.0.0.1:{port}/v1",
                     websocket_base_url=f"ws://127.0.0.1:{port}/v1")
        with sdk.beta.realtime.connect(model="duplexrt-echo") as connection:
            return _one_turn(connection, {"input_audio_format": "pcm16", "output_audio_format": "pcm16"},
                             audio, chunk=len(audio))

    with trio.fail_after(30):
        events = await trio.to_thread.run_sync(client)
    returned = b"".join(base64.b64decode(e.delta) for e in events if e.type == "response.audio.delta")
    assert returned == audio
    assert events[-1].response.status == "completed"


async def test_duplex_by_path_survives_a_client_that_appends_its_own_query(nursery):
    """pipecat appends ``?model=...`` to its base URL as it is, so ``/v1/realtime?duplex=1`` lost
    its duplex switch; ``/v1/realtime/duplex`` needs no query string.  A burst of sound is one
    response with the whole lifecycle; the pause after it ends the response."""
    import json

    from websockets.sync.client import connect

    port = await _server(nursery)
    tone = (np.sin(np.arange(24000) * 2 * np.pi * 440 / 24000) * 8000).astype("<i2").tobytes()
    silence = bytes(24000 * 2 * 4)

    def client() -> list[dict]:
        url = f"ws://127.0.0.1:{port}/v1/realtime/duplex?model=duplexrt-echo"
        with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            events = [json.loads(ws.recv())]
            for audio in (tone, silence):
                ws.send(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(audio).decode()}))
            while events[-1]["type"] != "response.done":
                events.append(json.loads(ws.recv(timeout=20)))
            return events

    with trio.fail_after(30):
        events = await trio.to_thread.run_sync(client)
    # The server VAD (on by default) may take the tone for speech: it only reports it in duplex mode.
    kinds = [e["type"] for e in events if e["type"] != "response.output_audio.delta"
             and not e["type"].startswith("input_audio_buffer.")
             and (e.get("item") or {}).get("role") != "user"]
    assert kinds == ["session.created", "response.created", "response.output_item.added",
                     "conversation.item.added", "response.content_part.added", "response.output_audio.done",
                     "response.content_part.done", "response.output_item.done", "conversation.item.done",
                     "response.done"]
    returned = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert returned[:len(tone)] == tone  # the burst, then the pause's hang-over, then nothing
    # The hang-over (480 ms) counted in whole batches of output: well under the 4 s of silence.
    assert len(returned) - len(tone) <= 24000 * 2 * 1.0


async def test_a_client_that_never_sets_turn_detection_gets_an_answer_to_speech(nursery):
    """pipecat's default flow: its session.update names no turn_detection (it relies on the
    server's default, server VAD), streams the microphone, and waits for the answer.  duplexrt
    used to have no VAD: the reply never came."""
    import json

    import speech
    from websockets.sync.client import connect

    port = await _server(nursery)
    voice = speech.speech_24k()
    audio = np.concatenate([np.zeros(12000, "<i2"), voice, np.zeros(24000, "<i2")]).tobytes()

    def client() -> list[dict]:
        url = f"ws://127.0.0.1:{port}/v1/realtime?model=gpt-realtime"
        with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            events = [json.loads(ws.recv())]
            ws.send(json.dumps({"type": "session.update", "session": {"type": "realtime", "model": "gpt-realtime"}}))
            for start in range(0, len(audio), 3840):
                ws.send(json.dumps({"type": "input_audio_buffer.append",
                                    "audio": base64.b64encode(audio[start:start + 3840]).decode()}))
            while events[-1]["type"] != "response.done":
                events.append(json.loads(ws.recv(timeout=20)))
            return events

    with trio.fail_after(40):
        events = await trio.to_thread.run_sync(client)
    kinds = [e["type"] for e in events]
    assert events[0]["session"]["audio"]["input"]["turn_detection"]["type"] == "server_vad"
    for kind in ("input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                 "input_audio_buffer.committed", "response.created"):
        assert kind in kinds
    assert kinds.index("input_audio_buffer.speech_stopped") < kinds.index("response.created")
    returned = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "response.output_audio.delta")
    assert len(returned) >= len(voice) * 2 * 0.8  # the echo of the speech: the model's audio came back
    assert events[-1]["response"]["status"] == "completed"


async def test_continuous_duplex_sends_every_frame_silence_too(nursery):
    """``duplexrt client`` and ``simulate`` count every output frame to know they have heard it
    all: with responses cut at pauses they would wait forever for silence that is not sent, so
    they ask for ``continuous=1``: one open response from the start, every frame in it."""
    import json

    from websockets.sync.client import connect

    port = await _server(nursery)
    silence = bytes(3840 * 10)

    def client() -> list[dict]:
        url = f"ws://127.0.0.1:{port}/v1/realtime?duplex=1&continuous=1"
        with connect(url, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
            events = [json.loads(ws.recv())]
            ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(silence).decode()}))
            heard = 0
            while heard < len(silence):
                events.append(json.loads(ws.recv(timeout=20)))
                if events[-1]["type"] == "response.output_audio.delta":
                    heard += len(base64.b64decode(events[-1]["delta"]))
            return events

    with trio.fail_after(30):
        events = await trio.to_thread.run_sync(client)
    assert events[1]["type"] == "response.created"  # opened at the start, not by sound
    assert not any(e["type"] == "response.done" for e in events)
