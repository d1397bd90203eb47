"""Reading the OpenAI Realtime protocol's client events: what a well-formed event looks like,
and what each field means, with no state of the session's.

Every function here is pure: it turns a decoded client event (or one of its fields) into the
values the translator acts on, or into the ``ProtocolError`` the client is told, quoting the
field.  What the translator then does with them (turns, responses, held audio) is in
``realtime.py``; how the server's events are written is in ``realtime_server_events.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
from duplexrt.protocols.events import ProtocolError, clip, quote
from duplexrt.protocols.realtime_session import parse_turn_detection, unsupported_settings
from duplexrt.protocols.vad import VadSettings
from duplexrt.reasons import CloseCode

#: The rates the protocol means when a format names none.
PCM_RATE = 24000
G711_RATE = 8000

#: Wire format names, GA and beta alike, as the AudioFormat they mean.
FORMATS: dict[str, AudioFormat] = {
    "audio/pcm": AudioFormat.PCM_S16LE,
    "audio/pcmu": AudioFormat.G711_ULAW,
    "audio/pcma": AudioFormat.G711_ALAW,
    "pcm16": AudioFormat.PCM_S16LE,
    "g711_ulaw": AudioFormat.G711_ULAW,
    "g711_alaw": AudioFormat.G711_ALAW,
}
FORMAT_NAMES = "audio/pcm, audio/pcmu, audio/pcma (beta: pcm16, g711_ulaw, g711_alaw)"

#: Client events of the protocol that this server does not implement.
UNSUPPORTED = (
    "transcription_session.update",
    "input_audio_buffer.dtmf",
)

#: A binary message: the protocol has none, so the session ends.
BINARY = ProtocolError(
    "binary_not_supported",
    "binary messages are not part of the Realtime protocol; send audio as base64 in "
    "input_audio_buffer.append events",
    close_code=CloseCode.UNSUPPORTED_DATA,
    fatal=True,
)

#: ``SessionUpdate.turn_detection`` when the update did not mention turn detection at all.
UNSET: Any = object()


def client_event_id(data: dict[str, Any]) -> str | None:
    """The client's ``event_id``, cut short, for the error that answers its event."""
    event_id = data.get("event_id")
    return clip(event_id) if isinstance(event_id, str) else None


def bad_type(data: dict[str, Any], kind: object) -> ProtocolError:
    """An event whose ``type`` is missing, not a string, or not one of the protocol's."""
    if not isinstance(kind, str):
        return ProtocolError("invalid_event", 'client events must be JSON objects with a string "type"',
                             event_id=client_event_id(data))
    return ProtocolError("unknown_event", f"unknown event type {quote(kind)}", event_id=client_event_id(data))


def parse_format(value: object, field: str, event_id: str | None, model_rate: int) -> AudioSpec | ProtocolError:
    """A GA format object ({"type": "audio/pcm", "rate": 24000}) or a format name (GA or beta)."""
    name: object
    rate: object
    if isinstance(value, str):
        name, rate = value, None
    elif type(value) is dict:
        name, rate = value.get("type"), value.get("rate")
        field += ".type"
        if not isinstance(name, str):
            return ProtocolError("invalid_value", f"{field} must be one of {FORMAT_NAMES}; got {quote(name)}",
                                 event_id=event_id)
    else:
        return ProtocolError("invalid_type", f"{field} must be a format object or name, got {quote(value)}",
                             event_id=event_id)
    fmt = FORMATS.get(name.strip().lower())
    if fmt is None:
        return ProtocolError("unsupported_audio_format",
                             f"{field}: unsupported audio format {quote(name)}; allowed: {FORMAT_NAMES}",
                             event_id=event_id)
    rate_field = field.removesuffix(".type") + ".rate"
    if rate is None:
        rate = PCM_RATE if fmt is AudioFormat.PCM_S16LE else G711_RATE
    elif isinstance(rate, float) and rate.is_integer():
        rate = int(rate)
    elif not isinstance(rate, int):  # named here, quoted short: not by AudioSpec, whole
        return ProtocolError("invalid_value", f"{rate_field}: sample rate must be a positive integer "
                             f"number of Hz, got {quote(rate)}", event_id=event_id)
    try:
        return AudioSpec.create(fmt, rate, model_rate=model_rate)
    except AudioFormatError as exc:
        return ProtocolError("invalid_value", f"{rate_field}: {clip(str(exc), 200)}", event_id=event_id)


def response_fields(data: dict[str, Any]) -> dict[str, Any] | ProtocolError:
    """The ``response`` a client set that the server echoes: ``metadata`` (clients match a
    reply to their request by it).  Instructions, voice and the like change nothing in a
    speech-to-speech model, so they are not echoed as if in force."""
    body = data.get("response")
    if body is None:
        return {}
    if type(body) is not dict:
        return ProtocolError("invalid_type", "'response' must be an object", event_id=client_event_id(data))
    metadata = body.get("metadata")
    if metadata is None:
        return {}
    if type(metadata) is not dict or len(metadata) > 16 or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        return ProtocolError("invalid_value", "response.metadata must be an object of at most 16 "
                             f"string values, got {quote(metadata)}", event_id=client_event_id(data))
    return {"metadata": {clip(k, 64): clip(v, 512) for k, v in metadata.items()}}


@attrs.frozen
class SessionUpdate:
    """What a well-formed ``session.update`` asks for, checked whole before anything is applied."""

    #: New wire formats, by direction (``input``, ``output``); a direction not named keeps its own.
    specs: dict[str, AudioSpec]
    #: New turn detection (None: off), or ``UNSET`` when the update does not mention it.
    turn_detection: VadSettings | None
    #: Settings that cannot be honoured, ``(field, why)``: each gets a non-fatal error.
    unsupported: list[tuple[str, str]]


def read_session_update(data: dict[str, Any], model_rate: int,
                        format_name: Callable[[AudioSpec], str]) -> SessionUpdate | ProtocolError:
    """A ``session.update`` in either shape (GA ``session.audio.*.format`` objects, beta flat
    ``*_audio_format`` names); ``format_name`` names a format as the client's naming does."""
    event_id = client_event_id(data)

    def invalid(code: str, message: str) -> ProtocolError:
        return ProtocolError(code, message, event_id=event_id)

    session = data.get("session")
    if session is None:
        return invalid("missing_required_parameter", "session.update needs a 'session' object")
    if type(session) is not dict:
        return invalid("invalid_type", "'session' must be an object")
    kind = session.get("type")
    if kind is not None and kind != "realtime":
        return invalid("invalid_value", f"session.type must be 'realtime', got {quote(kind)}")
    specs: dict[str, AudioSpec] = {}
    audio = session.get("audio")
    if audio is not None:
        if type(audio) is not dict:
            return invalid("invalid_type", "session.audio must be an object")
        for direction in ("input", "output"):
            part = audio.get(direction)
            if part is None:
                continue
            if type(part) is not dict:
                return invalid("invalid_type", f"session.audio.{direction} must be an object")
            if part.get("format") is not None:
                spec = parse_format(part["format"], f"session.audio.{direction}.format", event_id, model_rate)
                if isinstance(spec, ProtocolError):
                    return spec
                specs[direction] = spec
    for direction in ("input", "output"):
        field = f"{direction}_audio_format"
        value = session.get(field)
        if value is None:
            continue
        spec = parse_format(value, f"session.{field}", event_id, model_rate)
        if isinstance(spec, ProtocolError):
            return spec
        if direction in specs and specs[direction] != spec:
            return invalid("invalid_value",
                           f"session.audio.{direction}.format ({format_name(specs[direction])}) "
                           f"and session.{field} ({format_name(spec)}) disagree")
        specs[direction] = spec
    audio_input = audio.get("input") if type(audio) is dict else None
    audio_input = audio_input if type(audio_input) is dict else {}
    detection: Any = UNSET
    for field, value in (("session.audio.input.turn_detection", audio_input.get("turn_detection", UNSET)),
                         ("session.turn_detection", session.get("turn_detection", UNSET))):
        if value is not UNSET:
            detection = parse_turn_detection(value, field)
            if isinstance(detection, str):
                return invalid("invalid_value", detection)
    return SessionUpdate(specs, detection, list(unsupported_settings(session, audio_input)))
