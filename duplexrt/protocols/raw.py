"""The raw duplex protocol: binary messages are audio, text messages are JSON control.

The cheapest framing there is: audio goes as is in the format chosen when the session opened.

Client → server text: ``{"type": "input.end"}`` (no more audio), ``{"type": "ping"}``.

The persona (a role prompt and a voice, for a model that takes one) comes in the URL
(``?instructions=...&voice=...``), is checked when the connection is admitted (a refusal is a 400
naming the reason) and set when the session starts; ``session.created`` shows it as
``"persona": {"voice", "instructions", "prompt_tokens"}``.  For a model that takes none the two
parameters are ignored and ``session.created`` has no ``persona``.  There is no event to change it.

Server → client text: ``{"type": "session.created", "id": ..., "input": {...}, "output": {...}}``
first (``id``: the call's, random, what its transcript is fetched by: ``GET /v1/transcripts/{id}``),
``{"type": "text", "text": ...}``, ``{"type": "error", "code": ..., "message": ...}``, and last
``{"type": "session.end", "id": ..., "reason": ..., "usage": {...}}``.  With a transcriber on the server
(``[transcriber]``), what the caller said: ``{"type": "input_text", "text": ..., "frame": ...,
"audio_ms": ...}``, one per piece (``frame``: the caller's frame whose step wrote it;
``audio_ms``: where in the caller's audio it belongs, the model's delay earlier).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import attrs

from duplexrt.audio import AudioSpec
from duplexrt.protocols.base import Translator
from duplexrt.protocols.events import (AudioIn, Event, InputEnd, ProtocolError, Reply, SessionEnd, quote,
                                      too_many_values)
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.wire.transport import Message

_PONG = json.dumps({"type": "pong"})


class RawTranslator(Translator):
    """Binary audio in a fixed format, JSON control."""

    persona_at_start = True  # it comes in the URL

    def __init__(self, input_spec: AudioSpec, output_spec: AudioSpec | None = None,
                 *, announce: bool = False) -> None:
        self.input_spec = input_spec
        self.output_spec = output_spec or input_spec
        self._announce = announce

    def start(self) -> list[Message]:
        if not self._announce:
            return []
        created: dict[str, object] = {
            "type": "session.created",
            "input": {"format": self.input_spec.format.value, "sample_rate": self.input_spec.sample_rate},
            "output": {"format": self.output_spec.format.value, "sample_rate": self.output_spec.sample_rate},
        }
        if self.call_id is not None:
            created["id"] = self.call_id
        persona = self.persona.shown()
        if persona is not None:
            created["persona"] = persona.describe()
        if self.resume_token is not None:
            created["resume_token"] = self.resume_token
        return [json.dumps(created)]

    def parse(self, message: Message) -> Event:
        if not isinstance(message, str):
            return AudioIn(message)
        if (refused := too_many_values(message)) is not None:
            return refused
        try:
            data = json.loads(message)
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the stack
            return ProtocolError("invalid_json", "text messages must be JSON objects")
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return ProtocolError("invalid_event", 'control messages must be objects with a string "type"')
        kind = data["type"]
        if kind == "input.end":
            return InputEnd()
        if kind == "ping":
            return Reply((_PONG,))
        return ProtocolError("unknown_event", f"unknown event type {quote(kind)}; expected input.end or ping")

    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        return [payload] if payload else []

    def text_out(self, text: str) -> list[Message]:
        return [json.dumps({"type": "text", "text": text})]

    def input_text(self, pieces: Sequence[TranscriptPiece]) -> list[Message]:
        return [json.dumps({"type": "input_text", "text": piece.text, "frame": piece.frame,
                            "audio_ms": piece.audio_ms}) for piece in pieces if piece.text]

    def error(self, error: ProtocolError) -> list[Message]:
        return [json.dumps({"type": "error", "code": error.code, "message": error.message})]

    def end(self, end: SessionEnd) -> list[Message]:
        usage = attrs.asdict(end)
        reason = usage.pop("reason")
        error = usage.pop("error")
        if not usage["frames_flushed"]:
            del usage["frames_flushed"]  # only models that take a flush report it
        body: dict[str, object] = {"type": "session.end", "reason": reason, "usage": usage}
        if self.call_id is not None:
            body["id"] = self.call_id
        if error is not None:
            body["error"] = error
        return [json.dumps(body)]
