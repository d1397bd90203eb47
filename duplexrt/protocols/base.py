"""The contract between a session and a wire protocol.

A translator is sans-IO: it turns each client message into one event for the session, and each
thing the session has to say (audio, model text, an error, the end) into the protocol's messages.
It never touches a socket, a clock or the runtime, so it is tested with plain calls.

The session calls ``audio_out`` for every batch of model audio it sends, so translators keep that
path to a list of one message where they can.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Sequence
from typing import Protocol

from duplexrt.audio import AudioSpec
from duplexrt.protocols.events import Event, ProtocolError, SessionEnd
from duplexrt.wire.transport import Message


class SessionProgress(Protocol):
    """Live counters of the session, readable by its translator."""

    @property
    def frames_in(self) -> int:
        """Model frames submitted so far."""
        ...

    @property
    def frames_out(self) -> int:
        """Model frames of output sent so far."""
        ...

    @property
    def frames_answered(self) -> int:
        """Input frames whose output is settled: sent, or dropped at the client's request
        (``ClearOutput``).  What a translator waits on to know a turn has been answered."""
        ...

    @property
    def max_frames(self) -> int | None:
        """The most frames the session may take (the model's context or
        ``runtime.max_session_seconds``, whichever is less), or None for no limit."""
        ...


class Translator(abc.ABC):
    """One session's protocol state machine."""

    #: The format the client sends audio in, and the one it receives (both may change on a
    #: ``Reconfigure`` event).
    input_spec: AudioSpec
    output_spec: AudioSpec
    #: The session's resume token, set by the server before ``start`` when resume is on
    #: (``runtime.resume_window_s``): ``start`` names it in the session's first message.
    resume_token: str | None = None

    def attach(self, progress: SessionProgress) -> None:
        """Called once by the session before ``start``: the counters the translator may read."""
        self.progress = progress

    def start(self) -> list[Message]:
        """Messages to send as soon as the session is open (a handshake, ``session.created``)."""
        return []

    def resumed(self, token: str, received: int) -> list[Message]:
        """The first messages on a resumed connection, before the output the client missed: the
        next resume ``token`` and how many client messages the session ``received`` (the client
        sends the rest again).  Not counted among the session's messages.  Default: one JSON
        ``session.resumed`` event."""
        return [json.dumps({"type": "session.resumed", "resume_token": token, "received": received})]

    @abc.abstractmethod
    def parse(self, message: Message) -> Event:
        """One client message, as one event."""

    @abc.abstractmethod
    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        """Messages carrying ``payload`` (``frames`` model frames of output, in ``output_spec``)."""

    def next_boundary(self) -> int | None:
        """The frame count (``progress.frames_answered``) at which this translator starts to treat
        output differently: the end of a turn, after which frames belong to the next response.
        The session never hands one ``audio_out`` call frames from both sides of it, so each
        response carries exactly its own.  None (the default): no boundary ahead.  Called once
        per batch of output, so it must be cheap."""
        return None

    def recode_held(self, recode: Callable[[Sequence[bytes]], list[bytes]]) -> None:
        """The output format changed: re-encode any audio the translator holds back, in its old
        format, so that none goes out in the old format after the change is announced.
        ``recode`` maps the held payloads, in order, to as many payloads in the new format (one
        stream: the last carries what the conversion still held back).  Default: nothing held."""

    def text_out(self, text: str) -> list[Message]:
        """Messages carrying model text; none by default."""
        return []

    @abc.abstractmethod
    def error(self, error: ProtocolError) -> list[Message]:
        """The protocol's error message for ``error``."""

    @abc.abstractmethod
    def end(self, end: SessionEnd) -> list[Message]:
        """The last messages of the session: usage and the finish reason, as the protocol says
        them.  Also used when the server shuts down (reason ``shutdown``)."""
