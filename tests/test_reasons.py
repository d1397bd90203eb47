"""Finish reasons and close codes are enums whose members are their wire values: what a client
reads (JSON, the Moshi metadata message, a close code) and what the log says must be the plain
string or number, exactly as before they were enums."""

from __future__ import annotations

import json
import logging

import pytest

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.protocols.events import SessionEnd
from duplexrt.protocols.moshi import MoshiTranslator
from duplexrt.protocols.raw import RawTranslator
from duplexrt.reasons import CloseCode, FinishReason

F32 = AudioSpec.create(AudioFormat.PCM_F32LE, None, model_rate=24000)


def ended(reason: FinishReason) -> SessionEnd:
    return SessionEnd(reason, 3, 3, 0.24, 0.24)


@pytest.mark.parametrize("reason", list(FinishReason))
def test_a_session_end_on_the_wire_carries_the_reason_as_a_plain_string(reason: FinishReason) -> None:
    [raw] = RawTranslator(F32).end(ended(reason))
    [moshi] = MoshiTranslator().end(ended(reason))
    assert isinstance(raw, str) and f'"reason": "{reason.value}"' in raw
    assert isinstance(moshi, bytes) and f'"reason":"{reason.value}"'.encode() in moshi
    assert json.loads(raw)["reason"] == reason.value


def test_log_lines_and_text_show_the_value_not_the_member_name(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="duplexrt.test_reasons")
    logging.getLogger("duplexrt.test_reasons").info("ended: %s, closed with %s", FinishReason.IDLE_TIMEOUT,
                                                    CloseCode.POLICY_VIOLATION)
    assert caplog.records[-1].getMessage() == "ended: idle_timeout, closed with 1008"
    assert f"{FinishReason.STOP}/{CloseCode.GOING_AWAY}" == "stop/1001"
    assert json.dumps({"code": CloseCode.MESSAGE_TOO_BIG}) == '{"code": 1009}'


def test_the_values_are_the_ones_peers_already_know() -> None:
    assert [reason.value for reason in FinishReason] == [
        "stop", "client_closed", "error", "shutdown", "length", "first_message_timeout", "idle_timeout",
        "ping_timeout", "message_too_big", "protocol_error", "resume_expired"]
    assert {code.name: code.value for code in CloseCode} == {
        "NORMAL_CLOSURE": 1000, "GOING_AWAY": 1001, "PROTOCOL_ERROR": 1002, "UNSUPPORTED_DATA": 1003,
        "ABNORMAL_CLOSURE": 1006, "INVALID_PAYLOAD": 1007, "POLICY_VIOLATION": 1008, "MESSAGE_TOO_BIG": 1009,
        "INTERNAL_ERROR": 1011, "TRY_AGAIN_LATER": 1013}
