"""Twilio Media Streams (``/twilio/media``): the translator with plain calls, then calls over a
real WebSocket on loopback, the client writing each event byte for byte as Twilio's docs show it
("Media Streams - WebSocket Messages"), against the echo backend."""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import trio
import trio_websocket

from conftest import PATIENCE
from duplexrt.audio.g711 import ulaw_decode, ulaw_encode
from duplexrt.client.connection import open_connection
from duplexrt.client.protocols import Ended, Other, TwilioClient, client_for_url
from duplexrt.config import load_config
from duplexrt.protocols.events import AudioIn, Ignored, InputEnd, ProtocolError, SessionEnd
from duplexrt.protocols.twilio import TwilioTranslator
from duplexrt.reasons import FinishReason
from duplexrt.server import Server

SID = "MZ18ad3ab5a668481ce02b83e7395059f0"
CALL = "CA5f9b3bf1a3e2d1a6d1b1e3b1c1d1e1f1"
ACCOUNT = "AC5ef8732a3c49700934481addd5ce1659"

# As Twilio's docs write them (their key order and string-typed numbers).
CONNECTED = '{"event": "connected", "protocol": "Call", "version": "1.0.0"}'


def start_event(sequence: int = 1, **media_format: object) -> str:
    fmt = {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1, **media_format}
    return json.dumps({"event": "start", "sequenceNumber": str(sequence), "start": {
        "accountSid": ACCOUNT, "streamSid": SID, "callSid": CALL, "tracks": ["inbound"],
        "customParameters": {"FirstName": "Jane"}, "mediaFormat": fmt}, "streamSid": SID})


def media_event(sequence: int, payload: bytes | str, *, chunk: int | None = None, track: str = "inbound",
                stream: str = SID) -> str:
    chunk = sequence - 1 if chunk is None else chunk
    text = payload if isinstance(payload, str) else base64.b64encode(payload).decode()
    return json.dumps({"event": "media", "sequenceNumber": str(sequence), "media": {
        "track": track, "chunk": str(chunk), "timestamp": str(20 * (chunk - 1)), "payload": text},
        "streamSid": stream})


def mark_event(sequence: int, name: str) -> str:
    return json.dumps({"event": "mark", "sequenceNumber": str(sequence), "streamSid": SID, "mark": {"name": name}})


def stop_event(sequence: int) -> str:
    return json.dumps({"event": "stop", "sequenceNumber": str(sequence), "streamSid": SID,
                       "stop": {"accountSid": ACCOUNT, "callSid": CALL}})


def dtmf_event(sequence: int) -> str:
    return json.dumps({"event": "dtmf", "streamSid": SID, "sequenceNumber": str(sequence),
                       "dtmf": {"track": "inbound_track", "digit": "1"}})


def started(**kwargs) -> TwilioTranslator:
    translator = TwilioTranslator(**kwargs)
    assert isinstance(translator.parse(CONNECTED), Ignored)
    assert isinstance(translator.parse(start_event()), Ignored)
    return translator


def end(reason: FinishReason = FinishReason.STOP) -> SessionEnd:
    return SessionEnd(reason, 10, 10, 0.8, 0.8)


# -- the translator -------------------------------------------------------------------------------


def test_the_call_starts_at_start_and_media_is_the_callers_audio():
    translator = TwilioTranslator()
    assert translator.input_spec == translator.output_spec
    assert (translator.input_spec.format.value, translator.input_spec.sample_rate) == ("g711_ulaw", 8000)
    assert isinstance(translator.parse(CONNECTED), Ignored) and not translator.started
    assert translator.start() == []  # the server says nothing first
    translator.parse(start_event())
    assert translator.started and translator.stream_sid == SID and translator.call_sid == CALL
    audio = bytes(range(160))
    assert translator.parse(media_event(2, audio)) == AudioIn(audio)


def test_media_out_and_marks_are_exactly_the_three_messages_twilio_takes():
    translator = started(frame_seconds=0.08, mark_every_seconds=0.16)
    first = translator.audio_out(b"\x01" * 640, 1)
    assert [json.loads(m) for m in first] == [
        {"event": "media", "streamSid": SID, "media": {"payload": base64.b64encode(b"\x01" * 640).decode()}}]
    second = translator.audio_out(b"\x02" * 640, 1)
    assert json.loads(second[0])["event"] == "media"
    assert json.loads(second[1]) == {"event": "mark", "streamSid": SID, "mark": {"name": "duplexrt-2"}}
    assert translator.audio_out(b"", 0) == [] and translator.text_out("hi") == []
    # Twilio sends the mark back once the audio before it has played: noted, nothing answered.
    assert translator.buffered_frames == 2
    assert isinstance(translator.parse(mark_event(9, "duplexrt-2")), Ignored)
    assert translator.played_frames == 2 and translator.buffered_frames == 0
    for name in ("someone-else", "duplexrt-99", "duplexrt-x"):  # not ours, or ahead of what was sent
        assert isinstance(translator.parse(mark_event(10, name)), Ignored)
    assert translator.played_frames == 2


def test_stop_is_the_end_of_input_and_the_last_message_is_a_mark_naming_the_reason():
    translator = TwilioTranslator()
    assert translator.audio_out(b"\x01" * 640, 1) == [] and translator.end(end()) == []  # no stream yet
    translator.parse(start_event())
    assert isinstance(translator.parse(stop_event(3)), InputEnd)
    assert isinstance(translator.parse(stop_event(4)), Ignored)  # stop twice: nothing more
    assert isinstance(translator.parse(media_event(5, b"\x01" * 160)), Ignored)
    assert len(translator.audio_out(b"\x01" * 640, 1)) == 1  # the answer to what came before stop
    for reason in (FinishReason.STOP, FinishReason.ERROR):
        [last] = translator.end(end(reason))
        assert json.loads(last) == {"event": "mark", "streamSid": SID, "mark": {
            "name": f"duplexrt-end:{reason};frames_in=10;frames_out=10"}}


@pytest.mark.parametrize("message, code, close", [
    (b"\x00\x01", "binary_not_supported", 1003),
    ("{not json", "invalid_json", 1007),
    ('["event", "media"]', "invalid_event", 1007),
    ('{"event": 7}', "invalid_event", 1007),
])
def test_what_is_not_twilios_protocol_at_all_is_fatal(message, code, close):
    event = TwilioTranslator().parse(message)
    assert isinstance(event, ProtocolError) and event.fatal and event.code == code and event.close_code == close


def test_media_before_start_is_fatal():
    event = TwilioTranslator().parse(media_event(2, b"\xff" * 160))
    assert isinstance(event, ProtocolError) and event.fatal and event.code == "media_before_start"
    assert event.close_code == 1008


@pytest.mark.parametrize("message, code", [
    (start_event(encoding="audio/l16"), "unsupported_format"),
    (start_event(sampleRate=16000), "unsupported_format"),
    (start_event(channels=2), "unsupported_format"),
    ('{"event": "start", "sequenceNumber": "1", "start": {"accountSid": "AC1"}}', "invalid_start"),
    ('{"event": "start", "sequenceNumber": "1"}', "invalid_start"),
])
def test_a_start_the_route_cannot_serve_is_fatal(message, code):
    event = TwilioTranslator().parse(message)
    assert isinstance(event, ProtocolError) and event.fatal and event.code == code


def test_a_second_start_is_fatal():
    event = started().parse(start_event(2))
    assert isinstance(event, ProtocolError) and event.fatal and event.code == "start_repeated"


@pytest.mark.parametrize("message, code", [
    (media_event(2, "not base64!"), "invalid_base64"),
    (media_event(2, ""), "invalid_media"),
    ('{"event": "media", "sequenceNumber": "2", "streamSid": "%s"}' % SID, "invalid_media"),
    (media_event(2, b"\x00" * 160, stream="MZother"), "wrong_stream"),
    (media_event(2, b"\x00" * 8800), "audio_too_long"),  # 1.1 s, over max_message_seconds=1
    (json.dumps({"event": "media", "sequenceNumber": "two", "media": {"payload": "AAAA"}}), "invalid_sequence"),
])
def test_a_bad_media_message_is_dropped_and_the_call_goes_on(message, code, caplog):
    translator = started(max_message_seconds=1.0)
    event = translator.parse(message)
    assert isinstance(event, ProtocolError) and not event.fatal and event.code == code
    assert translator.error(event) == [] and translator.error(event) == []  # never sent to Twilio
    assert translator.dropped[code] == 2
    assert sum(code in record.getMessage() for record in caplog.records) == 1  # logged once per kind
    assert translator.parse(media_event(9, b"\x00" * 160)) == AudioIn(b"\x00" * 160)


def test_sequence_numbers_that_go_back_are_dropped_and_gaps_are_accepted():
    translator = started()
    assert isinstance(translator.parse(media_event(3, b"\x01" * 160)), AudioIn)
    for stale in (3, 2):
        event = translator.parse(media_event(stale, b"\x02" * 160))
        assert isinstance(event, ProtocolError) and event.code == "out_of_order" and not event.fatal
    assert translator.parse(media_event(7, b"\x03" * 160)) == AudioIn(b"\x03" * 160)  # 4-6 lost: a gap
    assert isinstance(translator.parse(mark_event(8, "x")), Ignored)
    assert isinstance(translator.parse(media_event(8, b"\x04" * 160)), ProtocolError)  # numbered with the rest
    # A message with no number is taken (a lenient peer).
    assert isinstance(translator.parse(json.dumps({"event": "media", "media": {"payload": "AAAA"}})), AudioIn)


def test_other_tracks_dtmf_and_unknown_events_are_ignored():
    translator = started()
    assert isinstance(translator.parse(media_event(2, b"\x01" * 160, track="outbound")), Ignored)
    assert isinstance(translator.parse(dtmf_event(3)), Ignored)
    assert isinstance(translator.parse('{"event": "transcript", "sequenceNumber": "4"}'), Ignored)
    assert translator.unknown == {"transcript": 1}
    assert isinstance(translator.parse(CONNECTED), Ignored)


def test_the_client_writes_the_events_as_twilios_docs_do():
    client = client_for_url("ws://h:1/twilio/media")
    assert isinstance(client, TwilioClient) and not client.greets and client.server_closes
    connected, start = (json.loads(m) for m in client.hello())
    assert connected == json.loads(CONNECTED)
    assert start["sequenceNumber"] == "1" and start["start"]["mediaFormat"]["encoding"] == "audio/x-mulaw"
    media = json.loads(client.audio(b"\x7f" * 160))
    assert media == {"event": "media", "sequenceNumber": "2", "media": {
        "track": "inbound", "chunk": "1", "timestamp": "0", "payload": base64.b64encode(b"\x7f" * 160).decode()},
        "streamSid": client.stream_sid}
    assert json.loads(client.audio(b"\x7f" * 160))["media"]["timestamp"] == "20"
    assert json.loads(client.stop())["sequenceNumber"] == "4"
    translator = TwilioTranslator()
    for message in [*client.hello(), client.audio(b"\x00" * 160)]:
        assert not isinstance(translator.parse(message), ProtocolError)
    out = translator.audio_out(b"\x05" * 640, 1)
    assert bytes(client.parse(out[0])) == b"\x05" * 640  # type: ignore[arg-type]
    assert client.parse(mark_event(1, "duplexrt-1")) == Other("mark", "duplexrt-1")
    ended = client.parse(translator.end(end())[0])
    assert isinstance(ended, Ended) and (ended.reason, ended.frames_in, ended.frames_out) == ("stop", 10, 10)
    assert client.end_input() and json.loads(client.end_input()[0])["event"] == "stop"


# -- calls over a real WebSocket --------------------------------------------------------------------


def tone(seconds: float, hz: float = 440.0) -> bytes:
    """mu-law at 8 kHz."""
    t = np.arange(int(8000 * seconds)) / 8000
    return ulaw_encode((0.3 * np.sin(2 * np.pi * hz * t)).astype(np.float32)).tobytes()


async def _server(nursery, *overrides: str) -> Server:
    config = load_config(None, ["server.port=0", "metrics.log_stats=false", "runtime.slots=1",
                                "backend.options.delay_frames=0", *overrides])
    server = Server(config)
    await nursery.start(server.run)
    return server


def _url(server: Server) -> str:
    return f"ws://127.0.0.1:{server.ports[0]}/twilio/media"


async def _freed(server: Server) -> None:
    """The call's slot comes free (well within the resume window: the route has no resume)."""
    with trio.fail_after(2):
        while server.admitted or server.runtime.sessions:  # type: ignore[union-attr]
            await trio.sleep(0.01)


class Call:
    """Twilio's end of a call: every server message kept, each mark sent back as Twilio does."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self.ws = ws
        self.sequence = 1
        self.messages: list[dict] = []
        self.closed: trio_websocket.ConnectionClosed | None = None
        self.heard = bytearray()

    def next(self) -> int:
        self.sequence += 1
        return self.sequence

    async def begin(self, audio: bytes, start: str | None = None) -> None:
        """As Twilio opens a call: ``connected``, ``start`` (``start_event()`` unless given),
        then ``audio`` in 20 ms ``media`` events."""
        await self.ws.send_message(CONNECTED)
        await self.ws.send_message(start if start is not None else start_event())
        for i in range(0, len(audio), 160):
            await self.ws.send_message(media_event(self.next(), audio[i:i + 160]))

    async def receive(self) -> None:
        try:
            while True:
                message = json.loads(await self.ws.get_message())
                self.messages.append(message)
                if message["event"] == "media":
                    self.heard += base64.b64decode(message["media"]["payload"])
                elif message["event"] == "mark":  # played at once: sent back
                    await self.ws.send_message(mark_event(self.next(), message["mark"]["name"]))
        except trio_websocket.ConnectionClosed as closed:
            self.closed = closed

    async def wait_heard(self, size: int) -> None:
        with trio.move_on_after(3):
            while len(self.heard) < size and self.closed is None:
                await trio.sleep(0.01)
        assert len(self.heard) >= size, (len(self.heard), size, self.closed, [m["event"] for m in self.messages][:5])


async def test_a_call_holds_audio_comes_back_marks_are_acknowledged_and_stop_frees_the_slot(nursery):
    server = await _server(nursery)
    audio = tone(1.2)  # 60 chunks of 20 ms: 15 frames of 80 ms
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws, trio.open_nursery() as inner:
            call = Call(ws)
            inner.start_soon(call.receive)
            await ws.send_message(CONNECTED)
            await ws.send_message(start_event())
            for i in range(0, len(audio), 160):
                await ws.send_message(media_event(call.next(), audio[i:i + 160], chunk=i // 160 + 1))
                if i == 800:
                    await ws.send_message(dtmf_event(call.next()))
            await call.wait_heard(len(audio) - 2 * 640)  # the resamplers hold a little back until the end
            assert server.admitted == 1
            await ws.send_message(stop_event(call.next()))
            while call.closed is None:
                await trio.sleep(0.01)
    assert call.closed.reason.code == 1000
    assert {m["event"] for m in call.messages} == {"media", "mark"}
    for message in call.messages:
        assert set(message) == {"event", "streamSid", message["event"]} and message["streamSid"] == SID
    assert call.messages[-1]["mark"]["name"] == "duplexrt-end:stop;frames_in=15;frames_out=15"
    assert len(audio) <= len(call.heard) <= len(audio) + 640  # all of it, with the resamplers' tail  # all of it, the tail padded to a whole frame
    heard, sent = ulaw_decode(np.frombuffer(bytes(call.heard), np.uint8)), ulaw_decode(np.frombuffer(audio, np.uint8))
    lag = int(np.argmax(np.correlate(heard[:4000], sent[:2000], "valid")))
    assert np.corrcoef(heard[lag:lag + 4000], sent[:4000])[0, 1] > 0.95, "the echo is the caller's tone"
    marks = [m["mark"]["name"] for m in call.messages if m["event"] == "mark"]
    assert marks == ["duplexrt-12", "duplexrt-end:stop;frames_in=15;frames_out=15"]  # about once a second of output (12 frames of 80 ms)
    await _freed(server)
    # The slot is free: a second call is admitted (one slot).
    async with trio_websocket.open_websocket_url(_url(server)) as ws:
        await ws.send_message(CONNECTED)
        await ws.send_message(start_event())
        for i in range(8):  # 160 ms: more than one frame, whatever the resampler holds back
            await ws.send_message(media_event(2 + i, audio[160 * i:160 * (i + 1)]))
        first = json.loads(await ws.get_message())
        assert first["event"] == "media", first
        await ws.send_message(stop_event(10))
        await ws.send_message(stop_event(11))  # stop twice: never read, no hang
        with pytest.raises(trio_websocket.ConnectionClosed) as closed:
            while True:
                await ws.get_message()
        assert closed.value.reason.code == 1000
    await _freed(server)


async def test_bad_messages_are_dropped_and_the_call_goes_on(nursery):
    server = await _server(nursery, "audio.max_message_seconds=1")
    audio = tone(0.32)  # 4 frames
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws, trio.open_nursery() as inner:
            call = Call(ws)
            inner.start_soon(call.receive)
            await ws.send_message(CONNECTED)
            await ws.send_message(start_event())
            await ws.send_message('{"event": "something_new", "sequenceNumber": "2"}')
            call.sequence = 2
            for i in range(0, len(audio), 160):
                sequence = call.next()
                await ws.send_message(media_event(sequence, audio[i:i + 160]))
                await ws.send_message(media_event(sequence, b"\xff" * 160))  # a duplicate: dropped
            await ws.send_message(media_event(call.next(), "%%% not base64 %%%"))
            await ws.send_message(media_event(call.next(), b"\xff" * 16000))  # 2 s: over the limit
            await ws.send_message(media_event(call.next(), b"\xff" * 160, stream="MZnotthiscall"))
            await ws.send_message(stop_event(call.next()))
            while call.closed is None:
                await trio.sleep(0.01)
    assert call.closed.reason.code == 1000
    assert len(audio) <= len(call.heard) <= len(audio) + 640, "only the good media came back, nothing doubled"
    assert call.messages[-1]["mark"]["name"].startswith("duplexrt-end:stop;")
    await _freed(server)


@pytest.mark.parametrize("first, code, words", [
    (media_event(2, b"\xff" * 160), 1008, "media_before_start: media before start"),
    (b"\x00" * 160, 1003, "binary_not_supported: "),
    ("{nope", 1007, "invalid_json: "),
    (start_event(sampleRate=16000), 1008, "unsupported_format: this route takes audio/x-mulaw at 8000 Hz"),
])
async def test_fatal_input_closes_with_a_reason_and_frees_the_slot(nursery, first, code, words):
    server = await _server(nursery)
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.send_message(CONNECTED)
            await ws.send_message(first)
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason.code == code and closed.value.reason.reason.startswith(words)
    await _freed(server)


async def test_a_message_over_the_size_limit_closes_1009(nursery):
    server = await _server(nursery, "server.max_message_bytes=4096")
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.send_message(CONNECTED)
            await ws.send_message(start_event())
            await ws.send_message(media_event(2, b"\xff" * 8000))
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason.code == 1009
    await _freed(server)


async def test_a_dropped_connection_ends_the_call_at_once_with_no_resume(nursery):
    server = await _server(nursery, "runtime.resume_window_s=10")
    client = TwilioClient()
    with trio.fail_after(PATIENCE):
        async with open_connection(_url(server), client) as (transport, _):
            audio = tone(0.16)
            for i in range(0, len(audio), 160):
                await transport.send(client.audio(audio[i:i + 160]))
            assert client.parse(await transport.receive()) is not None  # it answers: the call is up
            transport.abort()  # type: ignore[attr-defined]  # no Close, no stop: the line dropped
            await _freed(server)
    assert server.detached == 0


async def test_a_call_that_never_starts_ends_at_the_idle_timeout(nursery):
    server = await _server(nursery, "server.idle_timeout_s=0.3")
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.send_message(CONNECTED)
            with pytest.raises(trio_websocket.ConnectionClosed):
                await ws.get_message()
    await _freed(server)


async def test_a_drain_ends_the_call_with_its_last_mark_and_1001(nursery):
    server = await _server(nursery, "server.shutdown_grace_s=0.2")
    audio = tone(0.32)
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws, trio.open_nursery() as inner:
            call = Call(ws)
            inner.start_soon(call.receive)
            await call.begin(audio)
            await call.wait_heard(640)
            server.shutdown()  # the call does not end within the grace: it is told to stop
            while call.closed is None:
                await trio.sleep(0.01)
    assert call.closed.reason.code == 1001
    assert call.messages[-1]["mark"]["name"].startswith("duplexrt-end:shutdown;frames_in=")


# -- the API key in start.customParameters; the persona from them ------------------------------------

KEY = "sk-twilio-test"


def start_with(sequence: int = 1, **custom: str) -> str:
    data = json.loads(start_event(sequence))
    data["start"]["customParameters"] = custom
    return json.dumps(data)


def test_with_a_key_to_check_start_must_carry_it_and_nothing_but_connected_may_precede_it():
    protocol = TwilioTranslator()
    protocol.require_key(KEY)
    assert protocol.first_messages == 2
    assert isinstance(protocol.parse(CONNECTED), Ignored)
    assert isinstance(protocol.parse(start_with(api_key=KEY)), Ignored) and protocol.started
    for messages in ([start_event()], [start_with(api_key="wrong")], [CONNECTED, CONNECTED],
                     [media_event(1, b"\xff" * 160)], [dtmf_event(1)]):
        protocol = TwilioTranslator()
        protocol.require_key(KEY)
        event = [protocol.parse(message) for message in messages][-1]
        assert isinstance(event, ProtocolError) and event.fatal and event.code == "unauthorized", messages
        assert event.close_code == 1008 and not protocol.started


async def _key_server(nursery, *overrides: str) -> Server:
    return await _server(nursery, f'server.api_key="{KEY}"', *overrides)


async def test_a_call_with_the_key_in_start_is_served_without_a_key_at_the_upgrade(nursery):
    server = await _key_server(nursery)
    audio = tone(0.32)
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws, trio.open_nursery() as inner:
            call = Call(ws)
            inner.start_soon(call.receive)
            await call.begin(audio, start_with(api_key=KEY))
            await call.wait_heard(len(audio) - 2 * 640)
            await ws.send_message(stop_event(call.next()))
            while call.closed is None:
                await trio.sleep(0.01)
    assert call.closed.reason.code == 1000
    await _freed(server)


@pytest.mark.parametrize("start", [start_event(), start_with(api_key="sk-wrong"), None])
async def test_a_call_without_the_right_key_in_start_is_closed_1008(nursery, start):
    """No key, a wrong one, or no start at all within the first-message timeout."""
    server = await _key_server(nursery, "server.first_message_timeout_s=0.5")
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(_url(server)) as ws:
            await ws.send_message(CONNECTED)
            if start is not None:
                await ws.send_message(start)
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason.code == 1008
    if start is not None:
        assert closed.value.reason.reason.startswith("unauthorized: ")
    await _freed(server)


@pytest.mark.parametrize("path", ["/v1/duplex", "/v1/realtime", "/v1/live/sessions", "/api/chat",
                                  "/twilio/media?resume=abc"])
async def test_every_other_route_still_wants_the_key_at_the_upgrade(nursery, path):
    server = await _key_server(nursery)
    with trio.fail_after(PATIENCE):
        with pytest.raises(trio_websocket.HandshakeError) as refused:
            async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{server.ports[0]}{path}"):
                pass
    assert getattr(refused.value, "status_code", None) == 401


async def test_the_persona_comes_from_custom_parameters_before_the_first_frame(start_server):
    from persona_backend import PersonaEcho

    running = await start_server("runtime.slots=1", "backend.options.delay_frames=0",
                                 backend=lambda config: PersonaEcho(config))
    backend = running.server.runtime.backend
    audio = tone(0.32)
    url = f"ws://127.0.0.1:{running.server.ports[0]}/twilio/media"
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(url) as ws, trio.open_nursery() as inner:
            call = Call(ws)
            inner.start_soon(call.receive)
            await call.begin(audio, start_with(instructions="You are Lou, a pirate.", voice="NATM1"))
            await call.wait_heard(len(audio) - 2 * 640)
            await ws.send_message(stop_event(call.next()))
            while call.closed is None:
                await trio.sleep(0.01)
    assert [(p.voice, p.text, stepped) for _, p, stepped in backend.set_calls] == [
        ("NATM1", "You are Lou, a pirate.", 0)]
    assert backend.unprompted == []


async def test_a_persona_the_model_refuses_ends_the_call_at_start(start_server):
    from persona_backend import PersonaEcho

    running = await start_server("runtime.slots=1", backend=lambda config: PersonaEcho(config))
    url = f"ws://127.0.0.1:{running.server.ports[0]}/twilio/media"
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(url) as ws:
            await ws.send_message(CONNECTED)
            await ws.send_message(start_with(voice="NOBODY"))
            with pytest.raises(trio_websocket.ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.reason.code == 1008 and closed.value.reason.reason.startswith("invalid_persona: ")
    assert running.server.runtime.backend.set_calls == []
