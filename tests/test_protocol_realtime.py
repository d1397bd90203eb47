"""The OpenAI Realtime translator with plain calls (GA and beta naming, turn and duplex mode);
whole sessions through the real runtime and the echo model are in test_realtime_sessions.py.

The translator tests drive it with a fake progress object whose counters the test sets, standing
in for the session that would otherwise count frames in and out.
"""

from __future__ import annotations

import base64
import json

import attrs
import numpy as np
import pytest

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.protocols.events import (
    AudioIn,
    ClearInput,
    ClearOutput,
    ProtocolError,
    Reconfigure,
    Reply,
    SessionEnd,
)
from duplexrt.protocols.realtime import RealtimeTranslator
from realtime_helpers import (
    MODEL_RATE,
    SCAFFOLD,
    b64,
    both_namings,
    names,
    usage,
)
from realtime_schema import every_server_event_is_checked  # noqa: F401  (autouse)


@attrs.define
class FakeProgress:
    """FAKE: the session's counters, set by the test."""

    frames_in: int = 0
    frames_out: int = 0
    frames_dropped: int = 0

    @property
    def frames_answered(self) -> int:
        return self.frames_out + self.frames_dropped


def make(*, beta: bool = False, duplex: bool = False, **kwargs) -> tuple[RealtimeTranslator, FakeProgress]:
    protocol = RealtimeTranslator(beta=beta, duplex=duplex, **kwargs)
    progress = FakeProgress()
    protocol.attach(progress)
    return protocol, progress


def send(protocol: RealtimeTranslator, kind: str, **fields):
    return protocol.parse(json.dumps({"type": kind, **fields}))


def decoded(messages, *, everything: bool = False) -> list[dict]:
    events = [json.loads(m) for m in messages]
    return events if everything else [e for e in events if e["type"] not in SCAFFOLD]


def assert_error(event, code: str, event_id: str | None = None, *, contains: str = "") -> ProtocolError:
    assert isinstance(event, ProtocolError), event
    assert event.code == code, event
    assert event.event_id == event_id
    assert not event.fatal
    assert contains in event.message, event.message
    return event




# -- start ------------------------------------------------------------------------------------------


def test_ga_session_created_describes_pcm16_at_24k():
    protocol, _ = make(model="echo-1", session_id="sess_abc")
    [created] = decoded(protocol.start())
    assert created["type"] == "session.created"
    assert created["event_id"].startswith("event_")
    assert created["session"] == {
        "id": "sess_abc", "object": "realtime.session", "type": "realtime", "model": "echo-1",
        "output_modalities": ["audio"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                  "output": {"format": {"type": "audio/pcm", "rate": 24000}}},
    }
    assert protocol.input_spec == protocol.output_spec == AudioSpec.create("pcm_s16le", 24000, model_rate=MODEL_RATE)


def test_beta_session_created_uses_the_flat_shape():
    protocol, _ = make(beta=True)
    [created] = decoded(protocol.start())
    session = created["session"]
    assert session["id"].startswith("sess_")
    assert session["object"] == "realtime.session"
    assert session["model"] == "duplexrt"
    assert session["modalities"] == ["audio", "text"]
    assert session["input_audio_format"] == session["output_audio_format"] == "pcm16"
    assert "audio" not in session and "type" not in session


def test_session_ids_differ_between_sessions_unless_given():
    first, _ = make()
    second, _ = make()
    ids = {decoded(p.start())[0]["session"]["id"] for p in (first, second)}
    assert len(ids) == 2


@both_namings
def test_duplex_start_opens_a_response_for_the_whole_session(beta):
    protocol, _ = make(beta=beta, duplex=True)
    created, response = decoded(protocol.start())
    assert created["type"] == "session.created"
    assert response["type"] == "response.created"
    assert response["response"]["id"].startswith("resp_")
    assert response["response"]["object"] == "realtime.response"
    assert response["response"]["status"] == "in_progress"
    assert response["response"]["output"] == []
    assert response["response"]["usage"] is None
    assert created["event_id"] != response["event_id"]


# -- parse: what is not a valid event ---------------------------------------------------------------


@pytest.mark.parametrize("message", [b"\x00\x01", bytearray(b"abc")])
def test_binary_messages_are_fatal_with_1003(message):
    protocol, _ = make()
    event = protocol.parse(message)
    assert isinstance(event, ProtocolError)
    assert event.code == "binary_not_supported"
    assert event.fatal and event.close_code == 1003


@pytest.mark.parametrize("text", ["not json", "{", "[" * 100_000])
def test_text_that_is_not_json_is_an_error_not_the_end(text):
    protocol, _ = make()
    assert_error(protocol.parse(text), "invalid_json")


@pytest.mark.parametrize("text", ['[1, 2]', '"session.update"', '{}', '{"type": 3}', '{"type": null}'])
def test_events_need_an_object_with_a_string_type(text):
    protocol, _ = make()
    assert_error(protocol.parse(text), "invalid_event")


def test_invalid_event_keeps_the_client_event_id():
    protocol, _ = make()
    assert_error(protocol.parse('{"type": 1, "event_id": "evt_1"}'), "invalid_event", "evt_1")


def test_unknown_event_is_named():
    protocol, _ = make()
    assert_error(send(protocol, "session.explode", event_id="evt_9"), "unknown_event", "evt_9",
                 contains="session.explode")


@pytest.mark.parametrize("kind", ["transcription_session.update", "input_audio_buffer.dtmf"])
def test_known_but_unsupported_events_are_errors_that_do_not_end_the_session(kind):
    protocol, _ = make()
    assert_error(send(protocol, kind, event_id="evt_u"), "unsupported_event", "evt_u", contains=kind)


# -- input_audio_buffer.append ----------------------------------------------------------------------


def test_append_decodes_base64_audio():
    protocol, _ = make()
    audio = bytes(range(256)) * 15
    event = send(protocol, "input_audio_buffer.append", audio=b64(audio))
    assert event == AudioIn(audio)


def test_append_accepts_mime_style_line_breaks():
    protocol, _ = make()
    audio = bytes(range(200))
    event = send(protocol, "input_audio_buffer.append", audio=base64.encodebytes(audio).decode())
    assert event == AudioIn(audio)


@pytest.mark.parametrize("audio", ["not base64!", "QU=J", "QUJDRA", "=QUJD", "QUJDRA==x", "QUJD\u00e9"])
def test_append_rejects_bad_base64(audio):
    protocol, _ = make()
    assert_error(send(protocol, "input_audio_buffer.append", audio=audio, event_id="evt_b"),
                 "invalid_base64", "evt_b")


def test_append_rejects_half_a_pcm16_sample_naming_the_byte_count():
    protocol, _ = make()
    assert_error(send(protocol, "input_audio_buffer.append", audio=b64(b"\x01\x02\x03"), event_id="e3"),
                 "invalid_audio_length", "e3", contains="3 bytes")


def test_append_accepts_any_byte_count_of_g711():
    protocol, _ = make()
    assert isinstance(send(protocol, "session.update", session={"input_audio_format": "g711_ulaw"}), Reconfigure)
    assert send(protocol, "input_audio_buffer.append", audio=b64(b"\x01\x02\x03")) == AudioIn(b"\x01\x02\x03")


@pytest.mark.parametrize(("fields", "code"), [
    ({}, "missing_required_parameter"),
    ({"audio": None}, "missing_required_parameter"),
    ({"audio": ""}, "invalid_value"),
    ({"audio": 12}, "invalid_type"),
    ({"audio": ["AAAA"]}, "invalid_type"),
])
def test_append_without_audio_is_an_error(fields, code):
    protocol, _ = make()
    assert_error(send(protocol, "input_audio_buffer.append", event_id="evt_m", **fields), code, "evt_m")


def test_errors_without_a_client_event_id_carry_none():
    protocol, _ = make()
    assert_error(send(protocol, "input_audio_buffer.append", audio="!!"), "invalid_base64", None)


# -- session.update ---------------------------------------------------------------------------------


@both_namings
def test_ga_session_update_to_pcmu_reconfigures(beta):
    protocol, _ = make(beta=beta)
    event = send(protocol, "session.update", event_id="evt_s", session={
        "type": "realtime",
        "audio": {"input": {"format": {"type": "audio/pcmu"}}, "output": {"format": {"type": "audio/pcma"}}},
    })
    assert isinstance(event, Reconfigure)
    assert protocol.input_spec == AudioSpec(AudioFormat.G711_ULAW, 8000)
    assert protocol.output_spec == AudioSpec(AudioFormat.G711_ALAW, 8000)
    [updated] = decoded(event.messages)
    assert updated["type"] == "session.updated"
    session = updated["session"]
    if beta:
        assert session["input_audio_format"] == "g711_ulaw"
        assert session["output_audio_format"] == "g711_alaw"
    else:
        assert session["audio"]["input"]["format"] == {"type": "audio/pcmu"}
        assert session["audio"]["output"]["format"] == {"type": "audio/pcma"}


@both_namings
def test_beta_session_update_strings_reconfigure(beta):
    protocol, _ = make(beta=beta)
    event = send(protocol, "session.update", session={"input_audio_format": "g711_alaw",
                                                       "output_audio_format": "g711_ulaw"})
    assert isinstance(event, Reconfigure)
    assert protocol.input_spec == AudioSpec(AudioFormat.G711_ALAW, 8000)
    assert protocol.output_spec == AudioSpec(AudioFormat.G711_ULAW, 8000)
    session = decoded(event.messages)[0]["session"]
    if beta:
        assert (session["input_audio_format"], session["output_audio_format"]) == ("g711_alaw", "g711_ulaw")
    else:
        assert session["audio"]["input"]["format"] == {"type": "audio/pcma"}
    # and back to PCM
    event = send(protocol, "session.update", session={"input_audio_format": "pcm16"})
    assert isinstance(event, Reconfigure)
    assert protocol.input_spec == AudioSpec(AudioFormat.PCM_S16LE, 24000)


@pytest.mark.parametrize("rate", [8000, 16000, 24000, 44100, 48000])
def test_pcm_rates_that_the_runtime_can_resample_are_accepted(rate):
    protocol, _ = make()
    event = send(protocol, "session.update", session={
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": rate}},
                  "output": {"format": {"type": "audio/pcm", "rate": float(rate)}}}})
    assert isinstance(event, Reconfigure if rate != 24000 else Reply)
    assert protocol.input_spec == protocol.output_spec == AudioSpec(AudioFormat.PCM_S16LE, rate)
    session = decoded(event.messages)[0]["session"]
    assert session["audio"]["output"]["format"] == {"type": "audio/pcm", "rate": rate}


def test_beta_session_object_names_a_pcm_rate_other_than_24k():
    protocol, _ = make(beta=True)
    event = send(protocol, "session.update", session={"audio": {"input": {"format": {"type": "audio/pcm",
                                                                                      "rate": 16000}}}})
    session = decoded(event.messages)[0]["session"]
    assert session["input_audio_format"] == "pcm16"
    assert session["input_audio_sample_rate"] == 16000
    assert "output_audio_sample_rate" not in session


@pytest.mark.parametrize(("session", "code", "field"), [
    ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 22050}}}}, "invalid_value",
     "session.audio.input.format.rate"),
    ({"audio": {"output": {"format": {"type": "audio/pcm", "rate": "24000"}}}}, "invalid_value",
     "session.audio.output.format.rate"),
    ({"audio": {"input": {"format": {"type": "audio/opus"}}}}, "unsupported_audio_format",
     "session.audio.input.format.type"),
    ({"audio": {"input": {"format": {"rate": 24000}}}}, "invalid_value", "session.audio.input.format.type"),
    ({"audio": {"output": {"format": 24000}}}, "invalid_type", "session.audio.output.format"),
    ({"input_audio_format": "pcm24"}, "unsupported_audio_format", "session.input_audio_format"),
    ({"output_audio_format": "opus"}, "unsupported_audio_format", "session.output_audio_format"),
])
def test_unsupported_formats_are_refused_and_change_nothing(session, code, field):
    protocol, _ = make()
    before = (protocol.input_spec, protocol.output_spec)
    error = assert_error(send(protocol, "session.update", session=session, event_id="evt_f"), code, "evt_f",
                         contains=field)
    if code == "unsupported_audio_format":
        assert "audio/pcm, audio/pcmu, audio/pcma" in error.message
    if "rate" in field and "22050" in json.dumps(session):
        assert "8000, 16000, 24000, 44100, 48000" in error.message
    assert (protocol.input_spec, protocol.output_spec) == before


def test_a_bad_output_format_leaves_a_good_input_format_unapplied():
    protocol, _ = make()
    assert_error(send(protocol, "session.update", session={"input_audio_format": "g711_ulaw",
                                                           "output_audio_format": "mp3"}),
                 "unsupported_audio_format")
    assert protocol.input_spec == AudioSpec(AudioFormat.PCM_S16LE, 24000)
    # so pcm16 length rules still apply
    assert_error(send(protocol, "input_audio_buffer.append", audio=b64(b"abc")), "invalid_audio_length")


def test_both_shapes_agreeing_is_fine_disagreeing_is_not():
    protocol, _ = make()
    event = send(protocol, "session.update", session={"input_audio_format": "g711_ulaw",
                                                       "audio": {"input": {"format": {"type": "audio/pcmu"}}}})
    assert isinstance(event, Reconfigure)
    assert_error(send(protocol, "session.update", session={"input_audio_format": "pcm16",
                                                           "audio": {"input": {"format": {"type": "audio/pcma"}}}}),
                 "invalid_value", contains="disagree")
    assert protocol.input_spec.format is AudioFormat.G711_ULAW


@pytest.mark.parametrize(("session", "code"), [
    (None, "missing_required_parameter"),
    ("pcm16", "invalid_type"),
    ({"type": "transcription"}, "invalid_value"),
    ({"audio": "pcm16"}, "invalid_type"),
    ({"audio": {"input": "pcm16"}}, "invalid_type"),
])
def test_malformed_session_objects_are_refused(session, code):
    protocol, _ = make()
    fields = {} if session is None else {"session": session}
    assert_error(send(protocol, "session.update", event_id="evt_x", **fields), code, "evt_x")


@both_namings
def test_other_session_fields_are_accepted_but_not_echoed(beta):
    """session.updated shows the configuration in effect: settings the server ignores are not
    kept, so repeated updates cannot grow what the server holds or sends (it once echoed them
    all back, re-sending every key ever set in each session.updated)."""
    protocol, _ = make(beta=beta)
    [first] = decoded(send(protocol, "session.update", session={}).messages)
    event = send(protocol, "session.update", session={
        "instructions": "be brief", "voice": "alloy", "turn_detection": None, "tools": [],
        "model": "gpt-4o", "modalities": ["text"],
        "audio": {"output": {"voice": "marin", "speed": 1.1}, "input": {"noise_reduction": None}},
    })
    assert isinstance(event, Reply)  # no format changed: the codecs keep their state
    [updated] = decoded(event.messages)
    session = updated["session"]
    assert session == first["session"]  # nothing of the above is in effect
    assert not {"instructions", "voice", "tools"} & set(session)
    assert session["model"] == "duplexrt"  # the server's own fields stay the server's
    if beta:
        assert session["modalities"] == ["audio", "text"]  # not the client's ["text"]
        assert "audio" not in session
    else:
        assert session["output_modalities"] == ["audio"] and "modalities" not in session
        assert session["audio"] == {"input": {"format": {"type": "audio/pcm", "rate": 24000}, "turn_detection": None},
                                    "output": {"format": {"type": "audio/pcm", "rate": 24000}}}
    # Many updates with new keys each: the reply stays the size of the first.
    for k in range(50):
        event = send(protocol, "session.update", session={f"key_{k}": "v" * 1000, "audio": {"input": {f"x{k}": 1}}})
    assert len(event.messages[0]) < len(json.dumps(first)) + 20


# -- buffers ----------------------------------------------------------------------------------------


def test_commit_acknowledges_with_item_ids_chained():
    protocol, _ = make()
    send(protocol, "input_audio_buffer.append", audio=b64(b"\0\0"))
    first = send(protocol, "input_audio_buffer.commit")
    assert isinstance(first, Reply)
    [committed] = decoded(first.messages)
    assert committed["type"] == "input_audio_buffer.committed"
    assert committed["previous_item_id"] is None
    assert committed["item_id"].startswith("item_")
    send(protocol, "input_audio_buffer.append", audio=b64(b"\0\0"))
    [second] = decoded(send(protocol, "input_audio_buffer.commit").messages)
    assert second["previous_item_id"] == committed["item_id"]
    assert second["item_id"] != committed["item_id"]


def test_commit_with_nothing_appended_is_an_error():
    protocol, _ = make()
    assert_error(send(protocol, "input_audio_buffer.commit", event_id="c0"), "input_audio_buffer_commit_empty", "c0")
    send(protocol, "input_audio_buffer.append", audio=b64(b"\0\0"))
    assert isinstance(send(protocol, "input_audio_buffer.commit"), Reply)
    assert_error(send(protocol, "input_audio_buffer.commit"), "input_audio_buffer_commit_empty")


def test_input_clear_clears_and_empties_the_commit():
    protocol, _ = make()
    send(protocol, "input_audio_buffer.append", audio=b64(b"\0\0"))
    event = send(protocol, "input_audio_buffer.clear")
    assert isinstance(event, ClearInput)
    assert [m["type"] for m in decoded(event.messages)] == ["input_audio_buffer.cleared"]
    assert_error(send(protocol, "input_audio_buffer.commit"), "input_audio_buffer_commit_empty")


def test_output_clear_with_no_response():
    protocol, _ = make()
    event = send(protocol, "output_audio_buffer.clear")
    assert isinstance(event, ClearOutput)
    [cleared] = decoded(event.messages)
    assert cleared["type"] == "output_audio_buffer.cleared"
    assert cleared["response_id"] == ""  # a string, as the SDK's model requires: no response yet


@both_namings
def test_output_clear_cancels_a_turn_response(beta):
    protocol, progress = make(beta=beta)
    progress.frames_in = 4
    send(protocol, "response.create")
    protocol.audio_out(b"\0\0", 1)
    event = send(protocol, "output_audio_buffer.clear")
    assert isinstance(event, ClearOutput)
    types = [m["type"] for m in decoded(event.messages)]
    assert types == [names(beta)["done"], "response.done", "output_audio_buffer.cleared"]
    done = decoded(event.messages)[1]["response"]
    assert done["status"] == "cancelled"
    assert done["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert protocol.audio_out(b"\0\0", 1) == []


# -- responses, turn mode ---------------------------------------------------------------------------


@both_namings
def test_output_outside_a_response_is_dropped(beta):
    protocol, _ = make(beta=beta)
    protocol.start()
    assert protocol.audio_out(b"\1\2" * 10, 1) == []
    assert protocol.text_out("hello") == []


@both_namings
def test_a_response_carries_output_until_it_has_caught_up_with_the_input(beta):
    n = names(beta)
    protocol, progress = make(beta=beta)
    progress.frames_in, progress.frames_out = 5, 1
    created = send(protocol, "response.create", event_id="evt_r")
    assert isinstance(created, Reply)
    [event] = decoded(created.messages)
    assert event["type"] == "response.created"
    response = event["response"]
    assert response["object"] == "realtime.response"
    assert response["status"] == "in_progress"
    assert response["output"] == [] and response["usage"] is None
    response_id = response["id"]

    progress.frames_in = 7  # input after response.create belongs to no response
    [delta] = decoded(protocol.audio_out(b"\x01\x02\x03\x04", 2))
    assert delta == {"type": n["delta"], "event_id": delta["event_id"], "response_id": response_id,
                     "item_id": delta["item_id"], "output_index": 0, "content_index": 0,
                     "delta": b64(b"\x01\x02\x03\x04")}
    item_id = delta["item_id"]
    assert item_id.startswith("item_")
    progress.frames_out = 3
    [text] = decoded(protocol.text_out("hel"))
    assert text["type"] == n["text"] and text["delta"] == "hel"
    assert (text["response_id"], text["item_id"]) == (response_id, item_id)
    protocol.text_out("lo")

    last = decoded(protocol.audio_out(b"\x05\x06", 2))  # 3 + 2 >= 5: done
    assert [m["type"] for m in last] == [n["delta"], n["done"], n["text_done"], "response.done"]
    assert last[0]["delta"] == b64(b"\x05\x06")
    assert last[1] == {"type": n["done"], "event_id": last[1]["event_id"], "response_id": response_id,
                       "item_id": item_id, "output_index": 0, "content_index": 0}
    assert last[2]["transcript"] == "hello"
    done = last[3]["response"]
    assert done["id"] == response_id
    assert done["status"] == "completed"
    assert done["usage"] == usage(5, 4, 2)  # two pieces of text
    [item] = done["output"]
    assert item["id"] == item_id and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "audio" if beta else "output_audio", "transcript": "hello"}]

    progress.frames_out = 5
    assert protocol.audio_out(b"\x07\x08", 1) == []  # the response is over
    assert protocol.text_out("x") == []


@both_namings
def test_a_response_with_nothing_left_to_say_is_done_at_once(beta):
    protocol, progress = make(beta=beta)
    progress.frames_in = progress.frames_out = 3
    event = send(protocol, "response.create")
    assert isinstance(event, Reply)
    created, done = decoded(event.messages)
    assert (created["type"], done["type"]) == ("response.created", "response.done")
    assert done["response"]["id"] == created["response"]["id"]
    assert done["response"]["status"] == "completed"
    [item] = done["response"]["output"]  # the response's item, with nothing said in it
    assert item["content"] == [{"type": "audio" if beta else "output_audio", "transcript": ""}]
    assert done["response"]["usage"] == usage(3, 0)
    assert protocol.audio_out(b"\0\0", 1) == []


def test_a_response_with_no_progress_attached_is_done_at_once():
    protocol = RealtimeTranslator()  # no session attached: counters read as zero
    created, done = decoded(send(protocol, "response.create").messages)
    assert done["response"]["status"] == "completed"


def test_one_response_at_a_time():
    protocol, progress = make()
    progress.frames_in = 2
    send(protocol, "response.create")
    assert_error(send(protocol, "response.create", event_id="evt_2"),
                 "conversation_already_has_active_response", "evt_2")
    [delta] = decoded(protocol.audio_out(b"\0\0", 1))  # the first goes on
    assert delta["response_id"] == "resp_1"


@both_namings
def test_cancel_ends_the_response(beta):
    protocol, progress = make(beta=beta)
    progress.frames_in = 10
    [created] = decoded(send(protocol, "response.create").messages)
    protocol.audio_out(b"\0\0" * 4, 2)
    event = send(protocol, "response.cancel")
    assert isinstance(event, Reply)
    audio_done, done = decoded(event.messages)
    assert audio_done["type"] == names(beta)["done"]
    assert done["type"] == "response.done"
    assert done["response"]["id"] == created["response"]["id"]
    assert done["response"]["status"] == "cancelled"
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "client_cancelled"}
    assert done["response"]["usage"] == usage(10, 2)
    assert done["response"]["output"][0]["status"] == "incomplete"
    assert protocol.audio_out(b"\0\0", 1) == []
    assert_error(send(protocol, "response.cancel", event_id="evt_c"), "response_cancel_not_active", "evt_c")


def test_cancel_of_another_response_id_is_refused():
    protocol, progress = make()
    progress.frames_in = 1
    send(protocol, "response.create")
    assert_error(send(protocol, "response.cancel", response_id="resp_999"), "response_cancel_not_active",
                 contains="resp_999")
    assert len(protocol.audio_out(b"\0\0", 0)) == 1  # still active
    assert isinstance(send(protocol, "response.cancel", response_id="resp_1"), Reply)


def test_a_new_response_after_the_last_one_targets_the_new_input():
    protocol, progress = make()
    progress.frames_in = 2
    send(protocol, "response.create")
    protocol.audio_out(b"\0\0", 2)
    progress.frames_in, progress.frames_out = 6, 4  # 2 frames of output dropped between responses
    [created] = decoded(send(protocol, "response.create").messages)
    assert created["response"]["id"] == "resp_2"
    assert len(protocol.audio_out(b"\0\0", 1)) == 1
    progress.frames_out = 5
    last = decoded(protocol.audio_out(b"\0\0", 1))
    assert last[-1]["type"] == "response.done"
    assert last[-1]["response"]["usage"] == usage(6, 2)


def test_encoder_tails_are_forwarded_without_counting_frames():
    protocol, progress = make()
    progress.frames_in = 2
    send(protocol, "response.create")
    assert len(protocol.audio_out(b"\0\0", 0)) == 1
    assert len(protocol.audio_out(b"\0\0", 0)) == 1
    assert decoded(protocol.audio_out(b"\0\0", 2))[-1]["type"] == "response.done"


def test_every_server_event_id_is_unique():
    protocol, progress = make(duplex=True)
    messages = list(protocol.start())
    progress.frames_in = 3
    for i in range(5):
        messages += protocol.audio_out(b"\0\0", 1)
        messages += protocol.text_out(f"t{i}")
    messages += protocol.error(ProtocolError("x", "y"))
    messages += send(protocol, "response.cancel").messages
    messages += send(protocol, "response.create").messages
    messages += protocol.end(SessionEnd("stop", 3, 3, 0.24, 0.24))
    ids = [json.loads(m)["event_id"] for m in messages]
    assert len(ids) == len(set(ids)) == len(messages)
    assert all(i.startswith("event_") for i in ids)


def test_cancel_in_turn_mode_drops_the_rest_of_that_answer():
    """The model goes on producing a cancelled answer up to its target: that output is dropped,
    not held and replayed as the next response's start (it once was)."""
    protocol, progress = make()
    progress.frames_in = 5
    send(protocol, "response.create")
    assert protocol.next_boundary() == 5  # the turn ends after frame 5
    assert len(protocol.audio_out(b"\1\0", 1)) == 1
    progress.frames_out = 1
    assert isinstance(send(protocol, "response.cancel"), Reply)
    assert protocol.next_boundary() == 5  # the rest of the cancelled answer ends there too
    for k in range(2, 6):
        assert protocol.audio_out(bytes([k, 0]), 1) == []
        progress.frames_out = k
    assert protocol.next_boundary() is None
    assert protocol.audio_out(b"\6\0", 1) == []  # the next turn's answer: held
    progress.frames_out, progress.frames_in = 6, 6
    events = decoded(send(protocol, "response.create").messages)
    assert [base64.b64decode(e["delta"]) for e in events if e["type"] == names(False)["delta"]] == [b"\6\0"]
    assert events[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 1


def test_a_response_created_while_the_cancelled_answer_runs_gets_none_of_it():
    protocol, progress = make()
    progress.frames_in = 3
    send(protocol, "response.create")
    send(protocol, "response.cancel")
    progress.frames_in = 5
    [created] = decoded(send(protocol, "response.create").messages)
    for k in range(3):  # the cancelled answer, still coming out of the model
        assert protocol.text_out("old") == []
        assert protocol.audio_out(bytes([k, 0]), 1) == []
        progress.frames_out += 1
    [text] = decoded(protocol.text_out("new"))
    assert text["response_id"] == created["response"]["id"]
    assert len(protocol.audio_out(b"\3\0", 1)) == 1
    progress.frames_out += 1
    events = decoded(protocol.audio_out(b"\4\0", 1))
    done = events[-1]["response"]
    assert done["status"] == "completed"
    assert done["usage"]["output_token_details"]["audio_tokens"] == 2
    assert done["output"][0]["content"][0]["transcript"] == "new"


def test_output_clear_in_turn_mode_drops_the_rest_of_that_answer_too():
    protocol, progress = make()
    progress.frames_in = 4
    send(protocol, "response.create")
    protocol.audio_out(b"\1\0", 1)
    progress.frames_out = 1
    assert isinstance(send(protocol, "output_audio_buffer.clear"), ClearOutput)
    progress.frames_dropped = 1  # the session dropped one frame waiting in its outbox
    for k in (3, 4):  # frames 3 and 4 were still in the model
        assert protocol.audio_out(bytes([k, 0]), 1) == []
        progress.frames_out += 1
    assert protocol.audio_out(b"\5\0", 1) == []  # held: the next turn's
    progress.frames_out += 1
    progress.frames_in = 5
    events = decoded(send(protocol, "response.create").messages)
    assert [base64.b64decode(e["delta"]) for e in events if e["type"] == names(False)["delta"]] == [b"\5\0"]


def test_duplex_mode_has_no_boundaries():
    protocol, progress = make(duplex=True)
    protocol.start()
    progress.frames_in = 3
    assert protocol.next_boundary() is None
    send(protocol, "response.cancel")
    assert protocol.next_boundary() is None


def test_held_audio_is_recoded_in_order_and_stays_bounded_in_seconds():
    from duplexrt.protocols.realtime import MAX_HELD_SECONDS

    protocol, progress = make()
    chunk_frames = int(MAX_HELD_SECONDS / 0.08) // 3  # three chunks fill the bound
    for k in range(4):  # the fourth pushes the oldest out, whatever the bytes
        protocol.audio_out(bytes([k]) * 4, chunk_frames)
        progress.frames_out += chunk_frames
    seen = []

    def recode(payloads):
        seen.extend(p[:1] for p in payloads)
        return [p[:1] * (2 * len(p)) for p in payloads]  # twice the bytes: the bound is in seconds

    protocol.recode_held(recode)
    assert seen == [b"\1", b"\2", b"\3"]
    progress.frames_in = 4 * chunk_frames
    events = decoded(send(protocol, "response.create").messages)
    deltas = [base64.b64decode(e["delta"]) for e in events if e["type"] == names(False)["delta"]]
    assert deltas == [bytes([k]) * 8 for k in (1, 2, 3)]  # the oldest dropped to stay within the bound
    assert events[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 3 * chunk_frames


def test_errors_quote_client_values_short():
    """A client's values are quoted in errors, cut to about 100 characters: a megabyte-long value
    (or event id) does not make a megabyte-long reply."""
    protocol, _ = make()
    huge = "v" * 200_000
    events = [
        send(protocol, huge, event_id=huge),
        send(protocol, "response.cancel", event_id=huge, response_id=huge),
        send(protocol, "session.update", event_id=huge, session={"type": huge}),
        send(protocol, "session.update", event_id=huge, session={"output_audio_format": huge}),
        send(protocol, "session.update", event_id=huge, session={"audio": {"input": {"format": [huge] * 3}}}),
        send(protocol, "session.update", event_id=huge,
             session={"audio": {"input": {"format": {"type": "audio/pcm", "rate": huge}}}}),
        send(protocol, "session.update", event_id=huge,
             session={"audio": {"input": {"format": {"type": {"k": huge}}}}}),
    ]
    for event in events:
        assert isinstance(event, ProtocolError), event
        assert "vvvv" in event.message and ("…" in event.message or "..." in event.message)  # named, cut
        assert len(event.message) < 400, event.message[:500]
        assert event.event_id == "v" * 100 + "…"
        [message] = protocol.error(event)
        assert len(message) < 800


# -- responses, duplex mode -------------------------------------------------------------------------


@both_namings
def test_duplex_forwards_everything_until_cancelled(beta):
    n = names(beta)
    protocol, progress = make(beta=beta, duplex=True)
    _, created = decoded(protocol.start())
    response_id = created["response"]["id"]
    for k in range(4):  # no input target: output never completes the response
        [delta] = decoded(protocol.audio_out(bytes([k, k]), 1))
        assert delta["type"] == n["delta"] and delta["response_id"] == response_id
        progress.frames_out += 1
    [text] = decoded(protocol.text_out("hi"))
    assert text["type"] == n["text"]
    assert_error(send(protocol, "response.create", event_id="d1"), "conversation_already_has_active_response", "d1")

    # a clear drops the backlog but the implicit response goes on
    clear = send(protocol, "output_audio_buffer.clear")
    assert isinstance(clear, ClearOutput)
    assert [m["type"] for m in decoded(clear.messages)] == ["output_audio_buffer.cleared"]
    assert decoded(clear.messages)[0]["response_id"] == response_id
    assert len(protocol.audio_out(b"\0\0", 1)) == 1

    progress.frames_in = 9
    cancel = decoded(send(protocol, "response.cancel").messages)
    assert [m["type"] for m in cancel] == [n["done"], n["text_done"], "response.done"]
    assert cancel[-1]["response"]["status"] == "cancelled"
    assert cancel[-1]["response"]["usage"] == usage(9, 5, 1)
    assert protocol.audio_out(b"\0\0", 1) == []
    assert protocol.text_out("muted") == []

    [reopened] = decoded(send(protocol, "response.create").messages)
    assert reopened["type"] == "response.created"
    assert reopened["response"]["id"] != response_id
    progress.frames_out = 100  # far past the input: still open-ended
    [delta] = decoded(protocol.audio_out(b"\0\0", 1))
    assert delta["response_id"] == reopened["response"]["id"]


# -- error and end ----------------------------------------------------------------------------------


def test_error_event_shape():
    protocol, _ = make()
    [event] = decoded(protocol.error(ProtocolError("invalid_base64", "bad audio", event_id="evt_7")))
    assert event == {"type": "error", "event_id": event["event_id"], "error": {
        "type": "invalid_request_error", "code": "invalid_base64", "message": "bad audio",
        "param": None, "event_id": "evt_7"}}
    [event] = decoded(protocol.error(ProtocolError("invalid_json", "x")))
    assert event["error"]["event_id"] is None


def test_end_without_a_response_says_nothing_unless_the_server_failed():
    protocol, _ = make()
    protocol.start()
    assert protocol.end(SessionEnd("stop", 4, 4, 0.32, 0.32)) == []
    [error] = decoded(protocol.end(SessionEnd("error", 4, 4, 0.32, 0.32, error="boom")))
    assert error["type"] == "error" and error["error"]["type"] == "server_error"
    assert error["error"]["message"] == "boom"


def test_empty_audio_counts_its_frames_and_can_complete_a_turn():
    protocol, progress = make()
    progress.frames_in = 2
    send(protocol, "response.create")
    assert len(protocol.audio_out(b"\x01\x00", 1)) == 1
    progress.frames_out = 1
    events = decoded(protocol.audio_out(b"", 1))  # the encoder held this frame's bytes back
    assert [e["type"] for e in events][-1] == "response.done"
    assert events[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 2


@pytest.mark.parametrize(("reason", "status", "detail"), [
    ("stop", "completed", None),
    ("client_closed", "cancelled", "client_cancelled"),
    ("length", "incomplete", "max_output_tokens"),
    ("shutdown", "incomplete", None),
])
@both_namings
def test_end_closes_the_active_response(beta, reason, status, detail):
    protocol, progress = make(beta=beta, duplex=True)
    protocol.start()
    protocol.audio_out(b"\0\0", 1)
    messages = decoded(protocol.end(SessionEnd(reason, 12, 11, 0.96, 0.88)))
    assert [m["type"] for m in messages] == [names(beta)["done"], "response.done"]
    response = messages[-1]["response"]
    assert response["status"] == status
    assert response["status_details"]["type"] == status
    assert response["status_details"]["reason"] == detail  # one of the SDK's reasons, or None
    if reason == "shutdown":  # not one of the protocol's reasons: named as an error code
        assert response["status_details"]["error"]["code"] == "server_shutdown"
    else:
        assert "error" not in response["status_details"]
    assert response["usage"] == usage(12, 11)


def test_end_usage_counts_the_text_the_session_sent():
    protocol, _ = make(duplex=True)
    protocol.start()
    messages = decoded(protocol.end(SessionEnd("stop", 12, 11, 0.96, 0.88, text_tokens_out=4)))
    assert messages[-1]["response"]["usage"] == usage(12, 11, 4)


def test_end_on_error_sends_a_server_error_first():
    protocol, progress = make()
    progress.frames_in = 5
    send(protocol, "response.create")
    messages = decoded(protocol.end(SessionEnd("error", 5, 2, 0.4, 0.16, error="model exploded")))
    assert [m["type"] for m in messages] == ["error", "response.done"]
    assert messages[0]["error"]["type"] == "server_error"
    assert messages[0]["error"]["message"] == "model exploded"
    response = messages[1]["response"]
    assert response["status"] == "failed"
    assert response["status_details"]["type"] == "failed"
    assert response["status_details"]["error"]["message"] == "model exploded"
    assert response["usage"] == usage(5, 2)


def test_end_after_a_fatal_client_error_does_not_blame_the_server():
    protocol, _ = make(duplex=True)
    protocol.start()
    fatal = protocol.parse(b"\0")
    protocol.error(fatal)
    messages = decoded(protocol.end(SessionEnd("error", 0, 0, 0.0, 0.0, error=fatal.message)))
    assert [m["type"] for m in messages] == ["response.done"]
    assert messages[0]["response"]["status"] == "failed"
    assert messages[0]["response"]["status_details"]["error"]["type"] == "invalid_request_error"


# -- held audio ---------------------------------------------------------------------------------------


def test_turn_mode_holds_audio_that_comes_before_response_create():
    """A fast model answers a turn before the client's response.create arrives: that audio is
    the response's first deltas, not lost."""
    protocol, progress = make()
    progress.frames_in = 3
    assert protocol.audio_out(b"\x01\x00" * 4, 2) == []  # no response yet: held
    progress.frames_out = 2
    assert protocol.audio_out(b"\x02\x00" * 4, 1) == []
    progress.frames_out = 3
    events = decoded(send(protocol, "response.create").messages)
    types = [e["type"] for e in events]
    assert types == ["response.created", "response.output_audio.delta", "response.output_audio.delta",
                     "response.output_audio.done", "response.done"]
    assert base64.b64decode(events[1]["delta"]) == b"\x01\x00" * 4
    assert base64.b64decode(events[2]["delta"]) == b"\x02\x00" * 4
    assert events[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 3


def test_output_audio_buffer_clear_drops_held_audio():
    protocol, progress = make()
    progress.frames_in = 1
    protocol.audio_out(b"\x01\x00" * 4, 1)
    progress.frames_out = 1
    send(protocol, "output_audio_buffer.clear")
    types = [e["type"] for e in decoded(send(protocol, "response.create").messages)]
    assert "response.output_audio.delta" not in types


# -- the response lifecycle -------------------------------------------------------------------------

def lifecycle(beta: bool) -> tuple[list[str], list[str]]:
    """The events that open a response's item before its deltas, and close it after them."""
    n = names(beta)
    opening = ["response.created", "response.output_item.added",
               "conversation.item.created" if beta else "conversation.item.added",
               "response.content_part.added"]
    closing = [n["done"], n["text_done"], "response.content_part.done", "response.output_item.done",
               *([] if beta else ["conversation.item.done"]), "response.done"]
    return opening, closing


@both_namings
def test_turn_response_lifecycle_in_order_with_metadata_echoed(beta):
    """LiveKit makes the stream it plays from on response.output_item.added (it had none: every
    delta failed with KeyError), and matches its generate_reply by the metadata echoed in
    response.created (it was dropped: the reply timed out)."""
    opening, closing = lifecycle(beta)
    protocol, progress = make(beta=beta)
    progress.frames_in = 2
    metadata = {"client_event_id": "evt_lk_1"}
    start = decoded(send(protocol, "response.create", response={"metadata": metadata}).messages,
                    everything=True)
    assert [e["type"] for e in start] == opening
    created, added, conv_added, part = start
    assert created["response"]["metadata"] == metadata
    item_id = added["item"]["id"]
    assert added["response_id"] == created["response"]["id"] and added["output_index"] == 0
    assert added["item"]["status"] == "in_progress" and added["item"]["role"] == "assistant"
    assert conv_added["item"]["id"] == item_id
    assert (part["item_id"], part["part"]["type"]) == (item_id, "audio")
    [delta] = decoded(protocol.audio_out(b"\1\0", 1), everything=True)
    assert delta["item_id"] == item_id
    protocol.text_out("hi")
    progress.frames_out = 1
    end = decoded(protocol.audio_out(b"\2\0", 1), everything=True)
    assert [e["type"] for e in end] == [names(beta)["delta"], *closing]
    assert all(e["item_id"] == item_id for e in end[1:4])
    item_done = end[4]["item"]
    assert item_done["id"] == item_id and item_done["status"] == "completed"
    assert item_done["content"][0]["transcript"] == "hi"
    assert end[-1]["response"]["metadata"] == metadata
    assert end[-1]["response"]["output"] == [item_done]


def test_response_metadata_must_be_string_values():
    protocol, progress = make()
    assert_error(send(protocol, "response.create", event_id="e", response={"metadata": {"a": 1}}),
                 "invalid_value", "e", contains="metadata")
    assert_error(send(protocol, "response.create", event_id="e", response=[]), "invalid_type", "e")
    assert isinstance(send(protocol, "response.create", response={"instructions": "hi"}), Reply)


def gated(**kwargs):
    """Duplex mode cut at pauses: -40 dBFS gate, two frames (160 ms) of hang-over."""
    return make(duplex=True, duplex_gate_dbfs=-40.0, duplex_hangover_ms=160.0, frame_seconds=0.08, **kwargs)


LOUD = (np.full(480, 8000, dtype="<i2")).tobytes()
QUIET = (np.full(480, 30, dtype="<i2")).tobytes()  # about -61 dBFS


@both_namings
def test_duplex_output_is_cut_into_one_response_per_burst(beta):
    opening, closing = lifecycle(beta)
    protocol, _ = gated(beta=beta)
    assert [e["type"] for e in decoded(protocol.start(), everything=True)] == ["session.created"]
    assert protocol.audio_out(QUIET, 1) == []  # silence before any speech is not sent
    first = decoded(protocol.audio_out(LOUD, 1), everything=True)
    assert [e["type"] for e in first] == [*opening, names(beta)["delta"]]
    assert len(decoded(protocol.audio_out(QUIET, 1))) == 1  # a short pause stays inside
    assert len(decoded(protocol.audio_out(LOUD, 1))) == 1
    assert len(decoded(protocol.audio_out(QUIET, 1))) == 1
    end = decoded(protocol.audio_out(QUIET, 1), everything=True)  # the hang-over is reached
    assert [e["type"] for e in end] == [names(beta)["delta"], names(beta)["done"], *closing[2:]]
    assert end[-1]["response"]["status"] == "completed"
    assert end[-1]["response"]["usage"]["output_token_details"]["audio_tokens"] == 5
    assert protocol.audio_out(QUIET, 3) == []
    second = decoded(protocol.audio_out(LOUD, 1))
    assert second[0]["type"] == "response.created" and second[0]["response"]["id"] == "resp_2"


def test_duplex_cancel_drops_the_rest_of_the_burst_only():
    protocol, _ = gated()
    protocol.start()
    protocol.audio_out(LOUD, 1)
    [done] = decoded(send(protocol, "response.cancel").messages)[-1:]
    assert done["response"]["status"] == "cancelled"
    assert protocol.audio_out(LOUD, 1) == []  # the same burst goes on: dropped
    assert protocol.audio_out(QUIET, 1) == []
    assert protocol.audio_out(QUIET, 1) == []  # a pause: the burst is over
    assert decoded(protocol.audio_out(LOUD, 1))[0]["type"] == "response.created"


def test_duplex_response_create_opens_a_response_now_with_its_metadata():
    protocol, _ = gated()
    protocol.start()
    [created] = decoded(send(protocol, "response.create", response={"metadata": {"k": "v"}}).messages)
    assert created["response"]["metadata"] == {"k": "v"}
    assert len(decoded(protocol.audio_out(QUIET, 1))) == 1  # inside its hang-over
    end = decoded(protocol.audio_out(QUIET, 1))
    assert end[-1]["type"] == "response.done" and end[-1]["response"]["metadata"] == {"k": "v"}


def test_the_gate_reads_g711_output_too():
    protocol, _ = gated()
    protocol.start()
    send(protocol, "session.update", session={"audio": {"output": {"format": {"type": "audio/pcmu"}}}})
    assert protocol.audio_out(b"\xff" * 160, 1) == []  # mu-law silence
    assert decoded(protocol.audio_out(b"\x10" * 160, 1))[0]["type"] == "response.created"


# -- conversation items -----------------------------------------------------------------------------

@both_namings
def test_a_text_item_is_acknowledged_and_can_be_retrieved_and_deleted(beta):
    protocol, _ = make(beta=beta)
    event = send(protocol, "conversation.item.create", event_id="c1", item={
        "id": "msg_1", "type": "message", "role": "system",
        "content": [{"type": "input_text", "text": "be brief" * 500}]})
    assert isinstance(event, Reply)
    acks = decoded(event.messages, everything=True)
    assert [a["type"] for a in acks] == (["conversation.item.created"] if beta
                                         else ["conversation.item.added", "conversation.item.done"])
    assert acks[0]["item"]["id"] == "msg_1" and acks[0]["previous_item_id"] is None
    assert len(acks[0]["item"]["content"][0]["text"]) <= 1001  # echoed cut short
    [got] = decoded(send(protocol, "conversation.item.retrieve", item_id="msg_1").messages)
    assert got["type"] == "conversation.item.retrieved" and got["item"]["id"] == "msg_1"
    [deleted] = decoded(send(protocol, "conversation.item.delete", item_id="msg_1").messages)
    assert deleted == {"type": "conversation.item.deleted", "event_id": deleted["event_id"], "item_id": "msg_1"}
    assert_error(send(protocol, "conversation.item.delete", event_id="d", item_id="msg_1"), "item_not_found", "d")
    assert_error(send(protocol, "conversation.item.retrieve", event_id="r", item_id="nope"), "item_not_found", "r")
    assert_error(send(protocol, "conversation.item.create", event_id="x", item="no"), "invalid_type", "x")


def test_an_audio_item_feeds_its_audio_to_the_model():
    protocol, _ = make()
    audio = b"\1\0\2\0\3\0\4\0"
    event = send(protocol, "conversation.item.create", item={
        "type": "message", "role": "user",
        "content": [{"type": "input_audio", "audio": b64(audio[:4])}, {"type": "input_audio", "audio": b64(audio[4:])}]})
    assert isinstance(event, AudioIn)
    assert bytes(event.payload) == audio
    assert [e["type"] for e in decoded(event.messages, everything=True)] == [
        "conversation.item.added", "conversation.item.done"]
    assert_error(send(protocol, "conversation.item.create", item={
        "type": "message", "role": "user", "content": [{"type": "input_audio", "audio": "%%"}]}), "invalid_base64")
    assert_error(send(protocol, "input_audio_buffer.commit"), "input_audio_buffer_commit_empty")


def test_truncating_the_speaking_item_cancels_it_and_drops_the_rest():
    """pipecat and LiveKit truncate the assistant item on barge-in: it was an unsupported_event
    error (fatal to pipecat); now the response stops at once and its rest is never sent."""
    protocol, progress = make()
    progress.frames_in = 6
    item_id = decoded(send(protocol, "response.create").messages, everything=True)[1]["item"]["id"]
    protocol.audio_out(b"\0\0", 2)
    progress.frames_out = 2
    event = send(protocol, "conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=100)
    assert isinstance(event, ClearOutput)  # unsent audio is dropped too
    messages = decoded(event.messages, everything=True)
    assert messages[0] == {"type": "conversation.item.truncated", "event_id": messages[0]["event_id"],
                           "item_id": item_id, "content_index": 0, "audio_end_ms": 100}
    assert messages[-1]["type"] == "response.done" and messages[-1]["response"]["status"] == "cancelled"
    assert protocol.audio_out(b"\0\0", 2) == []  # the rest of the answer (frames 2..6)
    # Truncating an item that is done is acknowledged and changes nothing else.
    again = send(protocol, "conversation.item.truncate", item_id=item_id, content_index=0, audio_end_ms=50)
    assert isinstance(again, Reply)
    assert_error(send(protocol, "conversation.item.truncate", item_id=item_id, audio_end_ms=-1), "invalid_value")
    assert_error(send(protocol, "conversation.item.truncate", item_id="x", audio_end_ms=0), "item_not_found")


def test_items_are_bounded():
    from duplexrt.protocols.realtime_items import MAX_ITEMS

    protocol, _ = make()
    for k in range(MAX_ITEMS + 10):
        send(protocol, "conversation.item.create", item={"type": "message", "role": "user", "content": []})
    assert_error(send(protocol, "conversation.item.retrieve", item_id="item_1"), "item_not_found")
    assert isinstance(send(protocol, "conversation.item.retrieve", item_id=f"item_{MAX_ITEMS + 10}"), Reply)


# -- what is in force -------------------------------------------------------------------------------

@both_namings
def test_settings_that_cannot_be_honoured_are_named_in_non_fatal_errors(beta):
    protocol, _ = make(beta=beta)
    session = {"tools": [{"type": "function", "name": "f"}], "voice": "alloy"}
    if beta:
        session["input_audio_transcription"] = {"model": "whisper-1"}
    else:
        session["audio"] = {"input": {"transcription": {"model": "whisper-1"}}}
    event = send(protocol, "session.update", event_id="u1", session=session)
    updated, *errors = decoded(event.messages)
    assert updated["type"] == "session.updated"
    assert "tools" not in updated["session"] and "voice" not in updated["session"]
    fields = [e["error"]["message"].split(":")[0] for e in errors]
    assert fields == ["session.tools", "session.input_audio_transcription" if beta
                      else "session.audio.input.transcription"]
    assert all(e["error"]["event_id"] == "u1" and e["error"]["code"] == "unsupported_setting" for e in errors)


@both_namings
def test_server_vad_settings_are_applied_and_shown(beta):
    protocol, _ = make(beta=beta)
    detection = {"type": "semantic_vad" if beta else "server_vad", "threshold": 0.7,
                 "silence_duration_ms": 300, "create_response": True}
    session = {"turn_detection": detection} if beta else {"audio": {"input": {"turn_detection": detection}}}
    [updated] = decoded(send(protocol, "session.update", session=session).messages)
    shown = updated["session"]["turn_detection"] if beta else updated["session"]["audio"]["input"]["turn_detection"]
    assert shown == {"type": "server_vad", "threshold": 0.7, "prefix_padding_ms": 300,
                     "silence_duration_ms": 300, "create_response": True, "interrupt_response": True,
                     "idle_timeout_ms": None}
    off = {"turn_detection": None} if beta else {"audio": {"input": {"turn_detection": None}}}
    [updated] = decoded(send(protocol, "session.update", session=off).messages)
    assert (updated["session"]["turn_detection"] if beta else updated["session"]["audio"]["input"]["turn_detection"]) is None


def test_in_duplex_mode_the_vad_only_reports_speech():
    protocol, _ = make(duplex=True)
    [updated] = decoded(send(protocol, "session.update", session={"turn_detection": {"type": "server_vad"}}).messages)
    shown = updated["session"]["audio"]["input"]["turn_detection"]
    assert shown["create_response"] is False and shown["interrupt_response"] is False


@pytest.mark.parametrize(("detection", "contains"), [
    ({"type": "magic_vad"}, "type"),
    ({"type": "server_vad", "threshold": 2}, "threshold"),
    ({"type": "server_vad", "silence_duration_ms": -1}, "silence_duration_ms"),
    ({"type": "server_vad", "create_response": "yes"}, "create_response"),
    ("server_vad", "turn_detection"),
])
def test_bad_turn_detection_is_refused_and_changes_nothing(detection, contains):
    protocol, _ = make()
    assert_error(send(protocol, "session.update", session={"turn_detection": detection}), "invalid_value",
                 contains=contains)
    [updated] = decoded(send(protocol, "session.update", session={}).messages)
    assert updated["session"]["audio"]["input"]["turn_detection"] is None


# -- server VAD -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def speech_24k() -> np.ndarray:
    import speech

    return speech.speech_24k()


def vad_session(*, duplex: bool = False, beta: bool = False, **detection):
    protocol, progress = make(duplex=duplex, beta=beta)
    settings = {"type": "server_vad", **detection}
    session = {"turn_detection": settings} if beta else {"audio": {"input": {"turn_detection": settings}}}
    send(protocol, "session.update", session=session)
    return protocol, progress


def append_all(protocol, progress, pcm: bytes, chunk: int = 3840) -> list[dict]:
    """Append ``pcm`` in 80 ms pieces, counting frames as the session would; all that is said."""
    said = []
    for start in range(0, len(pcm), chunk):
        event = send(protocol, "input_audio_buffer.append", audio=b64(pcm[start:start + chunk]))
        assert isinstance(event, AudioIn)
        said += decoded(event.messages, everything=True)
        progress.frames_in += 1
    return said


@both_namings
def test_server_vad_finds_real_speech_and_answers_it(speech_24k, beta):
    protocol, progress = vad_session(beta=beta, silence_duration_ms=500, prefix_padding_ms=300)
    second = np.zeros(24000, dtype="<i2")
    said = append_all(protocol, progress, np.concatenate([second, speech_24k, second]).tobytes())
    kinds = [e["type"] for e in said]
    assert kinds[:4] == ["input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped",
                         "input_audio_buffer.committed",
                         "conversation.item.created" if beta else "conversation.item.added"]
    assert "response.created" in kinds  # turn mode, create_response: the answer starts by itself
    started, stopped = said[0], said[1]
    speech_ms = len(speech_24k) / 24
    assert 1000 - 300 - 100 <= started["audio_start_ms"] <= 1000 - 300 + 100  # with the prefix padding
    # espeak-ng ends its file with a little silence: speech stops before the file does.
    assert 1000 + speech_ms - 500 <= stopped["audio_end_ms"] <= 1000 + speech_ms + 800
    assert started["item_id"] == stopped["item_id"] == said[2]["item_id"]
    assert kinds.count("input_audio_buffer.speech_started") == 1  # the speech's own pauses are inside


@pytest.mark.parametrize("what", ["silence", "noise", "quiet noise"])
def test_server_vad_ignores_silence_and_noise(what):
    protocol, progress = vad_session()
    rng = np.random.default_rng(7)
    samples = 24000 * 4
    if what == "silence":
        signal = np.zeros(samples)
    elif what == "noise":  # loud, steady hiss: WebRTC's VAD alone calls this speech
        signal = rng.standard_normal(samples) * 3000
    else:
        signal = rng.standard_normal(samples) * 100
    assert append_all(protocol, progress, signal.astype("<i2").tobytes()) == []


def test_speech_interrupts_the_response_and_drops_the_rest_of_it(speech_24k):
    """Barge-in: the user speaks while the model answers: the response is cancelled
    (turn_detected) and none of its remaining audio is sent."""
    protocol, progress = vad_session(create_response=False, interrupt_response=True)
    append_all(protocol, progress, np.zeros(24000, dtype="<i2").tobytes())
    send(protocol, "input_audio_buffer.commit")
    send(protocol, "response.create")  # answers the 12 frames so far
    assert len(protocol.audio_out(b"\0\0", 2)) == 1
    progress.frames_out = 2
    said = append_all(protocol, progress, speech_24k[:24000].tobytes())
    kinds = [e["type"] for e in said]
    assert kinds[0] == "input_audio_buffer.speech_started"
    [done] = [e for e in said if e["type"] == "response.done"]
    assert done["response"]["status_details"] == {"type": "cancelled", "reason": "turn_detected"}
    assert protocol.audio_out(b"\0\0", 10) == []  # frames 2..12: the rest of that answer


def test_vad_cost_per_frame_stays_below_the_session_s_own(speech_24k):
    """Measured, not assumed: the VAD runs inline on the reader only because one 80 ms frame of
    it costs well under the ~70 µs of host work a session spends per frame (docs/benchmarks)."""
    import time

    from duplexrt.audio import AudioFormat as Format
    from duplexrt.protocols.vad import InputVad, VadSettings

    vad = InputVad(VadSettings(), AudioSpec.create(Format.PCM_S16LE, 24000, model_rate=24000))
    frame = speech_24k[:1920].tobytes()
    best = min(_timed(vad, frame, time.perf_counter) for _ in range(5))
    assert best < 400e-6, f"{best * 1e6:.0f} µs per frame"  # generous: CI machines are shared


def _timed(vad, frame: bytes, clock) -> float:
    start = clock()
    for _ in range(200):
        vad.feed(frame)
    return (clock() - start) / 200


def test_a_pause_is_measured_from_where_the_sound_ended_inside_a_batch():
    """A client sending faster than real time gets many frames per batch: the pause after the
    sound is counted frame by frame, not from the batch (responses ran ~8 frames long)."""
    protocol, _ = gated()
    protocol.start()
    events = decoded(protocol.audio_out(LOUD + QUIET * 3, 4))
    assert [e["type"] for e in events] == ["response.created", names(False)["delta"],
                                           names(False)["done"], "response.done"]
    protocol2, _ = gated()
    protocol2.start()
    events = decoded(protocol2.audio_out(QUIET + LOUD, 2))
    assert events[-1]["type"] != "response.done"
    assert [e["type"] for e in decoded(protocol2.audio_out(QUIET * 2, 2))][-1] == "response.done"


@pytest.mark.parametrize(("fmt", "rate"), [
    ("pcm_s16le", 8000), ("g711_ulaw", 8000), ("pcm_s16le", 16000), ("pcm_s16le", 44100), ("pcm_s16le", 48000),
])
def test_the_vad_hears_the_same_speech_at_every_input_format(speech_24k, fmt, rate):
    """Each rate takes its own road to a rate WebRTC's VAD takes (as is, averaged, interpolated)."""
    import soxr

    from duplexrt.audio.g711 import ulaw_encode
    from duplexrt.protocols.vad import InputVad, VadSettings

    resampled = soxr.resample(speech_24k.astype(np.float32) / 32768, 24000, rate)
    signal = np.concatenate([np.zeros(rate, np.float32), resampled, np.zeros(rate, np.float32)])
    wire = AudioSpec.create(AudioFormat(fmt), rate, model_rate=24000)
    raw = ulaw_encode(signal) if fmt == "g711_ulaw" else (signal * 32767).astype("<i2")
    vad = InputVad(VadSettings(), wire)
    events = [event for start in range(0, raw.size, 997) for event in vad.feed(raw[start:start + 997].tobytes())]
    assert [kind for kind, _ in events] == ["started", "stopped"]
    assert 600 <= events[0][1] <= 800  # 1 s of silence, less the 300 ms prefix padding


def test_the_vad_decides_the_same_whatever_the_appends_sizes(speech_24k):
    """Whole-window appends (80 ms, the usual case) carry nothing over; odd sizes carry a part
    window: the decisions and their times are the same either way, and so is a stream whose
    speech WebRTC's VAD and the noise check both judge window by window."""
    from duplexrt.protocols.vad import InputVad, VadSettings

    rate = 24000
    silence = np.zeros(rate, np.int16)
    rng = np.random.default_rng(7)
    noise = (rng.standard_normal(rate) * 6000).astype(np.int16)  # steady broadband: not a turn
    raw = np.concatenate([silence, speech_24k, silence, noise, silence, speech_24k, silence]).astype("<i2")
    spec = AudioSpec.create(AudioFormat.PCM_S16LE, rate, model_rate=24000)

    def events(size: int) -> list[tuple[str, int]]:
        vad = InputVad(VadSettings(), spec)
        return [event for start in range(0, raw.size, size) for event in vad.feed(raw[start:start + size].tobytes())]

    whole = events(1920)
    assert [kind for kind, _ in whole] == ["started", "stopped", "started", "stopped"]
    assert events(997) == events(4801) == whole


@pytest.mark.parametrize("size", [160, 320, 640, 960])  # 20 ms at each rate WebRTC's VAD takes
def test_the_noise_check_s_spectrum_is_the_fft_s(size):
    """The in-place float32 flatness gives the textbook float64 figures (to rounding) for noise,
    a tone and silence, at every window size."""
    from duplexrt.protocols.vad import _flatness

    rng = np.random.default_rng(size)
    tone = np.sin(np.arange(size) * 0.3) * 3000
    windows = np.stack([rng.standard_normal(size) * 3000, tone, np.zeros(size), tone + rng.standard_normal(size) * 300])
    windows = windows.astype(np.int16)
    power = np.abs(np.fft.rfft(windows.astype(np.float64), axis=1)) ** 2 + 1e-3
    expected = np.exp(np.log(power).mean(axis=1)) / power.mean(axis=1)
    np.testing.assert_allclose(_flatness(windows), expected, rtol=1e-3, atol=1e-4)
    assert _flatness(windows)[0] > 0.4 > _flatness(windows)[1]  # noise on one side, a tone on the other


# -- the reader and the writer on their own ------------------------------------------------------------


def test_a_session_update_is_read_whole_without_a_session():
    """Reading a client event needs no translator: both shapes of session.update give the same
    formats, and a bad field is refused before anything would be applied."""
    from duplexrt.protocols.realtime_client_events import UNSET, SessionUpdate, read_session_update

    name = str
    ga = read_session_update({"type": "session.update", "session": {
        "audio": {"input": {"format": {"type": "audio/pcmu"}}}, "tools": [{"type": "function"}]}}, MODEL_RATE, name)
    beta = read_session_update({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}},
                               MODEL_RATE, name)
    assert isinstance(ga, SessionUpdate) and isinstance(beta, SessionUpdate)
    assert ga.specs == beta.specs == {"input": AudioSpec.create("g711_ulaw", 8000, model_rate=MODEL_RATE)}
    assert ga.turn_detection is UNSET and [field for field, _ in ga.unsupported] == ["session.tools"]
    bad = read_session_update({"type": "session.update", "event_id": "e1",
                               "session": {"output_audio_format": "mp3"}}, MODEL_RATE, name)
    assert_error(bad, "unsupported_audio_format", "e1", contains="session.output_audio_format")


@both_namings
def test_the_writer_names_formats_and_events_in_the_client_s_naming(beta):
    from duplexrt.protocols.realtime_server_events import ServerEvents

    out = ServerEvents(beta=beta)
    pcm = AudioSpec.create("pcm_s16le", 24000, model_rate=MODEL_RATE)
    assert out.format_name(pcm) == ("pcm16 at 24000 Hz" if beta else "audio/pcm at 24000 Hz")
    assert out.audio_delta == names(beta)["delta"]
    ids = [json.loads(out.event("x"))["event_id"] for _ in range(2)]
    assert ids == ["event_1", "event_2"]
