"""The raw duplex translator (protocols/raw.py) by plain calls: no runtime, no socket."""

from __future__ import annotations

import json

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.protocols.events import AudioIn, InputEnd, ProtocolError, Reply, SessionEnd
from duplexrt.protocols.raw import RawTranslator
from duplexrt.reasons import FinishReason

F32 = AudioSpec.create(AudioFormat.PCM_F32LE, None, model_rate=24000)
S16 = AudioSpec.create(AudioFormat.PCM_S16LE, 16000, model_rate=24000)


def test_binary_is_audio_as_is():
    payload = b"\x01\x02\x03\x04"
    event = RawTranslator(F32).parse(payload)
    assert isinstance(event, AudioIn) and event.payload == payload


def test_control_messages():
    protocol = RawTranslator(F32)
    assert isinstance(protocol.parse('{"type": "input.end"}'), InputEnd)
    reply = protocol.parse('{"type": "ping"}')
    assert isinstance(reply, Reply) and [json.loads(m) for m in reply.messages] == [{"type": "pong"}]


def test_bad_control_messages_are_protocol_errors_that_say_what_is_wrong():
    protocol = RawTranslator(F32)
    cases = {"not json": "invalid_json", "[1, 2]": "invalid_event", '{"type": 3}': "invalid_event",
             '{"type": "dance"}': "unknown_event"}
    for message, code in cases.items():
        event = protocol.parse(message)
        assert isinstance(event, ProtocolError) and event.code == code, message
    assert "'dance'" in protocol.parse('{"type": "dance"}').message


def test_announce_says_both_formats_and_is_off_by_default():
    assert RawTranslator(F32).start() == []
    [created] = RawTranslator(S16, F32, announce=True).start()
    assert json.loads(created) == {"type": "session.created",
                                   "input": {"format": "pcm_s16le", "sample_rate": 16000},
                                   "output": {"format": "pcm_f32le", "sample_rate": 24000}}
    assert RawTranslator(S16).output_spec is S16  # the output defaults to the input


def test_outputs():
    protocol = RawTranslator(F32)
    assert protocol.audio_out(b"abc", 1) == [b"abc"]
    assert protocol.audio_out(b"", 0) == []  # nothing to send is no message
    assert [json.loads(m) for m in protocol.text_out("hi")] == [{"type": "text", "text": "hi"}]
    assert [json.loads(m) for m in protocol.error(ProtocolError("x", "y"))] == [
        {"type": "error", "code": "x", "message": "y"}]


def test_end_carries_the_reason_and_usage_and_the_error_only_when_there_is_one():
    protocol = RawTranslator(F32)
    [plain] = protocol.end(SessionEnd(FinishReason.STOP, 3, 3, 0.24, 0.24))
    body = json.loads(plain)
    assert body["type"] == "session.end" and body["reason"] == "stop" and "error" not in body
    assert body["usage"]["frames_in"] == 3 and body["usage"]["seconds_out"] == 0.24
    assert "reason" not in body["usage"] and "error" not in body["usage"]
    [failed] = protocol.end(SessionEnd(FinishReason.ERROR, 1, 0, 0.08, 0.0, error="boom"))
    assert json.loads(failed)["error"] == "boom"
