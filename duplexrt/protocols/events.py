"""The events a session understands, whatever protocol carried them."""

from __future__ import annotations

import attrs

from duplexrt.audio import AudioSpec
from duplexrt.transport import Message, POLICY_VIOLATION


@attrs.frozen
class AudioIn:
    """Client audio, still in the wire format of the translator's current ``input_spec``."""

    payload: bytes | bytearray | memoryview


@attrs.frozen
class InputEnd:
    """The client has no more audio: finish what is queued, then end the session."""


@attrs.frozen
class ProtocolError:
    """The client sent something the protocol does not allow.

    The session sends the protocol's error for it and goes on, unless ``fatal``: then it closes
    with ``close_code`` (1003, 1007, 1008 or 1009) and the message as the reason.
    """

    code: str
    message: str
    close_code: int = POLICY_VIOLATION
    fatal: bool = False
    #: The id of the client event that caused it, where the protocol has ids.
    event_id: str | None = None


@attrs.frozen
class Ignored:
    """A message the protocol accepts and that needs nothing from the session (a ping)."""


@attrs.frozen
class Reply:
    """Send these messages back, and nothing else (an acknowledgement, a pong)."""

    messages: tuple[Message, ...]


@attrs.frozen
class Reconfigure:
    """The client changed formats: the session rebuilds its decoder and encoder from the
    translator's ``input_spec`` and ``output_spec``, then sends ``messages``."""

    messages: tuple[Message, ...] = ()


@attrs.frozen
class ClearInput:
    """Drop the audio received but not yet cut into a whole frame, then send ``messages``."""

    messages: tuple[Message, ...] = ()


@attrs.frozen
class ClearOutput:
    """Drop the model's audio not yet sent, then send ``messages``."""

    messages: tuple[Message, ...] = ()


Event = AudioIn | InputEnd | ProtocolError | Ignored | Reply | Reconfigure | ClearInput | ClearOutput


@attrs.frozen
class SessionEnd:
    """How a session ended, with its usage: what the client is told last."""

    reason: str
    frames_in: int
    frames_out: int
    seconds_in: float
    seconds_out: float
    error: str | None = None
    #: Pieces of model text sent (one per step that produced text).
    text_tokens_out: int = 0
    #: From the first frame submitted to the last output sent.
    generation_seconds: float = 0.0


__all__ = [
    "AudioIn", "AudioSpec", "ClearInput", "ClearOutput", "Event", "Ignored", "InputEnd",
    "ProtocolError", "Reconfigure", "Reply", "SessionEnd",
]
