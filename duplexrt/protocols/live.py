"""OpenAI's full-duplex "Live" protocol (``/v1/live/sessions``), the one GPT-Live clients speak.

Unlike the Realtime protocol there are no turns and no responses: one session, audio appended
continuously, the model's audio streamed back continuously (silence included).  The wire format is
the one LiveKit Agents' ``GPTLiveModel`` client speaks (``livekit/agents/llm/_realtime/gpt_live*.py``
in ``livekit-agents`` 1.8.9); this is our own reading of it.

Client events, and what this server does with them:

* ``session.start`` must come first; nothing else is accepted before it (``session_not_started``,
  not fatal).  ``session.audio.format`` picks the format of both directions: ``audio/pcm`` (24 kHz
  unless ``rate`` says otherwise), ``audio/pcmu`` or ``audio/pcma`` (8 kHz unless ``rate`` says
  otherwise).  ``model``, ``input`` (history) and ``delegation`` are accepted and not used.
  ``instructions`` and ``audio.output.voice`` are the persona (role prompt and voice) of a model
  that takes one (PersonaPlex): checked at once, and fixed when the first audio frame reaches the
  model; for any other model they are accepted and not used, as before.  A malformed
  ``session.start`` is fatal: the session could not start; so is a persona the model refuses
  (``invalid_persona``, with the model's reason: the voices there are).  Answer:
  ``session.started``, which shows the persona in effect (``instructions``,
  ``audio.output.voice``) for a model that takes one.
* ``session.input_audio.append`` carries base64 audio (no ``event_id`` needed), bounded by
  ``audio.max_message_seconds`` like the Realtime route's appends.
* ``session.input_audio.mute`` / ``unmute``: while muted each append reaches the model as silence
  of the same length, so the model's clock keeps running and it goes on speaking; acknowledged with
  ``session.input_audio.muted`` / ``unmuted``.
* ``session.close``: no more input; the model answers what it was given, then ``session.closed``
  (reason ``close_requested``, the final usage) and the server closes the connection.  A client
  must wait for ``session.closed`` before it closes the WebSocket: a Close sent right behind
  ``session.close`` is answered at once, and the end event with its usage is never sent.
* ``session.instructions.append``, ``session.thinking.append`` and ``session.commentary.append``
  (LiveKit's ``generate_reply`` sends commentary, for a greeting) are acknowledged as the service
  does, ``session.<kind>.appended`` with ``client_event_id`` and the accepted range on the session
  timeline (``start_ms`` = ``end_ms``, the session's position: nothing is injected), and change
  nothing: no duplexrt backend takes text.  They need ``content`` (a string) and
  ``delegation_id`` (present, null or a string), as the protocol says.
* ``session.update`` (delegation settings, sent when an agent's tools change) is acknowledged
  with ``session.updated`` carrying the complete resolved session, the one ``session.started``
  showed: there is no delegation here, so nothing changes.  It needs a ``session`` object.  For a
  model that takes a persona, ``instructions`` / ``audio.output.voice`` in it may change the
  persona until the first audio frame; after that a change gets a non-fatal ``persona_locked``
  error and the call goes on as it was (repeating the persona in effect is no change, no error);
  a persona the model refuses gets a non-fatal ``invalid_persona`` error.
* ``response.item.create`` and ``response.create`` drive delegated Responses work, which this
  server does not have: each is answered with an ``unsupported_event`` error naming it, and the
  session goes on.

Server events:

* ``session.output_audio.delta``: one per batch of model frames sent, so at the model's pace (one
  80 ms frame each at real-time pace), silence included.
* ``session.output_transcript.delta``: the model's text, with ``start_ms`` / ``end_ms`` on the
  session timeline (frame ``i`` spans ``[i × 80, (i + 1) × 80)`` ms): the span of the frames it
  came with.
* ``session.input_transcript.delta``: what the caller said, with a transcriber on
  (``[transcriber]``): one per piece of text, ``start_ms`` / ``end_ms`` the span of the caller's
  frame it belongs to on the same timeline (the frame whose step wrote it, less the model's
  delay: the text comes that much after the audio).  None without a transcriber.
* ``session.usage.updated``, about once a second of session timeline: ``usage.seconds`` is the
  running total of audio the model has taken (the session's length on its own clock), and
  ``context_window.usage_ratio`` is that length over the session's limit (the model's context or
  ``runtime.max_session_seconds``, whichever is shorter; null when there is none).
* ``session.closed`` last, with the final ``usage`` (exact: every frame the model took) and a
  reason: ``close_requested`` after ``session.close``, ``expired`` when the session reached its
  length limit, ``remote_hangup`` when the server drains on SIGTERM (the server hung up; the
  client reconnects, to another server), ``connection_lost`` for everything else (a model failure,
  a fatal client error, a server timeout, and any reason this translator does not know).  As
  duplexrt extensions, ``usage`` also carries ``frames_in`` / ``frames_out`` (model frames) and
  the event ``finish_reason`` (the session's own reason: ``stop``, ``length``, ...).
* ``error``: ``{"type": "error", "error": {"type", "code", "message", "param",
  "client_event_id"}}``.  None of our codes is one the client treats as fatal
  (``invalid_api_key`` and the like): a bad API key is refused at the HTTP upgrade with 401.

Nothing the client sends is echoed back at full length (``clip`` / ``quote``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
from duplexrt.audio.g711 import alaw_encode, ulaw_encode
from duplexrt.backends.base import PersonaError
from duplexrt.protocols.b64audio import Base64Audio
from duplexrt.protocols.b64codec import encode
from duplexrt.protocols.base import PersonaLocked, SessionProgress, Translator
from duplexrt.protocols.events import (
    AudioIn,
    Event,
    InputEnd,
    ProtocolError,
    Reconfigure,
    Reply,
    SessionEnd,
    clip,
    json_object,
    quote,
)
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.wire.transport import Message

__all__ = ["CLOSE_REASONS", "LiveTranslator", "close_reason"]

_PCM_RATE = 24000
_G711_RATE = 8000
_FORMATS = {
    "audio/pcm": AudioFormat.PCM_S16LE,
    "audio/pcmu": AudioFormat.G711_ULAW,
    "audio/pcma": AudioFormat.G711_ALAW,
}
_NAMES = {fmt: name for name, fmt in _FORMATS.items()}
#: One sample of silence in each format (the code nearest zero: A-law has no exact zero, its
#: nearest is 1/4096 of full scale): what a muted append is replaced with.
_SILENCE = {
    AudioFormat.PCM_S16LE: b"\x00\x00",
    AudioFormat.G711_ULAW: ulaw_encode(np.zeros(1, np.float32)).tobytes(),
    AudioFormat.G711_ALAW: alaw_encode(np.zeros(1, np.float32)).tobytes(),
}

_DEFAULT_REASON = "connection_lost"
#: The session's finish reason -> the Live protocol's close reason, for every finish reason:
#: the Live list has no name for the server's timeouts, a fatal client error or a client that
#: went away, so those are ``connection_lost`` (as is any other string, in ``close_reason``).
CLOSE_REASONS: dict[str, str] = {  # keyed by FinishReason, a StrEnum: its plain string finds it too
    FinishReason.STOP: "close_requested",
    FinishReason.LENGTH: "expired",
    FinishReason.SHUTDOWN: "remote_hangup",
    FinishReason.CLIENT_CLOSED: _DEFAULT_REASON,
    FinishReason.ERROR: _DEFAULT_REASON,
    FinishReason.FIRST_MESSAGE_TIMEOUT: _DEFAULT_REASON,
    FinishReason.IDLE_TIMEOUT: _DEFAULT_REASON,
    FinishReason.PING_TIMEOUT: _DEFAULT_REASON,
    FinishReason.MESSAGE_TOO_BIG: _DEFAULT_REASON,
    FinishReason.PROTOCOL_ERROR: _DEFAULT_REASON,
    FinishReason.RESUME_EXPIRED: _DEFAULT_REASON,
}

#: Client events that need delegation: this server has none, and says so.
_UNSUPPORTED = {
    "response.item.create": "this server has no delegation (no Responses backend)",
    "response.create": "this server has no delegation (no Responses backend)",
}
#: Context appends: acknowledged, and no-ops (no duplexrt backend takes text).
_APPENDS = ("session.instructions.append", "session.thinking.append", "session.commentary.append")

_BINARY = ProtocolError(
    "binary_not_supported",
    "binary messages are not part of the Live protocol; send audio as base64 in "
    "session.input_audio.append events",
    close_code=CloseCode.UNSUPPORTED_DATA,
    fatal=True,
)

_session_ids = itertools.count(1)
_MISSING = object()


def _read_persona(session: dict[str, Any]) -> tuple[str | None, str | None] | str:
    """``(instructions, voice)`` named in a session object (None: not named; strings exactly as
    sent), or an error message."""
    instructions = session.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        return f"session.instructions must be a string, got {quote(instructions)}"
    audio = session.get("audio")
    output = audio.get("output") if type(audio) is dict else None
    voice = output.get("voice") if type(output) is dict else None
    if voice is not None and not isinstance(voice, str):
        return f"session.audio.output.voice must be a voice's name (a string), got {quote(voice)}"
    return instructions, voice


def close_reason(finish_reason: str) -> str:
    """The Live close reason for a session's finish reason."""
    return CLOSE_REASONS.get(finish_reason, _DEFAULT_REASON)


class _ZeroProgress:
    frames_in = 0
    frames_out = 0
    frames_answered = 0
    max_frames = None


def _client_event_id(data: dict[str, Any]) -> str | None:
    event_id = data.get("event_id")
    return clip(event_id) if isinstance(event_id, str) else None


class LiveTranslator(Translator):
    """One session of the Live protocol."""

    def __init__(self, *, model_rate: int = 24000, frame_seconds: float = 0.08,
                 model: str = "duplexrt", session_id: str | None = None,
                 max_message_seconds: float | None = None, usage_interval_seconds: float = 1.0) -> None:
        self.model_rate = model_rate
        self.frame_seconds = frame_seconds
        self.model = model
        self.session_id = session_id or f"live_{next(_session_ids)}"
        self.max_message_seconds = max_message_seconds
        self.input_spec = AudioSpec.create(AudioFormat.PCM_S16LE, _PCM_RATE, model_rate=model_rate)
        self.output_spec = self.input_spec
        self.progress: SessionProgress = _ZeroProgress()
        self._frame_ms = frame_seconds * 1000
        self._usage_every = max(1, round(usage_interval_seconds / frame_seconds))
        self._next_usage = self._usage_every
        self._audio = self._audio_rules()
        self._silence = _SILENCE[AudioFormat.PCM_S16LE]
        self.started = False
        self.muted = False
        self.close_requested = False
        self._fatal_sent = False
        self._text: list[str] = []
        self._handlers: dict[str, Callable[[dict[str, Any]], Event]] = {
            "session.start": self._start,
            "session.input_audio.append": self._append,
            "session.input_audio.mute": self._mute,
            "session.input_audio.unmute": self._unmute,
            "session.close": self._close,
            "session.update": self._update,
        }
        for name in _APPENDS:
            self._handlers[name] = self._append_context
        for name in _UNSUPPORTED:
            self._handlers[name] = self._unsupported

    # -- server -> client ----------------------------------------------------------------------

    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        if not self.started:
            return []
        messages: list[Message] = []
        first = self.progress.frames_answered
        if self._text:
            start_ms = round(first * self._frame_ms)
            end_ms = round((first + max(frames, 1)) * self._frame_ms)
            for text in self._text:
                messages.append(f'{{"type":"session.output_transcript.delta","delta":{json.dumps(text)},'
                                f'"start_ms":{start_ms},"end_ms":{end_ms}}}')
            self._text = []
        if payload:
            # By hand: base64 needs no escaping, so the per-frame path skips json.dumps.
            messages.append('{"type":"session.output_audio.delta","delta":"'
                            + encode(payload) + '"}')
        if first + frames >= self._next_usage:
            self._next_usage = first + frames + self._usage_every
            messages.append(self._usage_event())
        return messages

    def text_out(self, text: str) -> list[Message]:
        # Held until the batch's audio_out, which says which frames (so which span) it came with.
        if self.started and text:
            self._text.append(text)
        return []

    def input_text(self, pieces: Sequence[TranscriptPiece]) -> list[Message]:
        if not self.started:
            return []
        frame_ms = self._frame_ms
        return [f'{{"type":"session.input_transcript.delta","delta":{json.dumps(piece.text)},'
                f'"start_ms":{round(piece.audio_ms)},"end_ms":{round(piece.audio_ms + frame_ms)}}}'
                for piece in pieces if piece.text]

    def error(self, error: ProtocolError) -> list[Message]:
        if error.fatal:
            self._fatal_sent = True
        return [self._error_event("invalid_request_error", error.code, error.message, error.event_id)]

    def end(self, end: SessionEnd) -> list[Message]:
        messages: list[Message] = []
        if end.reason == FinishReason.ERROR and not self._fatal_sent:
            messages.append(self._error_event("server_error", "server_error",
                                              end.error or "internal server error", None))
        if not self.started:
            return messages  # no session to close: the client never heard session.started
        usage = {"seconds": end.seconds_in, "frames_in": end.frames_in, "frames_out": end.frames_out}
        messages.append(json.dumps({"type": "session.closed", "reason": close_reason(end.reason),
                                    "usage": usage, "finish_reason": end.reason}))
        return messages

    def _usage_event(self) -> str:
        progress = self.progress
        frames = progress.frames_in
        limit = getattr(progress, "max_frames", None)
        ratio = None if not limit else round(min(1.0, frames / limit), 6)
        return json.dumps({"type": "session.usage.updated",
                           "usage": {"seconds": round(frames * self.frame_seconds, 6)},
                           "context_window": {"usage_ratio": ratio}})

    def _error_event(self, kind: str, code: str | None, message: str, event_id: str | None) -> str:
        return json.dumps({"type": "error", "error": {
            "type": kind, "code": code, "message": message, "param": None, "client_event_id": event_id}})

    # -- client -> server ----------------------------------------------------------------------

    def parse(self, message: Message) -> Event:
        if not isinstance(message, str):
            return _BINARY
        if self.started:  # the usual append, without json scanning its base64
            raw = self._audio.read_append(message)
            if raw is not None:
                return self._take_audio(raw)
        data = json_object(message)
        if isinstance(data, ProtocolError):
            return data
        kind = data.get("type")
        if type(kind) is not str:
            return ProtocolError("invalid_event", 'client events must be JSON objects with a string "type"',
                                 event_id=_client_event_id(data))
        handler = self._handlers.get(kind)
        if handler is None:
            return ProtocolError("unknown_event", f"unknown event type {quote(kind)}",
                                 event_id=_client_event_id(data))
        if not self.started and kind not in ("session.start", "session.close"):
            return ProtocolError("session_not_started",
                                 f"{kind} before session.start: the first event must be session.start, "
                                 "and nothing else is accepted until session.started",
                                 event_id=_client_event_id(data))
        return handler(data)

    def _start(self, data: dict[str, Any]) -> Event:
        event_id = _client_event_id(data)
        if self.started:
            return ProtocolError("session_already_started",
                                 "session.start may come only once per connection; "
                                 "a new session needs a new connection", event_id=event_id)

        def invalid(code: str, message: str) -> ProtocolError:
            # Fatal: a client that waits for session.started would otherwise wait forever.
            return ProtocolError(code, f"{message}; the session cannot start", event_id=event_id, fatal=True)

        session = data.get("session")
        if session is None:
            return invalid("missing_required_parameter", "session.start needs a 'session' object")
        if type(session) is not dict:
            return invalid("invalid_type", "'session' must be an object")
        model = session.get("model")
        if model is not None and not isinstance(model, str):
            return invalid("invalid_type", f"session.model must be a string, got {quote(model)}")
        spec = self.input_spec
        audio = session.get("audio")
        if audio is not None:
            if type(audio) is not dict:
                return invalid("invalid_type", "session.audio must be an object")
            fmt = audio.get("format")
            if fmt is not None:
                parsed = self._parse_format(fmt)
                if isinstance(parsed, str):
                    return invalid("invalid_value", parsed)
                spec = parsed
        if self.persona.taken:
            asked = _read_persona(session)
            if isinstance(asked, str):
                return invalid("invalid_type", asked)
            try:
                self.persona.ask(*asked)
            except PersonaError as exc:
                return invalid("invalid_persona", f"the persona (instructions and voice) was refused: "
                                                  f"{clip(str(exc), 500)}")
        # model, input and delegation are accepted and not used (see above); so are instructions and
        # voice for a model that takes no persona.
        self.started = True
        self.input_spec = self.output_spec = spec
        self._silence = _SILENCE[spec.format]
        self._audio = self._audio_rules()
        body: dict[str, Any] = {"type": "session.started", "session": self._session_resource()}
        if self.resume_token is not None:
            body["resume_token"] = self.resume_token
        started = json.dumps(body)
        return Reconfigure(input_spec=spec, output_spec=spec, messages=(started,))

    def _parse_format(self, value: object) -> AudioSpec | str:
        """``{"type": "audio/pcm", "rate": 24000}``, or an error message."""
        if type(value) is not dict:
            return f"session.audio.format must be an object such as {{\"type\": \"audio/pcm\"}}, got {quote(value)}"
        name, rate = value.get("type"), value.get("rate")
        fmt = _FORMATS.get(name) if isinstance(name, str) else None
        if fmt is None:
            return f"session.audio.format.type must be audio/pcm, audio/pcmu or audio/pcma, got {quote(name)}"
        if rate is None:
            rate = _PCM_RATE if fmt is AudioFormat.PCM_S16LE else _G711_RATE
        elif isinstance(rate, float) and rate.is_integer():
            rate = int(rate)
        if not isinstance(rate, int) or isinstance(rate, bool):
            return f"session.audio.format.rate must be a whole number of Hz, got {quote(rate)}"
        try:
            return AudioSpec.create(fmt, rate, model_rate=self.model_rate)
        except AudioFormatError as exc:
            return f"session.audio.format.rate: {clip(str(exc), 200)}"

    def _append(self, data: dict[str, Any]) -> Event:
        raw = self._audio.decode(data.get("audio"), _client_event_id(data))
        if isinstance(raw, ProtocolError):
            return raw
        return self._take_audio(raw)

    def _take_audio(self, raw: bytes) -> AudioIn:
        if self.muted:
            # The caller's audio is replaced, not dropped: the model's clock keeps running.
            return AudioIn(self._silence * (len(raw) // len(self._silence)))
        return AudioIn(raw)

    def _mute(self, data: dict[str, Any]) -> Event:
        self.muted = True
        return Reply((json.dumps({"type": "session.input_audio.muted",
                                  "client_event_id": _client_event_id(data)}),))

    def _unmute(self, data: dict[str, Any]) -> Event:
        self.muted = False
        return Reply((json.dumps({"type": "session.input_audio.unmuted",
                                  "client_event_id": _client_event_id(data)}),))

    def _close(self, data: dict[str, Any]) -> Event:
        self.close_requested = True
        return InputEnd()

    def _append_context(self, data: dict[str, Any]) -> Event:
        kind, event_id = data["type"], _client_event_id(data)
        content = data.get("content")
        if not isinstance(content, str):
            return ProtocolError("invalid_type" if "content" in data else "missing_required_parameter",
                                 f"{kind} needs 'content', a string, got {quote(content)}", event_id=event_id)
        delegation_id = data.get("delegation_id", _MISSING)
        if delegation_id is _MISSING:
            return ProtocolError("missing_required_parameter",
                                 f"{kind} needs 'delegation_id' (null for session context)", event_id=event_id)
        if delegation_id is not None and not isinstance(delegation_id, str):
            return ProtocolError("invalid_type", f"{kind}: delegation_id must be null or a string, "
                                                 f"got {quote(delegation_id)}", event_id=event_id)
        # Placed on the timeline where the session is now, spanning nothing: no backend takes text.
        now_ms = round(self.progress.frames_in * self._frame_ms)
        return Reply((json.dumps({"type": kind[:-len("append")] + "appended", "client_event_id": event_id,
                                  "start_ms": now_ms, "end_ms": now_ms}),))

    def _update(self, data: dict[str, Any]) -> Event:
        event_id = _client_event_id(data)
        session = data.get("session")
        if type(session) is not dict:
            return ProtocolError("invalid_type" if "session" in data else "missing_required_parameter",
                                 "session.update needs a 'session' object", event_id=event_id)
        errors: list[Message] = []
        if self.persona.taken:  # the persona may change until the first audio frame
            asked = _read_persona(session)
            if isinstance(asked, str):
                return ProtocolError("invalid_type", asked, event_id=event_id)
            if asked != (None, None):
                errors = self._ask_persona(*asked, event_id=event_id)
        # Only delegation settings may change once started, and there is no delegation here: the
        # resolved session is the one session.started showed (with the persona in effect).
        return Reply((json.dumps({"type": "session.updated", "client_event_id": event_id,
                                  "session": self._session_resource()}), *errors))

    def _ask_persona(self, text: str | None, voice: str | None, *, event_id: str | None) -> list[Message]:
        try:
            self.persona.ask(text, voice)
        except PersonaLocked as exc:
            return self.error(ProtocolError("persona_locked", f"{clip(str(exc), 500)}; the session goes on",
                                            event_id=event_id))
        except PersonaError as exc:
            return self.error(ProtocolError("invalid_persona", f"the persona (instructions and voice) was refused: "
                                            f"{clip(str(exc), 500)}; the persona in effect is unchanged and the "
                                            "session goes on", event_id=event_id))
        return []

    def _session_resource(self) -> dict[str, Any]:
        """The resolved session, as ``session.started`` and ``session.updated`` show it."""
        audio: dict[str, Any] = {"format": self._format_object(self.input_spec)}
        resource: dict[str, Any] = {"id": self.session_id, "model": self.model, "audio": audio}
        persona = self.persona.shown()
        if persona is not None:  # a model that takes one: the persona in effect
            resource["instructions"] = persona.text
            audio["output"] = {"voice": persona.voice}
        return resource

    def _unsupported(self, data: dict[str, Any]) -> Event:
        kind = data["type"]
        return ProtocolError("unsupported_event",
                             f"{kind} is not supported by this server: {_UNSUPPORTED[kind]}; the session goes on",
                             event_id=_client_event_id(data))

    # -- helpers ------------------------------------------------------------------------------------

    def _audio_rules(self) -> Base64Audio:
        spec = self.input_spec
        return Base64Audio("session.input_audio.append", spec.format.bytes_per_sample or 1,
                           spec.sample_rate, self._format_name(spec), self.max_message_seconds)

    @staticmethod
    def _format_name(spec: AudioSpec) -> str:
        return f"{_NAMES.get(spec.format, spec.format.value)} at {spec.sample_rate} Hz"

    @staticmethod
    def _format_object(spec: AudioSpec) -> dict[str, Any]:
        return {"type": _NAMES.get(spec.format, spec.format.value), "rate": spec.sample_rate}
