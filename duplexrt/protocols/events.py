"""The events a session understands, whatever protocol carried them."""

from __future__ import annotations

import json
import reprlib
from typing import Any

import attrs

from duplexrt.audio import AudioSpec
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import Message


@attrs.frozen
class AudioIn:
    """Client audio, still in the wire format of the translator's current ``input_spec``, and the
    messages to send once it is taken (what a server VAD found in it, an item acknowledged)."""

    payload: bytes | bytearray | memoryview
    messages: tuple[Message, ...] = ()


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
    close_code: int = CloseCode.POLICY_VIOLATION
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
    """The client changed formats: the session rebuilds its decoder and encoder for the formats
    this event carries (the ones the translator now speaks), then sends ``messages``.  The event
    carries them forward so that the session never reads the translator's state back."""

    input_spec: AudioSpec
    output_spec: AudioSpec
    messages: tuple[Message, ...] = ()


@attrs.frozen
class ClearInput:
    """Drop the audio received but not yet cut into a whole frame, then send ``messages``."""

    messages: tuple[Message, ...] = ()


@attrs.frozen
class ClearOutput:
    """Drop the model's audio not yet sent, then send ``messages``."""

    messages: tuple[Message, ...] = ()


@attrs.frozen
class EndTurn(Reply):
    """A reply that also ends the caller's turn, its input not (turn mode's commit): a model that
    finishes its output after its input (``BackendInfo.flush_frames``: a translation model) is
    fed that flush first, so the output answering this turn holds all of it.  For any other
    model it is the plain reply it derives from."""


Event = AudioIn | InputEnd | ProtocolError | Ignored | Reply | Reconfigure | ClearInput | ClearOutput


@attrs.frozen
class SessionEnd:
    """How a session ended, with its usage: what the client is told last."""

    reason: FinishReason
    frames_in: int
    frames_out: int
    seconds_in: float
    seconds_out: float
    error: str | None = None
    #: Pieces of model text sent (one per step that produced text).
    text_tokens_out: int = 0
    #: From the first frame submitted to the last output sent.
    generation_seconds: float = 0.0
    #: ``runtime.late_input = "fill"``: frames stepped with silence because the client's audio
    #: was overdue (counted in ``frames_in``), and frames of the client's audio then dropped
    #: because they came for time already filled.
    frames_filled: int = 0
    frames_dropped_late: int = 0
    #: Frames fed after the caller's input to let the model finish (``BackendInfo.flush_frames``):
    #: not in ``frames_in``; their output is in ``frames_out``.
    frames_flushed: int = 0


#: Client values quoted in error messages are cut to about this many characters.
QUOTE_LIMIT = 100

_quoter = reprlib.Repr()
_quoter.maxlevel = 2
_quoter.maxdict = _quoter.maxlist = _quoter.maxtuple = _quoter.maxset = 4
_quoter.maxlong = _quoter.maxstring = _quoter.maxother = QUOTE_LIMIT


def quote(value: object, limit: int = QUOTE_LIMIT) -> str:
    """``repr(value)``, cut to about ``limit`` characters with an ellipsis.

    An error names what the client sent, but must not echo it whole: a client that sends
    megabyte-long values and never reads would otherwise make every reply a megabyte.  reprlib
    never builds the full repr of a big container, so the cost is bounded too.
    """
    if isinstance(value, str):  # the usual case: the head of the string, then the ellipsis
        return repr(value) if len(value) <= limit else repr(value[:limit]) + "…"
    text = _quoter.repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def clip(text: str, limit: int = QUOTE_LIMIT) -> str:
    """``text`` itself, cut to ``limit`` characters with an ellipsis when longer."""
    return text if len(text) <= limit else text[:limit] + "…"


__all__ = [
    "AudioIn", "AudioSpec", "ClearInput", "ClearOutput", "EndTurn", "Event", "Ignored", "InputEnd",
    "ProtocolError", "QUOTE_LIMIT", "Reconfigure", "Reply", "SessionEnd", "clip", "quote",
]


#: More separators (``,`` and ``:``) than this in one client event, and it is refused unparsed.
#: ``json.loads`` holds the thread every session shares for a time that grows with the number of
#: values, far more per byte for many small values than for one long string; no client event
#: needs this many (audio travels as one string), and counting them costs next to nothing.
MAX_JSON_SEPARATORS = 32_768


def too_many_values(message: str) -> ProtocolError | None:
    """The error for a JSON text with more than ``MAX_JSON_SEPARATORS`` separators, else None."""
    if message.count(",") + message.count(":") <= MAX_JSON_SEPARATORS:
        return None
    return ProtocolError("invalid_event", f"a client event may hold at most {MAX_JSON_SEPARATORS} JSON values "
                                          "(counted by their commas and colons)")


def json_object(message: str) -> dict[str, Any] | ProtocolError:
    """A JSON route's client event as an object, or the error both JSON routes (Realtime, Live)
    answer a malformed one with.  Deeply nested JSON is refused like any other bad JSON, and JSON
    of too many values before it is parsed."""
    if (refused := too_many_values(message)) is not None:
        return refused
    try:
        data = json.loads(message)
    except (ValueError, RecursionError):
        return ProtocolError("invalid_json", "client events must be JSON objects")
    if type(data) is not dict:
        return ProtocolError("invalid_event", 'client events must be JSON objects with a string "type"')
    return data
