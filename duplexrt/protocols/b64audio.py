"""Audio carried as base64 text inside a JSON event (the Realtime and Live protocols' appends).

Shared so that both JSON routes refuse the same things with the same words: a missing, mistyped or
empty ``audio`` field, base64 that is not, a length that is not whole samples, and more audio in
one event than ``audio.max_message_seconds`` allows, refused from the text's length before it is
decoded (decoding a 16 MiB append would hold the trio thread, and every session on it, for as
long as that takes).

An append is nearly all base64, and ``json.loads`` scans every character of it for quotes and
escapes (the translator's share of a frame: ``benchmarks/profile_server.py`` on
``/v1/realtime``).  ``Base64Audio.read_append`` reads the usual shape, an
append whose last member is its ``"audio"``, without that scan: the rest of the event is parsed as
JSON with the audio emptied (once per distinct text), and the audio is decoded straight from the text.  Base64 that decodes
strictly holds no quote, backslash or control character, so the two texts are the same JSON but
for that one string; anything else (other shapes, bad or oversized audio) is left to the general
path, which answers it as before.
"""

from __future__ import annotations

import math
import sys

import attrs

from duplexrt.protocols.b64codec import decode_strict
from duplexrt.protocols.events import ProtocolError, json_object

__all__ = ["Base64Audio"]

#: ``(event, text before the audio)`` pairs already read as that event with its audio last: the
#: SDKs write the same few bytes before every append's audio, parsed as JSON once per process.
#: Shared by every session, so both the entries and each text are bounded: a client's long or
#: ever-different heads must not stay alive after its session (at most 256 x 256 characters).
#: What it saves is the JSON parse of the head on every append of the usual shape.
_APPEND_HEADS: set[tuple[str, str]] = set()
_MAX_HEADS = 256
_MAX_HEAD_CHARS = 256


@attrs.frozen
class Base64Audio:
    """The decoding rules for one event type in one input format."""

    #: The client event that carries the audio, named in every error.
    event: str
    #: Bytes per sample of the input format (1 for G.711, 2 for pcm16).
    sample_bytes: int
    sample_rate: int
    #: The input format as errors name it ("audio/pcm at 24000 Hz").
    format_name: str
    #: ``audio.max_message_seconds``; None: no bound.
    max_seconds: float | None = None
    max_chars: int = attrs.field(init=False)

    @max_chars.default
    def _max_chars(self) -> int:
        """The longest base64 text whose audio can fit in ``max_seconds``."""
        if self.max_seconds is None:
            return sys.maxsize
        samples = math.floor(self.max_seconds * self.sample_rate + 1e-6)
        return 4 * -(-samples * self.sample_bytes // 3)

    def decode(self, audio: object, event_id: str | None) -> bytes | ProtocolError:
        """The audio bytes of an event's ``audio`` field, or the error to answer it with."""
        if type(audio) is not str or not audio:
            return self._bad_field(audio, event_id)
        if len(audio) > self.max_chars:
            return self._too_long(len(audio), event_id)
        try:
            raw = decode_strict(audio)
        except ValueError:
            return self._lenient(audio, event_id)
        if len(raw) % self.sample_bytes:
            return self._bad_length(len(raw), event_id)
        return raw

    def read_append(self, message: str) -> bytes | None:
        """The audio of an ``event`` whose last member is ``"audio"`` (``{"type": ..., "audio":
        "<base64>"}``, as the SDKs write an append), exactly as ``json.loads`` and ``decode``
        would give it; None for anything else (another event or shape, or audio ``decode`` would
        refuse), which the general path answers.  The base64 is never scanned as JSON."""
        end = len(message) - 2
        if not message.endswith('"}'):
            return None
        start = message.rfind('"', 0, end)  # opens the last string, if the event is that shape
        if start < 9:
            return None
        if message.startswith('"audio":', start - 8):
            key = start - 8
        elif message.startswith('"audio": ', start - 9):
            key = start - 9
        else:
            return None
        if key < 1 or message[key - 1] == "\\":  # an escaped quote: "audio" is inside some other string
            return None
        text = message[start + 1:end]
        if not text or len(text) > self.max_chars:
            return None
        head = message[:start]
        if (self.event, head) not in _APPEND_HEADS:
            # The event with its audio emptied: valid JSON only if "audio" is a key of the
            # outermost object (its last member), since the key's quote is a real one.
            data = json_object(head + '""}')
            if type(data) is not dict or data.get("type") != self.event or data.get("audio") != "":
                return None
            if len(head) <= _MAX_HEAD_CHARS:  # a longer one is parsed each time, never kept
                if len(_APPEND_HEADS) >= _MAX_HEADS:  # heads with an event id each never repeat
                    _APPEND_HEADS.clear()
                _APPEND_HEADS.add((self.event, head))
        try:
            raw = decode_strict(text)  # only base64 letters: the text is the same JSON string
        except ValueError:
            return None
        if len(raw) % self.sample_bytes:
            return None
        return raw

    def _lenient(self, audio: str, event_id: str | None) -> bytes | ProtocolError:
        """Base64 with line breaks (MIME style) is accepted; anything else is an error."""
        audio = audio.replace("\r", "").replace("\n", "")
        if len(audio) > self.max_chars:
            return self._too_long(len(audio), event_id)
        try:
            raw = decode_strict(audio)
        except ValueError:
            return ProtocolError("invalid_base64", "'audio' is not valid base64", event_id=event_id)
        if not raw:
            return self._bad_field("", event_id)
        if len(raw) % self.sample_bytes:
            return self._bad_length(len(raw), event_id)
        return raw

    def _bad_field(self, audio: object, event_id: str | None) -> ProtocolError:
        if audio is None:
            return ProtocolError("missing_required_parameter",
                                 f"{self.event} needs 'audio': base64-encoded audio", event_id=event_id)
        if not isinstance(audio, str):
            return ProtocolError("invalid_type", "'audio' must be a string of base64-encoded audio, "
                                 f"got {type(audio).__name__}", event_id=event_id)
        return ProtocolError("invalid_value", "'audio' is empty: it must hold at least one sample",
                             event_id=event_id)

    def _too_long(self, chars: int, event_id: str | None) -> ProtocolError:
        seconds = chars * 3 // 4 // self.sample_bytes / self.sample_rate
        return ProtocolError(
            "audio_too_long",
            f"'audio' holds about {seconds:.2f} s of {self.format_name}; at most "
            f"{self.max_seconds:g} s per {self.event} (audio.max_message_seconds): "
            "append it in smaller pieces",
            event_id=event_id,
        )

    def _bad_length(self, size: int, event_id: str | None) -> ProtocolError:
        return ProtocolError(
            "invalid_audio_length",
            f"'audio' decodes to {size} bytes, not a whole number of {self.sample_bytes}-byte "
            f"samples of {self.format_name}",
            event_id=event_id,
        )
