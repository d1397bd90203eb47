"""The Moshi protocol: the translator on its own (every kind, both ways), then whole sessions over
in-memory transports on the real runtime, with Ogg Opus made and read by sphn as Kyutai's clients
do, through the echo backend (delay 0: each session hears its own input back)."""

from __future__ import annotations

import json
import math

import attrs
import numpy as np
import pytest
import sphn
import trio

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.config import load_config
from duplexrt.runtime import open_runtime
from duplexrt.protocols.events import AudioIn, EndTurn, Ignored, ProtocolError, SessionEnd
from duplexrt.protocols.moshi import CONTROL_CODES, HANDSHAKE_MESSAGE, MoshiTranslator
from duplexrt.reasons import CloseCode
from duplexrt.wire.transport import MemoryTransport, TransportClosed, memory_transport_pair

RATE = 24000
PATIENCE = 10.0
#: Output lags input by the codec delays of two Opus round trips; the alignment searches this far.
MAX_LAG = 2000
#: Kinds the server may send: each one Kyutai's web client decodes without throwing.
SERVER_KINDS = {0, 1, 2, 4, 5}


def echo_config():
    return load_config(None, ["backend.options.delay_frames=0"])


def kind_and_payload(message: bytes) -> tuple[int, bytes]:
    assert isinstance(message, bytes) and message, message
    return message[0], message[1:]


def metadata_of(message: bytes) -> dict:
    kind, payload = kind_and_payload(message)
    assert kind == 4
    return json.loads(payload.decode())


# -- the translator alone ---------------------------------------------------------------------------


def test_audio_is_ogg_opus_at_24_khz_both_ways_whatever_the_model_rate():
    for model_rate in (24000, 16000, 44100):
        protocol = MoshiTranslator(model_rate=model_rate)
        assert protocol.input_spec == protocol.output_spec == AudioSpec(AudioFormat.OPUS, 24000)
    with pytest.raises(ValueError):
        MoshiTranslator(model_rate=0)


def test_start_is_the_nine_byte_handshake_kyutai_rust_servers_send():
    assert HANDSHAKE_MESSAGE == b"\x00" + b"\x00\x00\x00\x00" + b"\x00\x00\x00\x00"
    protocol = MoshiTranslator()
    assert protocol.start() == [HANDSHAKE_MESSAGE]
    assert protocol.start() == [HANDSHAKE_MESSAGE]  # a fresh list each time
    protocol.start().append(b"junk")
    assert protocol.start() == [HANDSHAKE_MESSAGE]


def test_metadata_follows_the_handshake_as_strict_json():
    info = {"model": "kyutai/moshiko", "slots": 64, "name": "Ünïcode ✓"}
    handshake, metadata = MoshiTranslator(metadata=info).start()
    assert handshake == HANDSHAKE_MESSAGE
    assert metadata_of(metadata) == info
    assert MoshiTranslator(metadata={}).start()[1] == b"\x04{}"


def test_metadata_that_is_not_strict_json_fails_at_construction():
    with pytest.raises(TypeError):
        MoshiTranslator(metadata={"bad": object()})
    with pytest.raises(ValueError):  # JSON.parse in the web client rejects NaN
        MoshiTranslator(metadata={"bad": math.nan})
    with pytest.raises(TypeError):
        MoshiTranslator(metadata=["not", "an", "object"])


def test_audio_messages_carry_their_payload_without_the_kind_byte():
    protocol = MoshiTranslator()
    payload = b"OggS" + bytes(range(256)) * 3
    event = protocol.parse(b"\x01" + payload)
    assert isinstance(event, AudioIn)
    assert bytes(event.payload) == payload
    event = protocol.parse(bytearray(b"\x01\x02\x03"))
    assert isinstance(event, AudioIn) and bytes(event.payload) == b"\x02\x03"


def test_an_audio_message_with_no_audio_is_ignored():
    # Kyutai's gradio client sends b"\x01" whenever its Opus writer returned nothing.
    assert MoshiTranslator().parse(b"\x01") == Ignored()


def test_end_turn_ends_the_turn_for_a_translation_models_flush():
    # A reply with nothing to send: for a model with no flush it changes nothing (test_end_of_input).
    assert MoshiTranslator().parse(bytes([3, CONTROL_CODES["end_turn"]])) == EndTurn(())
    assert MoshiTranslator().parse(b"\x03\x01\x00") == Ignored(), "a control message is one code"


@pytest.mark.parametrize("message", [
    pytest.param(HANDSHAKE_MESSAGE, id="handshake"),
    pytest.param(b"\x00", id="bare-handshake"),
    pytest.param(b"\x02hello", id="text"),
    pytest.param(b"\x02", id="empty-text"),
    *(pytest.param(bytes([3, code]), id=f"control-{name}") for name, code in CONTROL_CODES.items()
      if name != "end_turn"),
    pytest.param(b"\x03\x09", id="unknown-control"),
    pytest.param(b"\x03", id="control-without-code"),
    pytest.param(b'\x04{"key": "value"}', id="metadata"),
    pytest.param(b"\x04not json", id="bad-metadata"),
    pytest.param(b"\x05oops", id="error"),
    pytest.param(b"\x06", id="ping"),
    pytest.param(b"\x07\x05colored", id="colored-text"),
    pytest.param(b"\x08image", id="image"),
    pytest.param(b"\x09codes", id="codes"),
    pytest.param(b"\x2a", id="unknown-42"),
    pytest.param(b"\xff" + bytes(100), id="unknown-255"),
])
def test_every_other_kind_from_a_client_is_ignored(message):
    assert MoshiTranslator().parse(message) == Ignored()


def test_control_codes_are_kyutais():
    assert CONTROL_CODES == {"start": 0, "end_turn": 1, "pause": 2, "restart": 3}


@pytest.mark.parametrize("text", ["", "hello", '{"type": "input.end"}'])
def test_a_text_websocket_message_is_fatal_unsupported_data(text):
    event = MoshiTranslator().parse(text)
    assert isinstance(event, ProtocolError)
    assert event.code == "text_not_supported"
    assert event.fatal and event.close_code == CloseCode.UNSUPPORTED_DATA == 1003
    assert event.message


def test_an_empty_binary_message_is_an_error_but_not_fatal():
    event = MoshiTranslator().parse(b"")
    assert isinstance(event, ProtocolError)
    assert event.code == "empty_message" and not event.fatal and event.message


def test_audio_out_prefixes_kind_1():
    protocol = MoshiTranslator()
    assert protocol.audio_out(b"OggS-page", 3) == [b"\x01OggS-page"]
    assert protocol.audio_out(b"", 2) == []  # an encoder still filling a page: nothing to send


def test_text_out_is_kind_2_utf8():
    protocol = MoshiTranslator()
    assert protocol.text_out(" bonjour") == [b"\x02 bonjour"]
    assert protocol.text_out("日本語 ✓") == [b"\x02" + "日本語 ✓".encode()]
    assert protocol.text_out("\ud800") == [b"\x02?"]  # a lone surrogate cannot kill the writer


def test_error_is_kind_5_with_the_message():
    protocol = MoshiTranslator()
    error = ProtocolError("invalid_audio", "corrupt Ogg Opus stream: é")
    assert protocol.error(error) == [b"\x05" + "corrupt Ogg Opus stream: é".encode()]


def test_end_is_a_session_end_metadata_message():
    protocol = MoshiTranslator(metadata={"model": "m"})
    end = SessionEnd(reason="stop", frames_in=10, frames_out=9, seconds_in=0.8, seconds_out=0.72)
    (message,) = protocol.end(end)
    assert metadata_of(message) == {
        "type": "session.end", "reason": "stop",
        "usage": {"frames_in": 10, "frames_out": 9, "seconds_in": 0.8, "seconds_out": 0.72},
    }
    failed = attrs.evolve(end, reason="error", error="the model failed")
    (message,) = protocol.end(failed)
    body = metadata_of(message)
    assert body["reason"] == "error" and body["error"] == "the model failed"


def test_every_server_message_is_a_kind_kyutais_web_client_decodes():
    protocol = MoshiTranslator(metadata={"a": 1})
    messages = [
        *protocol.start(),
        *protocol.audio_out(b"x", 1),
        *protocol.text_out("t"),
        *protocol.error(ProtocolError("c", "m")),
        *protocol.end(SessionEnd("stop", 0, 0, 0.0, 0.0, error="e")),
    ]
    for message in messages:
        assert isinstance(message, bytes) and message[0] in SERVER_KINDS
        if message[0] == 4:
            metadata_of(message)  # strict JSON


def test_the_callers_words_go_as_metadata_only_to_a_client_that_asked_in_the_url():
    """Kyutai's and NVIDIA's web clients throw on an unknown kind and log every metadata message
    they cannot match: the caller's words are opt-in (``?input_text=1``), a kind-4 message."""
    from duplexrt.transcribe.pieces import TranscriptPiece

    pieces = [TranscriptPiece(" hello", 9, 2, 220.0), TranscriptPiece("", 10, 3, 300.0, flushed=True)]
    assert MoshiTranslator().input_text(pieces) == []  # no transcriber offered
    for query in ({}, {"input_text": "0"}, {"input_text": ""}):
        protocol = MoshiTranslator()
        protocol.offer_transcripts("stt-tiny", 500.0, query=query)
        assert protocol.input_text(pieces) == []
    protocol = MoshiTranslator()
    protocol.offer_transcripts("stt-tiny", 500.0, query={"input_text": "1", "text_prompt": "x"})
    [message] = protocol.input_text(pieces)  # a piece without text sends nothing
    assert message[0] in SERVER_KINDS
    assert metadata_of(message) == {"type": "input_text", "text": " hello", "frame": 9, "audio_ms": 220.0}


# -- whole sessions ------------------------------------------------------------------------------------


def chirp_signal() -> tuple[np.ndarray, int]:
    """A 1.5 s chirp (not periodic, so the alignment is unique) then 0.5 s of silence that pushes
    it through every buffer on the way; returns the signal and the length of the chirp."""
    t = np.arange(int(1.5 * RATE)) / RATE
    chirp = 0.4 * np.sin(2 * np.pi * (200 * t + 200 * t * t))
    return np.concatenate([chirp, np.zeros(RATE // 2)]).astype(np.float32), len(t)


def opus_messages(signal: np.ndarray, chunk: int = 600) -> list[bytes]:
    """``signal`` as Kyutai's clients send it: Ogg Opus from sphn, one kind-1 message per chunk
    of PCM that produced any bytes (at 600 samples, some chunks produce none)."""
    writer = sphn.OpusStreamWriter(RATE)
    messages = []
    empty_chunks = 0
    for start in range(0, len(signal), chunk):
        data = writer.append_pcm(signal[start:start + chunk])
        if data:
            messages.append(b"\x01" + data)
        else:
            empty_chunks += 1
    assert empty_chunks > 0 and len(messages) > 20
    return messages


def correlation_after_alignment(sent: np.ndarray, received: np.ndarray, length: int) -> tuple[float, int]:
    """The best normalised correlation of ``sent[skip:length]`` with ``received`` shifted by a lag
    of 0..MAX_LAG samples (the first 0.1 s, where the codecs settle, is left out)."""
    skip = RATE // 10
    a = sent[skip:length].astype(np.float64)
    assert len(received) >= length + MAX_LAG
    best = (-1.0, -1)
    for lag in range(MAX_LAG + 1):
        b = received[skip + lag:length + lag].astype(np.float64)
        value = float(np.dot(a, b) / math.sqrt(np.dot(a, a) * np.dot(b, b) or 1.0))
        best = max(best, (value, lag))
    return best


@attrs.define
class MoshiClient:
    """One end of a Moshi session: what it sent and everything it received, audio decoded."""

    transport: MemoryTransport
    received: list[bytes] = attrs.Factory(list)
    pcm: list[np.ndarray] = attrs.Factory(list)
    samples: int = 0
    want_samples: int = 0
    got_audio: trio.Event = attrs.Factory(trio.Event)
    enough_audio: trio.Event = attrs.Factory(trio.Event)
    closed: TransportClosed | None = None
    reader: sphn.OpusStreamReader = attrs.Factory(lambda: sphn.OpusStreamReader(RATE))

    async def receive_all(self) -> None:
        while True:
            try:
                message = await self.transport.receive()
            except TransportClosed as closed:
                self.closed = closed
                return
            assert isinstance(message, bytes), f"text message from a Moshi server: {message!r}"
            kind, payload = kind_and_payload(message)
            assert kind in SERVER_KINDS, message[:20]
            if not self.received:
                assert message == HANDSHAKE_MESSAGE, "the handshake must come first"
            self.received.append(message)
            if kind == 1:
                pcm = self.reader.append_bytes(payload)
                self.pcm.append(pcm)
                self.samples += len(pcm)
                if self.samples:
                    self.got_audio.set()
                if self.want_samples and self.samples >= self.want_samples:
                    self.enough_audio.set()

    async def send_all(self, messages: list[bytes | str]) -> None:
        for message in messages:
            await self.transport.send(message)

    def kinds(self, kind: int) -> list[bytes]:
        return [m[1:] for m in self.received if m[0] == kind]

    def audio(self) -> np.ndarray:
        return np.concatenate(self.pcm) if self.pcm else np.zeros(0, np.float32)


def with_extras(messages: list[bytes]) -> list[bytes]:
    """``messages`` with everything a client may send that is not audio mixed in: a handshake, a
    ping, control codes, an unknown kind, metadata, text and error kinds, a bare audio kind."""
    extras = {
        0: HANDSHAKE_MESSAGE, 2: b"\x06", 4: b"\x03\x00", 6: b"\x63unknown kind", 8: b"\x03\x01",
        10: b'\x04{"client": "test"}', 12: b"\x02client text", 14: b"\x05client error", 16: b"\x01",
        18: b"\x07\x01colored",
    }
    out = []
    for i, message in enumerate(messages):
        if i in extras:
            out.append(extras[i])
        out.append(message)
    return out


async def test_opus_round_trip_through_a_session_with_pings_and_unknown_kinds_mixed_in():
    signal, length = chirp_signal()
    messages = with_extras(opus_messages(signal))
    info = {"model": "echo", "slots": 128}
    result: dict[str, SessionEnd] = {}
    async with open_runtime(echo_config()) as runtime:
        client, server = memory_transport_pair()
        moshi = MoshiClient(client, want_samples=length + MAX_LAG)

        async def serve() -> None:
            result["end"] = await runtime.serve(server, MoshiTranslator(metadata=info))

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                nursery.start_soon(moshi.receive_all)
                await moshi.send_all(messages)
                await moshi.enough_audio.wait()
                await client.close()  # the protocol has no end of input: the client hangs up
        assert runtime.sessions == set() and runtime.metrics.sessions_active == 0

    assert moshi.received[0] == HANDSHAKE_MESSAGE
    assert metadata_of(moshi.received[1]) == info
    assert moshi.kinds(5) == [], "pings, controls and unknown kinds must not be errors"
    assert moshi.kinds(2) == []  # the echo model says nothing
    end = result["end"]
    assert end.reason == "client_closed" and end.error is None
    assert end.frames_out >= length // 1920
    assert client.close_code == 1000 and server.close_code == 1000
    value, lag = correlation_after_alignment(signal, moshi.audio(), length)
    assert value > 0.9, (value, lag)
    assert 0 < lag < MAX_LAG


async def test_a_text_message_closes_its_session_with_1003_and_leaves_a_concurrent_one_alone():
    signal, length = chirp_signal()
    healthy_messages = opus_messages(signal)
    half = len(healthy_messages) // 2
    results: dict[str, SessionEnd] = {}
    async with open_runtime(echo_config()) as runtime:
        healthy_client, healthy_server = memory_transport_pair()
        bad_client, bad_server = memory_transport_pair()
        healthy = MoshiClient(healthy_client, want_samples=length + MAX_LAG)
        bad = MoshiClient(bad_client)

        async def serve(name: str, transport: MemoryTransport) -> None:
            results[name] = await runtime.serve(transport, MoshiTranslator())

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve, "healthy", healthy_server)
                nursery.start_soon(healthy.receive_all)
                await healthy.send_all(healthy_messages[:half])
                await healthy.got_audio.wait()  # the healthy session is mid-stream, audio flowing

                async with trio.open_nursery() as bad_nursery:
                    bad_nursery.start_soon(serve, "bad", bad_server)
                    bad_nursery.start_soon(bad.receive_all)
                    try:
                        await bad.send_all([*opus_messages(signal)[:5], '{"type": "input.end"}'])
                    except TransportClosed:
                        pass

                await healthy.send_all(healthy_messages[half:])
                await healthy.enough_audio.wait()
                await healthy_client.close()

    # The misbehaving session: an error, then the end, then close 1003 with the reason.
    bad_end = results["bad"]
    assert bad_end.reason == "error" and bad_end.error
    assert bad.closed is not None
    assert bad.closed.code == CloseCode.UNSUPPORTED_DATA == 1003
    assert bad.closed.reason == bad_end.error[:120] and "binary" in bad.closed.reason
    assert bad_server.close_code == 1003 and bad_server.close_reason == bad.closed.reason
    errors = bad.kinds(5)
    assert errors == [bad_end.error.encode()]
    last = metadata_of(bad.received[-1])
    assert last["type"] == "session.end" and last["reason"] == "error"
    assert last["error"] == bad_end.error
    assert bad.received.index(b"\x05" + errors[0]) < len(bad.received) - 1

    # The healthy one never noticed.
    assert results["healthy"].reason == "client_closed"
    assert healthy.kinds(5) == [] and healthy.closed is not None and healthy.closed.code == 1000
    value, lag = correlation_after_alignment(signal, healthy.audio(), length)
    assert value > 0.9, (value, lag)


async def test_an_empty_message_gets_an_error_and_the_session_goes_on_until_shutdown():
    signal, length = chirp_signal()
    messages = opus_messages(signal)
    async with open_runtime(echo_config()) as runtime:
        client, server = memory_transport_pair()
        moshi = MoshiClient(client, want_samples=length)
        result: dict[str, SessionEnd] = {}

        async def serve(task_status=trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                task_status.started(scope)
                result["end"] = await runtime.serve(server, MoshiTranslator())

        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                scope = await nursery.start(serve)
                nursery.start_soon(moshi.receive_all)
                await moshi.send_all([b"", *messages])
                await moshi.enough_audio.wait()
                scope.cancel()  # the server stops serving mid-session

    errors = moshi.kinds(5)
    assert len(errors) == 1 and b"empty" in errors[0]
    assert moshi.samples >= length  # the empty message did not stop the audio
    assert "end" not in result  # cancelled: serve did not return
    last = metadata_of(moshi.received[-1])
    assert last["type"] == "session.end" and last["reason"] == "shutdown"
    assert last["usage"]["frames_in"] >= last["usage"]["frames_out"] > 0
    assert last["usage"]["seconds_out"] == pytest.approx(last["usage"]["frames_out"] * 0.08)
    assert moshi.closed is not None and moshi.closed.code == CloseCode.GOING_AWAY == 1001
    assert server.close_code == CloseCode.GOING_AWAY
