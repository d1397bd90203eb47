"""The Live translator (``/v1/live/sessions``): plain calls for every event and close reason, then
sessions through the real runtime, over real sockets with the echo and tiny Moshi models, each
checked against the event shapes and order LiveKit's ``GPTLiveModel`` client relies on.

The translator tests drive it with a fake progress object whose counters the test sets.
"""

from __future__ import annotations

import base64
import json

import attrs
import numpy as np
import pytest
import trio
import trio.testing
import trio_websocket

from conftest import PATIENCE
from duplexrt.audio import AudioSpec, make_decoder
from duplexrt.config import load_config
from duplexrt.runtime import open_runtime
from duplexrt.protocols import b64audio
from duplexrt.protocols.events import AudioIn, InputEnd, ProtocolError, Reconfigure, Reply, SessionEnd
from duplexrt.protocols.live import CLOSE_REASONS, LiveTranslator, close_reason
from duplexrt.reasons import FinishReason
from duplexrt.server import Server
from duplexrt.wire.transport import TransportClosed, memory_transport_pair

FRAME = 1920
KEY = "sk-live-test"


@attrs.define
class FakeProgress:
    """FAKE: the session's counters, set by the test."""

    frames_in: int = 0
    frames_answered: int = 0
    frames_out: int = 0
    max_frames: int | None = None


def make(**kwargs) -> tuple[LiveTranslator, FakeProgress]:
    protocol = LiveTranslator(**kwargs)
    progress = FakeProgress()
    protocol.attach(progress)
    return protocol, progress


def send(protocol: LiveTranslator, kind: str, **fields):
    return protocol.parse(json.dumps({"type": kind, **fields}))


def started(**kwargs) -> tuple[LiveTranslator, FakeProgress]:
    protocol, progress = make(**kwargs)
    assert isinstance(send(protocol, "session.start", session={"model": "m"}), Reconfigure)
    return protocol, progress


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def end(reason: str, frames_in: int = 10, frames_out: int = 9, error: str | None = None) -> SessionEnd:
    return SessionEnd(reason=reason, frames_in=frames_in, frames_out=frames_out,
                      seconds_in=round(frames_in * 0.08, 6), seconds_out=round(frames_out * 0.08, 6),
                      error=error)


#: What LiveKit's client (livekit-agents 1.8.9, gpt_live_types.py) reads from each server event.
CLOSE_REASON_NAMES = {"close_requested", "expired", "content", "remote_hangup", "connection_lost"}


def check_shape(event: dict) -> None:
    """One server event has the fields, of the types, that the public client reads."""
    kind = event["type"]
    if kind == "session.started":
        assert isinstance(event["session"]["id"], str)
    elif kind == "session.output_audio.delta":
        data = base64.b64decode(event["delta"], validate=True)
        assert data and len(data) % 2 == 0, "pcm16: whole samples"
    elif kind in ("session.output_transcript.delta", "session.input_transcript.delta"):
        assert isinstance(event["delta"], str) and event["delta"]
        assert type(event["start_ms"]) is int and type(event["end_ms"]) is int
        assert 0 <= event["start_ms"] < event["end_ms"]
    elif kind == "session.usage.updated":
        assert isinstance(event["usage"]["seconds"], float | int)
        ratio = event["context_window"]["usage_ratio"]
        assert ratio is None or 0 <= ratio <= 1
    elif kind == "session.closed":
        assert event["reason"] in CLOSE_REASON_NAMES
        assert isinstance(event["usage"]["seconds"], float | int)
    elif kind == "error":
        body = event["error"]
        assert set(body) >= {"type", "code", "message", "param", "client_event_id"}
        assert isinstance(body["message"], str) and body["message"]
    elif kind in ("session.input_audio.muted", "session.input_audio.unmuted"):
        pass
    elif kind in ("session.instructions.appended", "session.thinking.appended", "session.commentary.appended"):
        # pipecat's ContextAppendedEvent: the accepted range on the session timeline.
        assert type(event["start_ms"]) is int and type(event["end_ms"]) is int
        assert 0 <= event["start_ms"] <= event["end_ms"]
    elif kind == "session.updated":
        assert isinstance(event["session"]["id"], str)  # the complete resolved session
    else:
        raise AssertionError(f"an event the public client does not know: {kind}")


def check_sequence(events: list[dict]) -> None:
    """The order the public client expects: session.started first, session.closed last, usage a
    running total that never goes back, transcript spans in timeline order."""
    for event in events:
        check_shape(event)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "session.started"
    assert kinds.count("session.started") == 1
    if "session.closed" in kinds:
        assert kinds.index("session.closed") == len(kinds) - 1
    seconds = [e["usage"]["seconds"] for e in events if e["type"] in ("session.usage.updated", "session.closed")]
    assert seconds == sorted(seconds)
    starts = [e["start_ms"] for e in events if e["type"] == "session.output_transcript.delta"]
    assert starts == sorted(starts)


# -- session.start -----------------------------------------------------------------------------


def test_start_as_livekit_sends_it_answers_session_started_in_pcm16_24k():
    protocol, _ = make(model="duplexrt-echo", session_id="live_x")
    # Every field the public client sends; the server uses only the format.
    event = send(protocol, "session.start", event_id="session_start_abc", session={
        "model": "gpt-live-1", "instructions": "be brief",
        "input": [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        "audio": {"format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}},
        "delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna"}}})
    assert isinstance(event, Reconfigure)
    [message] = event.messages
    body = json.loads(message)
    assert body == {"type": "session.started", "session": {
        "id": "live_x", "model": "duplexrt-echo", "audio": {"format": {"type": "audio/pcm", "rate": 24000}}}}
    check_shape(body)
    assert protocol.started
    assert protocol.input_spec == protocol.output_spec == AudioSpec.create("pcm_s16le", 24000, model_rate=24000)


@pytest.mark.parametrize("name, fmt, rate", [("audio/pcmu", "g711_ulaw", 8000), ("audio/pcma", "g711_alaw", 8000)])
def test_start_in_g711_sets_both_directions(name, fmt, rate):
    protocol, _ = make()
    event = send(protocol, "session.start", session={"model": "m", "audio": {"format": {"type": name}}})
    assert isinstance(event, Reconfigure)
    assert protocol.input_spec == protocol.output_spec == AudioSpec.create(fmt, rate, model_rate=24000)
    assert json.loads(event.messages[0])["session"]["audio"]["format"] == {"type": name, "rate": rate}


@pytest.mark.parametrize("session, words", [
    (None, "needs a 'session' object"),
    ([1], "'session' must be an object"),
    ({"model": 5}, "session.model must be a string"),
    ({"audio": "pcm"}, "session.audio must be an object"),
    ({"audio": {"format": "audio/pcm"}}, "session.audio.format must be an object"),
    ({"audio": {"format": {"type": "audio/opus"}}}, "must be audio/pcm, audio/pcmu or audio/pcma"),
    ({"audio": {"format": {"type": "audio/pcm", "rate": "fast"}}}, "whole number of Hz"),
    ({"audio": {"format": {"type": "audio/pcm", "rate": 3}}}, "session.audio.format.rate"),
])
def test_a_malformed_start_is_fatal_and_says_why(session, words):
    protocol, _ = make()
    fields = {} if session is None else {"session": session}
    event = send(protocol, "session.start", event_id="e1", **fields)
    assert isinstance(event, ProtocolError) and event.fatal
    assert words in event.message and "the session cannot start" in event.message
    assert event.event_id == "e1"
    assert not protocol.started


def test_a_second_start_is_refused_without_ending_the_session():
    protocol, _ = started()
    event = send(protocol, "session.start", session={"model": "m"})
    assert isinstance(event, ProtocolError) and not event.fatal
    assert event.code == "session_already_started"


@pytest.mark.parametrize("kind, fields", [
    ("session.input_audio.append", {"audio": b64(bytes(4))}),
    ("session.input_audio.mute", {}),
    ("session.instructions.append", {"delegation_id": None, "content": "x"}),
])
def test_nothing_but_start_or_close_before_session_start(kind, fields):
    protocol, _ = make()
    event = send(protocol, kind, **fields)
    assert isinstance(event, ProtocolError) and not event.fatal
    assert event.code == "session_not_started" and kind in event.message
    assert protocol.audio_out(b"\x00\x00", 1) == [], "no output before session.started"


def test_close_before_start_ends_with_no_session_closed():
    protocol, _ = make()
    assert isinstance(send(protocol, "session.close"), InputEnd)
    assert protocol.end(end("stop", 0, 0)) == []


# -- input -------------------------------------------------------------------------------------


def test_append_without_event_id_is_audio_in():
    protocol, _ = started()
    audio = np.arange(2400, dtype="<i2").tobytes()  # 100 ms, as LiveKit sends
    event = protocol.parse(json.dumps({"type": "session.input_audio.append", "audio": b64(audio)}))
    assert event == AudioIn(audio)


@pytest.mark.parametrize("audio, code", [
    (None, "missing_required_parameter"), (12, "invalid_type"), ("", "invalid_value"),
    ("%%%", "invalid_base64"), (b64(b"\x01\x02\x03"), "invalid_audio_length"),
])
def test_bad_appends_are_errors_that_do_not_end_the_session(audio, code):
    protocol, _ = started()
    fields = {} if audio is None else {"audio": audio}
    event = send(protocol, "session.input_audio.append", event_id="a1", **fields)
    assert isinstance(event, ProtocolError) and not event.fatal
    assert event.code == code and event.event_id == "a1"
    if code == "missing_required_parameter":
        assert "session.input_audio.append needs 'audio'" in event.message


def test_an_append_longer_than_max_message_seconds_is_refused_before_decoding(monkeypatch):
    protocol, _ = started(max_message_seconds=0.5)
    fits = bytes(2 * 12000)
    assert send(protocol, "session.input_audio.append", audio=b64(fits)) == AudioIn(fits)

    def no_decoding(*args, **kwargs):
        raise AssertionError("the base64 was decoded")

    monkeypatch.setattr(b64audio, "decode_strict", no_decoding)
    event = send(protocol, "session.input_audio.append", audio=b64(fits + bytes(2)))
    assert isinstance(event, ProtocolError) and event.code == "audio_too_long"
    assert "audio.max_message_seconds" in event.message and "session.input_audio.append" in event.message


@pytest.mark.parametrize("name, fmt", [("audio/pcm", "pcm_s16le"), ("audio/pcmu", "g711_ulaw"),
                                       ("audio/pcma", "g711_alaw")])
def test_mute_replaces_audio_with_silence_of_the_same_length(name, fmt):
    protocol, _ = make()
    send(protocol, "session.start", session={"model": "m", "audio": {"format": {"type": name}}})
    loud = bytes(range(1, 241)) * 4  # 960 bytes, whole samples in every format
    ack = send(protocol, "session.input_audio.mute", event_id="mute_1")
    assert isinstance(ack, Reply)
    assert json.loads(ack.messages[0]) == {"type": "session.input_audio.muted", "client_event_id": "mute_1"}
    muted = send(protocol, "session.input_audio.append", audio=b64(loud))
    assert isinstance(muted, AudioIn) and len(muted.payload) == len(loud)
    samples = make_decoder(protocol.input_spec, protocol.input_spec.sample_rate).decode(bytes(muted.payload))
    # Digital silence: zero, or A-law's code nearest it (it has no zero).
    assert len(samples) and np.abs(samples).max() <= 1 / 4096, "silence in the session's format"
    ack = send(protocol, "session.input_audio.unmute")
    assert json.loads(ack.messages[0])["type"] == "session.input_audio.unmuted"
    assert send(protocol, "session.input_audio.append", audio=b64(loud)) == AudioIn(loud)


APPENDS = ["session.instructions.append", "session.thinking.append", "session.commentary.append"]


@pytest.mark.parametrize("kind", APPENDS)
def test_context_appends_are_acknowledged_where_the_session_is_and_change_nothing(kind):
    protocol, progress = started()
    progress.frames_in = 25  # two seconds in
    # As LiveKit's generate_reply sends it: delegation_id present and null.
    event = send(protocol, kind, event_id="ask_1", delegation_id=None, content="Greet the user warmly.")
    assert isinstance(event, Reply)
    [message] = event.messages
    body = json.loads(message)
    assert body == {"type": kind.replace(".append", ".appended"), "client_event_id": "ask_1",
                    "start_ms": 2000, "end_ms": 2000}
    check_shape(body)
    assert protocol.input_spec == protocol.output_spec and not protocol.muted
    assert isinstance(send(protocol, kind, delegation_id="del_7", content=""), Reply), "a delegation's id"


@pytest.mark.parametrize("fields, code, words", [
    ({"delegation_id": None}, "missing_required_parameter", "needs 'content'"),
    ({"delegation_id": None, "content": 5}, "invalid_type", "needs 'content'"),
    ({"content": "x"}, "missing_required_parameter", "needs 'delegation_id'"),
    ({"content": "x", "delegation_id": 3}, "invalid_type", "delegation_id must be null or a string"),
])
def test_malformed_appends_are_named_errors_and_the_session_goes_on(fields, code, words):
    for kind in APPENDS:
        protocol, _ = started()
        event = send(protocol, kind, event_id="a", **fields)
        assert isinstance(event, ProtocolError) and not event.fatal, event
        assert (event.code, event.event_id) == (code, "a") and words in event.message and kind in event.message


def test_session_update_is_answered_with_the_complete_resolved_session():
    protocol, _ = make(model="duplexrt-echo", session_id="live_u")
    started_body = json.loads(send(protocol, "session.start", session={
        "model": "gpt-live-1", "audio": {"format": {"type": "audio/pcmu"}}}).messages[0])
    # What LiveKit sends when the agent's tools change: a sparse delegation update.
    event = send(protocol, "session.update", event_id="delegation_update_1", session={
        "delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna", "tools": []}}})
    assert isinstance(event, Reply)
    body = json.loads(event.messages[0])
    check_shape(body)
    assert body == {"type": "session.updated", "client_event_id": "delegation_update_1",
                    "session": started_body["session"]}
    for fields, code in (({}, "missing_required_parameter"), ({"session": [1]}, "invalid_type")):
        error = send(protocol, "session.update", **fields)
        assert isinstance(error, ProtocolError) and not error.fatal and error.code == code


@pytest.mark.parametrize("kind", ["response.item.create", "response.create"])
def test_delegation_events_are_named_errors_and_the_session_goes_on(kind):
    protocol, _ = started()
    event = send(protocol, kind, event_id="x" * 500, item={"type": "function_call_output"})
    assert isinstance(event, ProtocolError) and not event.fatal
    assert event.code == "unsupported_event" and event.message.startswith(kind)
    assert len(event.event_id) <= 101, "client ids are echoed short"
    [message] = protocol.error(event)
    body = json.loads(message)
    check_shape(body)
    assert body["error"]["client_event_id"] == event.event_id
    assert body["error"]["code"] not in ("invalid_api_key", "insufficient_quota", "forbidden")


def test_a_reconnect_reseeding_its_history_is_accepted():
    """LiveKit sends the whole conversation so far as ``input`` on every (re)connect."""
    history = [{"type": "message", "role": ("user", "assistant")[i % 2],
                "content": [{"type": ("input_text", "output_text")[i % 2], "text": f"turn {i} " * 40}]}
               for i in range(200)]
    protocol, _ = make()
    event = send(protocol, "session.start", session={"model": "m", "instructions": "x" * 20000, "input": history})
    assert isinstance(event, Reconfigure) and protocol.started
    assert len(event.messages[0]) < 300, "nothing of it is echoed back"


def test_malformed_messages():
    protocol, _ = started()
    binary = protocol.parse(b"\x00\x01")
    assert isinstance(binary, ProtocolError) and binary.fatal and binary.close_code == 1003
    for message, code in [("{", "invalid_json"), ("[1]", "invalid_event"), ('{"type": 3}', "invalid_event"),
                          ('{"type": "' + "z" * 1000 + '"}', "unknown_event")]:
        event = protocol.parse(message)
        assert isinstance(event, ProtocolError) and event.code == code and not event.fatal
        assert len(event.message) < 300


def test_close_is_the_end_of_input():
    protocol, _ = started()
    assert isinstance(send(protocol, "session.close"), InputEnd)
    assert protocol.close_requested


# -- output ------------------------------------------------------------------------------------


def test_audio_out_is_one_delta_per_batch_and_nothing_for_no_bytes():
    protocol, progress = started()
    payload = np.arange(FRAME, dtype="<i2").tobytes()
    [message] = protocol.audio_out(payload, 1)
    body = json.loads(message)
    assert body == {"type": "session.output_audio.delta", "delta": b64(payload)}
    check_shape(body)
    assert protocol.audio_out(b"", 1) == []


def test_text_is_an_output_transcript_delta_spanning_its_frames():
    protocol, progress = started(usage_interval_seconds=100)
    progress.frames_answered = 5
    assert protocol.text_out("hel") == []
    assert protocol.text_out("lo") == []
    messages = [json.loads(m) for m in protocol.audio_out(bytes(2 * 2 * FRAME), 2)]
    assert [m["type"] for m in messages] == ["session.output_transcript.delta"] * 2 + ["session.output_audio.delta"]
    assert [(m["delta"], m["start_ms"], m["end_ms"]) for m in messages[:2]] == [("hel", 400, 560), ("lo", 400, 560)]
    progress.frames_answered = 7
    protocol.text_out("!")
    [text, _] = [json.loads(m) for m in protocol.audio_out(bytes(2 * FRAME), 1)]
    assert (text["start_ms"], text["end_ms"]) == (560, 640)


def test_usage_updates_about_once_a_second_with_the_context_ratio():
    protocol, progress = started()  # 1 s: every 12 frames of 80 ms
    progress.max_frames = 100
    updates = []
    for frame in range(30):
        progress.frames_in = frame + 2  # the model has taken a little more than it answered
        progress.frames_answered = frame
        updates += [json.loads(m) for m in protocol.audio_out(bytes(2 * FRAME), 1)
                    if json.loads(m)["type"] == "session.usage.updated"]
    assert [u["usage"]["seconds"] for u in updates] == [round(13 * 0.08, 6), round(25 * 0.08, 6)]
    assert [u["context_window"]["usage_ratio"] for u in updates] == [0.13, 0.25]
    for update in updates:
        check_shape(update)


def test_usage_ratio_is_null_without_a_limit():
    protocol, progress = started(usage_interval_seconds=0.08)
    progress.frames_in = 1
    update = json.loads(protocol.audio_out(b"", 1)[-1])
    assert update == {"type": "session.usage.updated", "usage": {"seconds": 0.08}, "context_window": {"usage_ratio": None}}


# -- the end -------------------------------------------------------------------------------------


#: The Live names of the three reasons it has a word for; every other ending is connection_lost.
LIVE_NAMES = {FinishReason.STOP: "close_requested", FinishReason.LENGTH: "expired",
              FinishReason.SHUTDOWN: "remote_hangup"}


def test_the_live_close_reasons_name_every_finish_reason():
    assert set(CLOSE_REASONS) == set(FinishReason)


@pytest.mark.parametrize("reason, live", [
    *((reason, LIVE_NAMES.get(reason, "connection_lost")) for reason in FinishReason),
    ("something_new", "connection_lost"),
])
def test_every_finish_reason_maps_to_a_live_close_reason(reason, live):
    assert close_reason(reason) == live
    protocol, _ = started()
    messages = [json.loads(m) for m in protocol.end(end(reason, 37, 36, error="boom" if reason == "error" else None))]
    closed = messages[-1]
    check_shape(closed)
    assert closed == {"type": "session.closed", "reason": live, "finish_reason": reason,
                      "usage": {"seconds": 2.96, "frames_in": 37, "frames_out": 36}}
    if reason == "error":
        assert [m["type"] for m in messages] == ["error", "session.closed"]
        assert messages[0]["error"]["code"] == "server_error" and messages[0]["error"]["message"] == "boom"
    else:
        assert len(messages) == 1


def test_close_reasons_are_all_names_the_public_client_knows():
    assert set(CLOSE_REASONS.values()) | {close_reason("?")} <= CLOSE_REASON_NAMES


def test_a_fatal_client_error_is_not_followed_by_a_second_error():
    protocol, _ = started()
    protocol.error(ProtocolError("binary_not_supported", "no", fatal=True))
    messages = [json.loads(m) for m in protocol.end(end("error", error="no"))]
    assert [m["type"] for m in messages] == ["session.closed"]


def test_a_server_error_before_start_is_still_told():
    protocol, _ = make()
    messages = [json.loads(m) for m in protocol.end(end("error", 0, 0, error="model failed"))]
    assert [m["type"] for m in messages] == ["error"]


# -- whole sessions --------------------------------------------------------------------------------


class Client:
    """A Live client over a memory transport: sends events, keeps every event received."""

    def __init__(self, transport) -> None:
        self.transport = transport
        self.events: list[dict] = []
        self.closed: TransportClosed | None = None
        self._arrived = trio.Event()

    async def send(self, kind: str, **fields) -> None:
        await self.transport.send(json.dumps({"type": kind, **fields}))

    async def receive_all(self) -> None:
        try:
            while True:
                self.events.append(json.loads(await self.transport.receive()))
                self._arrived.set()
                self._arrived = trio.Event()
        except TransportClosed as closed:
            self.closed = closed
            self._arrived.set()

    async def wait_for(self, kind: str) -> dict:
        while True:
            for event in self.events:
                if event["type"] == kind:
                    return event
            if self.closed is not None:
                raise AssertionError(f"closed before {kind}: {[e['type'] for e in self.events]}")
            await self._arrived.wait()

    def audio(self) -> bytes:
        return b"".join(base64.b64decode(e["delta"]) for e in self.events
                        if e["type"] == "session.output_audio.delta")


def tone(samples: int) -> bytes:
    t = np.arange(samples) / 24000
    return (np.sin(2 * np.pi * 440 * t) * 8000).astype("<i2").tobytes()


async def serve_one(config, script) -> tuple[Client, object]:
    client_end, server_end = memory_transport_pair()
    client = Client(client_end)
    result = {}
    async with open_runtime(config) as runtime:
        async def serve() -> None:
            protocol = LiveTranslator(frame_seconds=config.audio.frame_seconds)
            result["end"] = await runtime.serve(server_end, protocol)

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(client.receive_all)
                await script(client)
    return client, result["end"]


async def test_a_session_echoes_continuously_mutes_and_closes_with_exact_usage():
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    chunk = 2400 * 2  # 100 ms of pcm16, as LiveKit appends
    audio = tone(2400 * 12)  # 1.2 s: 15 frames
    muted_chunks = {4, 5}

    async def script(client: Client) -> None:
        await client.send("session.start", session={"model": "gpt-live-1", "audio": {
            "format": {"type": "audio/pcm", "rate": 24000}, "output": {"voice": "marin"}},
            "delegation": {"type": "responses"}})
        await client.wait_for("session.started")
        for i in range(12):
            if i == 4:
                await client.send("session.input_audio.mute", event_id="m")
            if i == 6:
                await client.send("session.input_audio.unmute", event_id="u")
            if i == 2:  # a greeting, as LiveKit's generate_reply asks for one, and a tools change
                await client.send("session.commentary.append", event_id="c", delegation_id=None, content="Say hi.")
                await client.send("session.update", event_id="u2", session={"delegation": {"type": "responses"}})
            await client.transport.send(json.dumps({"type": "session.input_audio.append",
                                                    "audio": b64(audio[i * chunk:(i + 1) * chunk])}))
        await client.send("response.create", event_id="r")
        await client.send("session.close")
        await client.wait_for("session.closed")

    client, end_ = await serve_one(config, script)
    check_sequence(client.events)
    expected = bytearray(audio)
    for i in muted_chunks:
        expected[i * chunk:(i + 1) * chunk] = bytes(chunk)
    assert client.audio() == bytes(expected), "every frame comes back, the muted ones silent"
    closed = client.events[-1]
    assert closed["reason"] == "close_requested" and end_.reason == "stop"
    assert closed["usage"] == {"seconds": 1.2, "frames_in": 15, "frames_out": 15}
    [error] = [e for e in client.events if e["type"] == "error"]
    assert error["error"]["code"] == "unsupported_event" and error["error"]["client_event_id"] == "r"
    kinds = [e["type"] for e in client.events]
    assert "session.input_audio.muted" in kinds and "session.input_audio.unmuted" in kinds
    [appended] = [e for e in client.events if e["type"] == "session.commentary.appended"]
    assert appended["client_event_id"] == "c" and appended["start_ms"] % 80 == 0
    [updated] = [e for e in client.events if e["type"] == "session.updated"]
    assert updated["session"] == client.events[0]["session"]
    assert kinds.count("session.usage.updated") >= 1
    assert client.closed is not None and client.closed.code == 1000


async def test_100_ms_appends_are_carried_across_80_ms_frames_sample_for_sample():
    """LiveKit appends 100 ms (2400 samples); the model's frames are 80 ms (1920).  Seven
    appends are 8.75 frames: every remainder is carried into the next frame, the last partial
    frame is padded with silence at session.close, and nothing is lost, doubled or reordered."""
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    rng = np.random.default_rng(100)
    audio = rng.integers(-20000, 20000, 7 * 2400, dtype=np.int16).astype("<i2").tobytes()

    async def script(client: Client) -> None:
        await client.send("session.start", session={"model": "m"})
        await client.wait_for("session.started")
        for i in range(7):
            await client.send("session.input_audio.append", audio=b64(audio[i * 4800:(i + 1) * 4800]))
        await client.send("session.close")
        await client.wait_for("session.closed")

    client, end_ = await serve_one(config, script)
    check_sequence(client.events)
    heard = client.audio()
    assert len(heard) == 9 * 2 * FRAME, "8.75 frames in: 9 out"
    assert heard[:len(audio)] == audio and heard[len(audio):] == bytes(len(heard) - len(audio))
    assert client.events[-1]["usage"]["frames_in"] == end_.frames_in == 9


async def test_a_session_reaching_its_length_limit_closes_as_expired():
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2",
                                "runtime.max_session_seconds=0.4"])

    async def script(client: Client) -> None:
        await client.send("session.start", session={"model": "m"})
        await client.wait_for("session.started")
        for _ in range(10):
            try:
                await client.send("session.input_audio.append", audio=b64(tone(2400)))
            except TransportClosed:
                break
        await client.wait_for("session.closed")

    client, end_ = await serve_one(config, script)
    check_sequence(client.events)
    closed = client.events[-1]
    assert end_.reason == "length"
    assert closed["reason"] == "expired" and closed["usage"]["seconds"] == 0.4 and closed["usage"]["frames_out"] == 5
    ratios = [e["context_window"]["usage_ratio"] for e in client.events if e["type"] == "session.usage.updated"]
    assert all(r is not None for r in ratios)


async def test_the_drain_on_sigterm_closes_as_remote_hangup_with_exact_usage():
    config = load_config(None, ["backend.options.delay_frames=0", "runtime.slots=2"])
    holder = {}

    async def script(client: Client) -> None:
        await client.send("session.start", session={"model": "m"})
        await client.wait_for("session.started")
        for _ in range(3):
            await client.send("session.input_audio.append", audio=b64(tone(2400)))
        while len(client.audio()) < 3 * 2 * FRAME:
            await client.wait_for("session.output_audio.delta")
            await trio.testing.wait_all_tasks_blocked()
        for session in list(holder["runtime"].sessions):
            session.shutdown()  # what the server's drain does to every session
        await client.wait_for("session.closed")

    client_end, server_end = memory_transport_pair()
    client = Client(client_end)
    result = {}
    async with open_runtime(config) as runtime:
        holder["runtime"] = runtime

        async def serve() -> None:
            result["end"] = await runtime.serve(server_end, LiveTranslator())

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(client.receive_all)
                await script(client)
                await trio.sleep(0)
    check_sequence(client.events)
    closed = client.events[-1]
    assert result["end"].reason == "shutdown"
    assert closed["reason"] == "remote_hangup" and closed["usage"]["frames_in"] == result["end"].frames_in
    assert closed["usage"]["frames_out"] == result["end"].frames_out == closed["usage"]["frames_in"]
    assert client.audio()[:3 * 2 * FRAME] == (tone(2400) * 3)[:3 * 2 * FRAME]


# -- over real sockets -----------------------------------------------------------------------------


async def _server(nursery, config_path=None, *overrides: str) -> Server:
    config = load_config(config_path, ["server.port=0", f'server.api_key="{KEY}"', "metrics.log_stats=false",
                                       *overrides])
    server = Server(config)
    await nursery.start(server.run)
    return server


async def _converse(url: str, audio: bytes, *, chunk: int = 4800) -> list[dict]:
    """What LiveKit's client does: Bearer key, no subprotocol, session.start, wait for
    session.started, 100 ms appends without event ids, then a bare session.close."""
    events: list[dict] = []
    headers = [("Authorization", f"Bearer {KEY}")]
    async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
        await ws.send_message(json.dumps({"type": "session.start", "event_id": "session_start_1", "session": {
            "model": "gpt-live-1", "audio": {"format": {"type": "audio/pcm", "rate": 24000},
                                             "output": {"voice": "marin"}},
            "delegation": {"type": "responses", "responses": {"model": "gpt-5.6-luna"}}}}))
        events.append(json.loads(await ws.get_message()))
        assert events[0]["type"] == "session.started"
        for start in range(0, len(audio), chunk):
            await ws.send_message(json.dumps({"type": "session.input_audio.append",
                                              "audio": b64(audio[start:start + chunk])}))
        await ws.send_message(json.dumps({"type": "session.close"}))
        try:
            while True:
                events.append(json.loads(await ws.get_message()))
        except trio_websocket.ConnectionClosed as closed:
            assert closed.reason.code == 1000
    return events


async def test_echo_over_a_real_socket_with_a_bearer_key(nursery):
    server = await _server(nursery, None, "backend.options.delay_frames=0", "runtime.slots=2")
    audio = tone(24000)  # 1 s: 12.5 frames, the last padded
    with trio.fail_after(PATIENCE):
        events = await _converse(f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions", audio)
    check_sequence(events)
    heard = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "session.output_audio.delta")
    assert heard[:len(audio)] == audio and len(heard) == 13 * 2 * FRAME
    assert events[-1]["reason"] == "close_requested" and events[-1]["usage"]["seconds"] == 1.04


async def test_a_wrong_key_is_refused_at_the_upgrade(nursery):
    server = await _server(nursery, None, "runtime.slots=1")
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions"
    with trio.fail_after(PATIENCE), pytest.raises(trio_websocket.ConnectionRejected) as caught:
        async with trio_websocket.open_websocket_url(url, extra_headers=[("Authorization", "Bearer nope")]):
            pass
    assert caught.value.status_code == 401


async def test_admission_size_and_first_message_rules_apply_to_the_live_route(nursery):
    server = await _server(nursery, None, "runtime.slots=1", "server.realtime_max_message_bytes=4096",
                           "server.first_message_timeout_s=0.3")
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions"
    headers = [("Authorization", f"Bearer {KEY}")]
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
            await ws.send_message(json.dumps({"type": "session.start", "session": {"model": "m"}}))
            assert json.loads(await ws.get_message())["type"] == "session.started"
            with pytest.raises(trio_websocket.ConnectionRejected) as refused:
                async with trio_websocket.open_websocket_url(url, extra_headers=headers):
                    pass
            assert refused.value.status_code == 503, "one slot, taken"
            await ws.send_message(json.dumps({"type": "session.input_audio.append", "audio": "A" * 8000}))
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                while True:
                    await ws.get_message()
            assert closed.value.reason.code == 1009
        while server.runtime.scheduler.free_slots != 1:
            await trio.sleep(0.01)
        async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()  # nothing comes before session.start; the server gives up
            assert closed.value.reason.code == 1008


async def test_tiny_moshi_speaks_text_on_the_timeline_over_a_real_socket(nursery):
    pytest.importorskip("moshi")
    import torch

    from pathlib import Path

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        tiny = Path(__file__).resolve().parent.parent / "configs" / "moshi-tiny.toml"
        server = await _server(nursery, tiny, "runtime.slots=1", "runtime.gather_window_ms=1",
                               "backend.options.warmup_steps=1", "runtime.late_input=wait")  # exact counts
        audio = tone(24000)
        with trio.fail_after(PATIENCE * 3):
            events = await _converse(f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions", audio)
    finally:
        torch.set_num_threads(threads)
    check_sequence(events)
    texts = [e for e in events if e["type"] == "session.output_transcript.delta"]
    assert texts, "the tiny model speaks text pieces"
    assert all(e["end_ms"] - e["start_ms"] >= 80 and e["start_ms"] % 80 == 0 for e in texts)
    heard = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "session.output_audio.delta")
    assert len(heard) == 13 * 2 * FRAME, "continuous audio: one frame out per frame in"
    assert events[-1]["reason"] == "close_requested" and events[-1]["usage"]["frames_out"] == 13


# -- fuzz ---------------------------------------------------------------------------------------------

_EVENTS = ["session.start", "session.update", "session.input_audio.append", "session.input_audio.mute",
           "session.input_audio.unmute", "session.instructions.append", "session.thinking.append",
           "session.commentary.append", "response.item.create", "response.create", "session.close"]
_VALUES = [None, 0, -1, 2 ** 70, 1.5, True, "", "x" * 3000, "%%%", "AQA", "AQID", [], {}, [[[[1]]]],
           {"type": "audio/pcm", "rate": 0}, {"type": "audio/pcmu", "rate": 24000}, {"format": "pcm16"},
           {"format": {"type": "audio/pcma", "rate": 8000.0}}, "\ud800", {"audio": {"format": []}}]


def fuzz_messages(seed: int, count: int) -> list[str | bytes]:
    """Client events of every type with fields drawn from values a broken client might send, plus
    truncated JSON, deep nesting and binary frames.  Seeded: every run sends the same."""
    rng = np.random.default_rng(seed)
    messages: list[str | bytes] = []
    for _ in range(count):
        roll = rng.integers(10)
        if roll == 0:
            messages.append(bytes(rng.integers(0, 256, rng.integers(0, 40), dtype=np.uint8)))
            continue
        body: dict = {"type": _EVENTS[rng.integers(len(_EVENTS))]}
        for field in ("session", "audio", "event_id", "content", "delegation_id", "item"):
            if rng.random() < 0.4:
                body[field] = _VALUES[rng.integers(len(_VALUES))]
        if rng.random() < 0.2:
            body["type"] = _VALUES[rng.integers(len(_VALUES))]
        text = json.dumps(body)
        if roll == 1:
            text = text[:rng.integers(len(text))]
        elif roll == 2:
            text = "[" * 100000
        messages.append(text)
    return messages


def test_fuzzed_messages_get_an_event_and_a_short_answer():
    for protocol in (make()[0], started()[0]):
        for message in fuzz_messages(7, 1500):
            event = protocol.parse(message)
            if isinstance(event, ProtocolError):
                [answer] = protocol.error(event)
                assert len(answer) < 1200 and json.loads(answer)["error"]["code"] == event.code
            elif isinstance(event, AudioIn):
                assert len(event.payload) % (protocol.input_spec.format.bytes_per_sample or 1) == 0
            else:
                assert isinstance(event, InputEnd | Reply | Reconfigure), event
        assert all(json.loads(m) for m in protocol.end(end("stop")))


async def test_a_fuzzing_peer_harms_no_other_session_and_frees_its_slot(nursery):
    server = await _server(nursery, None, "backend.options.delay_frames=0", "runtime.slots=2")
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions"
    headers = [("Authorization", f"Bearer {KEY}")]
    audio = tone(24000)
    result = {}

    async def fuzzer() -> None:
        sessions = 0
        messages = fuzz_messages(11, 400)
        while messages:
            sessions += 1
            async with trio_websocket.open_websocket_url(url, extra_headers=headers) as ws:
                await ws.send_message(json.dumps({"type": "session.start", "session": {"model": "m"}}))
                try:
                    while messages:
                        await ws.send_message(messages.pop(0))
                    await ws.send_message(json.dumps({"type": "session.close"}))
                    while True:
                        await ws.get_message()
                except trio_websocket.ConnectionClosed:
                    pass  # a fatal message: the server closed; connect again for the rest
        result["fuzz_sessions"] = sessions

    async def healthy() -> None:
        result["events"] = await _converse(url, audio)

    with trio.fail_after(PATIENCE * 2):
        async with trio.open_nursery() as inner:
            inner.start_soon(fuzzer)
            inner.start_soon(healthy)
        while server.runtime.scheduler.free_slots != 2:
            await trio.sleep(0.01)
    events = result["events"]
    check_sequence(events)
    heard = b"".join(base64.b64decode(e["delta"]) for e in events if e["type"] == "session.output_audio.delta")
    assert heard[:len(audio)] == audio and events[-1]["reason"] == "close_requested"
    assert result["fuzz_sessions"] >= 1
