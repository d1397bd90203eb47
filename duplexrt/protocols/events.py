"""The events a session understands, whatever protocol carried them."""

from __future__ import annotations

import attrs


@attrs.frozen
class AudioIn:
    """Client audio, still in the wire format."""

    payload: bytes | bytearray | memoryview


@attrs.frozen
class InputEnd:
    """The client has no more audio: finish what is queued, then end the session."""


@attrs.frozen
class ProtocolError:
    """The client sent something the protocol does not allow.  ``fatal`` ends the session."""

    code: str
    message: str
    close_code: int = 1008
    fatal: bool = False


@attrs.frozen
class Ignored:
    """A message the protocol accepts and has nothing to do with (a ping, an unknown kind)."""


Event = AudioIn | InputEnd | ProtocolError | Ignored


@attrs.frozen
class SessionEnd:
    """How a session ended, with its usage: what the client is told last."""

    reason: str
    frames_in: int
    frames_out: int
    seconds_in: float
    seconds_out: float
    error: str | None = None
