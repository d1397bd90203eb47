"""The raw duplex protocol: binary messages are audio, text messages are JSON control.

The cheapest framing there is, and the one ``duplexrt simulate`` speaks in process.

Client → server text: ``{"type": "input.end"}`` (no more audio).
Server → client text: ``{"type": "text", "text": ...}``, ``{"type": "error", "code": ...,
"message": ...}``, and last ``{"type": "session.end", "reason": ..., "usage": {...}}``.
"""

from __future__ import annotations

import json

import attrs

from duplexrt.protocols.events import AudioIn, Event, Ignored, InputEnd, ProtocolError, SessionEnd
from duplexrt.transport import Message, UNSUPPORTED_DATA


class RawProtocol:
    """Translates raw-protocol messages to events and back.  Holds no state between messages."""

    def parse(self, message: Message) -> Event:
        if isinstance(message, bytes | bytearray | memoryview):
            return AudioIn(message)
        try:
            data = json.loads(message)
        except ValueError:
            return ProtocolError("invalid_json", "text messages must be JSON objects")
        if not isinstance(data, dict) or not isinstance(data.get("type"), str):
            return ProtocolError("invalid_event", 'control messages must be objects with a string "type"')
        kind = data["type"]
        if kind == "input.end":
            return InputEnd()
        if kind == "ping":
            return Ignored()
        return ProtocolError("unknown_event", f"unknown event type {kind!r}; expected input.end or ping")

    def audio(self, payload: bytes) -> Message:
        return payload

    def text(self, text: str) -> Message:
        return json.dumps({"type": "text", "text": text})

    def error(self, error: ProtocolError) -> Message:
        return json.dumps({"type": "error", "code": error.code, "message": error.message})

    def end(self, end: SessionEnd) -> Message:
        usage = attrs.asdict(end)
        reason = usage.pop("reason")
        error = usage.pop("error")
        body: dict[str, object] = {"type": "session.end", "reason": reason, "usage": usage}
        if error is not None:
            body["error"] = error
        return json.dumps(body)


__all__ = ["RawProtocol", "UNSUPPORTED_DATA"]
