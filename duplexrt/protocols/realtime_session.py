"""The parts of a Realtime ``session.update`` beyond audio formats: turn detection, the persona
(for a model that takes one), and the settings a speech-to-speech model cannot honour.

Kept apart from the translator so that what is in force, and what is refused, reads in one place.
"""

from __future__ import annotations

from typing import Any

from duplexrt.protocols.events import quote
from duplexrt.protocols.vad import VadSettings

__all__ = ["parse_turn_detection", "read_persona", "read_transcription", "render_turn_detection",
           "unsupported_settings"]

#: Longest prefix padding or silence duration accepted (ms).
_MAX_MS = 10_000


def parse_turn_detection(value: object, field: str) -> VadSettings | None | str:
    """``turn_detection`` as settings, None (off: the client commits), or an error message.

    ``semantic_vad`` is served by the same VAD: there is no semantic end-of-turn model here, and
    ``session.updated`` says ``server_vad`` so the client knows."""
    if value is None or value is False:
        return None
    if type(value) is not dict:
        return f"{field} must be an object or null, got {quote(value)}"
    kind = value.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        return f"{field}.type must be 'server_vad' or 'semantic_vad' (or turn_detection null), got {quote(kind)}"
    settings = VadSettings()
    threshold = value.get("threshold")
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
            return f"{field}.threshold must be a number from 0 to 1, got {quote(threshold)}"
        settings.threshold = float(threshold)
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        ms = value.get(name)
        if ms is None:
            continue
        if isinstance(ms, bool) or not isinstance(ms, int) or not 0 <= ms <= _MAX_MS:
            return f"{field}.{name} must be a whole number of ms from 0 to {_MAX_MS}, got {quote(ms)}"
        setattr(settings, name, ms)
    for name in ("create_response", "interrupt_response"):
        flag = value.get(name)
        if flag is None:
            continue
        if not isinstance(flag, bool):
            return f"{field}.{name} must be true or false, got {quote(flag)}"
        setattr(settings, name, flag)
    return settings


def render_turn_detection(settings: VadSettings, *, duplex: bool) -> dict[str, Any]:
    """What is in force.  In duplex mode the model decides when it speaks and how it takes an
    interruption, so the VAD only reports speech: no automatic response, no cancelling."""
    return {
        "type": "server_vad",
        "threshold": settings.threshold,
        "prefix_padding_ms": settings.prefix_padding_ms,
        "silence_duration_ms": settings.silence_duration_ms,
        "create_response": settings.create_response and not duplex,
        "interrupt_response": settings.interrupt_response and not duplex,
        "idle_timeout_ms": None,
    }


def read_persona(session: dict[str, Any]) -> tuple[str | None, str | None] | str:
    """``(instructions, voice)`` asked for by a ``session.update`` (None: not named), or an error
    message.  The voice is GA's ``session.audio.output.voice`` (a name, or ``{"id": name}``) or
    beta's ``session.voice``; both may come if they agree.  Read only for a model that takes a
    persona: for any other, these fields stay what they always were, accepted and not in force.
    The strings are returned exactly as sent (the model's check judges them)."""
    instructions = session.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return f"session.instructions must be a string, got {quote(instructions)}"
    audio = session.get("audio")
    output = audio.get("output") if type(audio) is dict else None
    named: list[tuple[str, str]] = []
    for field, value in (("session.audio.output.voice", output.get("voice") if type(output) is dict else None),
                         ("session.voice", session.get("voice"))):
        if type(value) is dict and "id" in value:
            field, value = f"{field}.id", value["id"]
        if value is None:
            continue
        if not isinstance(value, str):
            return f"{field} must be a voice's name (a string), got {quote(value)}"
        named.append((field, value))
    if len(named) == 2 and named[0][1] != named[1][1]:
        return f"{named[0][0]} ({quote(named[0][1])}) and {named[1][0]} ({quote(named[1][1])}) disagree"
    return instructions, named[0][1] if named else None


def read_transcription(session: dict[str, Any]) -> bool | None:
    """Whether a ``session.update`` asks for input transcription (GA
    ``session.audio.input.transcription``, beta ``session.input_audio_transcription``): True for
    an object (its model is not read: the server has one STT model), False for null, None when
    neither is named (no change)."""
    audio = session.get("audio")
    audio_input = audio.get("input") if type(audio) is dict else None
    named = []
    if type(audio_input) is dict and "transcription" in audio_input:
        named.append(audio_input["transcription"])
    if "input_audio_transcription" in session:
        named.append(session["input_audio_transcription"])
    if not named:
        return None
    return any(bool(value) for value in named)


def unsupported_settings(session: dict[str, Any], audio_input: dict[str, Any]) -> list[tuple[str, str]]:
    """(field, why) for each setting the client asked for that cannot be honoured.  Settings
    every framework sends by default and that change nothing audible (voice, instructions) are
    left out: they are simply not in force, and ``session.updated`` does not list them."""
    found: list[tuple[str, str]] = []
    tools = session.get("tools")
    if isinstance(tools, list) and tools:
        found.append(("session.tools", "this speech-to-speech model cannot call tools"))
    for field, value in (("session.audio.input.transcription", audio_input.get("transcription")),
                         ("session.input_audio_transcription", session.get("input_audio_transcription"))):
        if value:
            found.append((field, "input transcription is not available: the model has no speech recognition"))
    for field, value in (("session.audio.input.turn_detection.idle_timeout_ms",
                          (audio_input.get("turn_detection") or {}).get("idle_timeout_ms")
                          if type(audio_input.get("turn_detection")) is dict else None),
                         ("session.turn_detection.idle_timeout_ms",
                          (session.get("turn_detection") or {}).get("idle_timeout_ms")
                          if type(session.get("turn_detection")) is dict else None)):
        if value is not None:
            found.append((field, "idle timeouts are not supported"))
    return found
