"""Kyutai's Moshi protocol (``/api/chat``), so Moshi's and Hibiki's own clients can talk to duplexrt.

Every message is binary; its first byte is the kind and the rest its payload:

====  ==========  =====================================================================
kind  name        payload
====  ==========  =====================================================================
0     handshake   server → client, first: protocol version and model version (u32 LE)
1     audio       Ogg Opus pages, 24 kHz mono, the stream cut anywhere (both ways)
2     text        UTF-8 model text (server → client)
3     control     one byte: 0 start, 1 endTurn, 2 pause, 3 restart
4     metadata    UTF-8 JSON
5     error       UTF-8 error description
6     ping        no payload; "currently unused"
====  ==========  =====================================================================

What Kyutai's code does (kyutai-labs/moshi: ``rust/protocol.md``, ``moshi/moshi/server.py``,
``moshi/moshi/client.py``, ``rust/moshi-backend/src/stream_both.rs``,
``rust/moshi-server/src/lm.rs``, ``rust/moshi-cli/src/multistream.rs``, the web client's
``client/src/protocol/encoder.ts`` and ``pages/Conversation/hooks/use*.ts``; and
kyutai-labs/hibiki-zero's ``state.py`` and web page), and what this translator does about it:

* Handshake.  The Python servers (moshi, moshi_mlx, hibiki-zero) send a bare ``b"\\x00"``; both
  Rust servers send ``b"\\x00"`` and eight zero bytes (protocol version 0 and model version 0, as
  ``protocol.md`` documents).  Every client reads only the first byte: the web client marks the
  socket connected on kind 0 whatever follows, moshi-cli and the Python client skip it.  We send the
  documented nine-byte form.
* Control codes are start, endTurn, pause and restart, "not used in full streaming mode": every
  Kyutai server ignores them, and none means "no more input" (endTurn is the end of a speaking
  turn, not of the stream).  So the protocol has no end of input: a session ends when the client
  hangs up, and nothing can reach it after.  endTurn is the one place a client can say its speech
  is over and still hear the rest: it ends the turn (``EndTurn``), which feeds a translation
  model's end-of-input flush (Hibiki's) and is a no-op for any other model; the other control
  codes are ignored.
* Ping (6) is answered by no Kyutai server; we ignore it too.  So are client handshake, text,
  metadata and error messages, and kinds we do not know (``protocol.md``: "messages with an unknown
  message type should be discarded").  An audio message with no payload is ignored as well (Kyutai's
  gradio client sends ``b"\\x01"`` whenever its Opus writer returned nothing).
* Metadata.  The Rust backend sends a metadata message of its own settings with every session, and
  every client tolerates metadata it does not understand: the web client parses the JSON, fails to
  match it against its server-info schema, logs that and moves on; the Python client and moshi-cli
  log "unknown"/"unsupported" and move on.  So we may send the optional ``metadata`` given to the
  constructor after the handshake, and a ``{"type": "session.end", ...}`` metadata message last.
  The web client parses every kind-4 payload with ``JSON.parse``, so it must be strict JSON (no NaN).
  The web client's decoder throws on kinds above 7 (we never send any).
* The caller's words (a server with ``[transcriber]``).  The protocol has no message for them,
  and both web clients are strict about kinds: their decoders (Kyutai's
  ``client/src/protocol/encoder.ts`` ``decodeMessage``, ``default: throw new Error("Unknown
  message type")``, line 92 at kyutai-labs/moshi e6a55d2; NVIDIA's copy of it, line 84 at
  NVIDIA/personaplex 3428dfd) throw on any kind they do not know, and run in each message
  listener with no ``try`` (``useSocket.ts``, ``useServerText.ts``, ``useServerAudio.ts``,
  ``useServerInfo.ts``), so a new kind would raise an uncaught error in four listeners for every
  piece.  A metadata message does not throw, but each one that does not match their server-info
  schema is logged with ``console.error`` (``useServerInfo.ts`` ``parseInfo``).  So the caller's
  words are opt-in: a client that adds ``?input_text=1`` to the URL gets each piece as a
  metadata message ``{"type": "input_text", "text", "frame", "audio_ms"}`` (the fields of
  ``/v1/duplex``'s ``input_text``), a kind every Moshi client already parses; without it
  (Kyutai's and NVIDIA's clients as published) nothing changes.
* Persona (NVIDIA's PersonaPlex, a Moshi-architecture model whose role prompt and voice are set per
  call).  NVIDIA's server (``NVIDIA/personaplex``: ``moshi/moshi/server.py``) and web client
  (``client/src/pages/Conversation/Conversation.tsx``) put it in the URL: ``text_prompt`` and
  ``voice_prompt`` (a file name, ``NATF2.pt``), beside sampling values, seeds, ``worker_auth_id``
  and ``email``.  For a model that takes a persona the two are its persona, as sent
  (``protocols/options.py``, ``moshi_persona``), checked when the connection is admitted (a refusal
  is a 400 naming the reason, as for any bad option) and set when the session starts; every other
  parameter is accepted and ignored, so that client works unmodified.  NVIDIA's server sends the
  handshake only once the prompts have run, and its client sends no audio before the handshake: so
  for such a model the handshake (and the metadata after it) waits until the model has taken the
  persona (``persona_ready``), and the caller's first words are not queued behind the prompt.  For
  a model that takes none, the parameters are ignored and the handshake goes at once, as before.
* Errors go as kind 5 with the message.  Kyutai's servers skip text (``str``) WebSocket messages
  and empty ones silently; we are stricter: a text message is a fatal ``text_not_supported``
  (close code 1003), an empty one gets an ``empty_message`` error and the session goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.protocols.base import NO_QUERY, Translator
from duplexrt.protocols.events import AudioIn, EndTurn, Event, Ignored, ProtocolError, SessionEnd
from duplexrt.protocols.options import wants_input_text
from duplexrt.reasons import CloseCode
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.wire.transport import Message

__all__ = [
    "AUDIO", "CONTROL", "CONTROL_CODES", "ERROR", "HANDSHAKE", "HANDSHAKE_MESSAGE", "METADATA",
    "MoshiTranslator", "PING", "SAMPLE_RATE", "TEXT",
]

#: Message kinds (the first byte of every message).
HANDSHAKE = 0
AUDIO = 1
TEXT = 2
CONTROL = 3
METADATA = 4
ERROR = 5
PING = 6

#: The payload byte of a control message, as Kyutai's clients name them.
CONTROL_CODES = {"start": 0, "end_turn": 1, "pause": 2, "restart": 3}

#: The Opus stream's rate, both ways: the protocol has no way to choose another.
SAMPLE_RATE = 24000

#: Kind 0, protocol version 0 (u32 LE), model version 0 (u32 LE): what Kyutai's Rust servers send.
HANDSHAKE_MESSAGE = bytes(9)

_AUDIO_PREFIX = b"\x01"
_TEXT_PREFIX = b"\x02"
_METADATA_PREFIX = b"\x04"
_ERROR_PREFIX = b"\x05"

_IGNORED = Ignored()
_END_TURN_MESSAGE = bytes([CONTROL, CONTROL_CODES["end_turn"]])
_END_TURN = EndTurn(())
_TEXT_NOT_SUPPORTED = ProtocolError(
    "text_not_supported",
    "the Moshi protocol only has binary messages (a kind byte, then the payload)",
    close_code=CloseCode.UNSUPPORTED_DATA,
    fatal=True,
)
_EMPTY_MESSAGE = ProtocolError("empty_message", "empty message: every message starts with its kind byte")


def _metadata(data: Mapping[str, Any]) -> bytes:
    """A kind-4 message: compact, strict JSON (the web client runs ``JSON.parse`` on it)."""
    return _METADATA_PREFIX + json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


class MoshiTranslator(Translator):
    """Kyutai's binary Moshi protocol: Ogg Opus at 24 kHz both ways, model text as kind 2.

    ``metadata`` (a JSON object: model name, slots, ...) is sent as a kind-4 message right after the
    handshake; it must serialise to strict JSON, which is checked here, not mid-session.
    """

    persona_at_start = True  # it comes in the URL

    def __init__(self, *, model_rate: int = 24000, metadata: Mapping[str, Any] | None = None) -> None:
        spec = AudioSpec.create(AudioFormat.OPUS, SAMPLE_RATE, model_rate=model_rate)
        self.input_spec = spec
        self.output_spec = spec
        self._start: list[Message] = [HANDSHAKE_MESSAGE]
        if metadata is not None:
            if not isinstance(metadata, Mapping):
                raise TypeError(f"metadata must be a mapping (a JSON object), got {type(metadata).__name__}")
            self._start.append(_metadata(dict(metadata)))
        #: The handshake, held until the model has taken the session's persona.
        self._held: list[Message] = []
        #: The client asked for the caller's words (``?input_text=1``) and the server has a
        #: transcriber (``offer_transcripts``).
        self._input_text = False

    def start(self) -> list[Message]:
        if self.resume_token is None:
            messages = list(self._start)
        else:
            # The token rides in the handshake's metadata (kind 4), which clients already read.
            metadata = json.loads(self._start[1][1:]) if len(self._start) > 1 else {}
            messages = [HANDSHAKE_MESSAGE, _metadata({**metadata, "resume_token": self.resume_token})]
        if self.persona.taken:
            self._held = messages  # the handshake says the prompt has run: ``persona_ready``
            return []
        return messages

    def persona_ready(self) -> list[Message]:
        messages, self._held = self._held, []
        return messages

    def resumed(self, token: str, received: int) -> list[Message]:
        """A new connection starts with a handshake, as any Moshi connection does; the metadata
        after it carries the next token and how many client messages the session took."""
        self._held = []  # a handshake goes now: one held for the persona would be a second
        return [HANDSHAKE_MESSAGE, _metadata({"resumed": True, "resume_token": token, "received": received})]

    def parse(self, message: Message) -> Event:
        if isinstance(message, str):
            return _TEXT_NOT_SUPPORTED
        if not message:
            return _EMPTY_MESSAGE
        if message[0] == AUDIO and len(message) > 1:
            return AudioIn(message[1:])
        if message == _END_TURN_MESSAGE:
            return _END_TURN
        # Everything else is ignored: an empty audio message, the kinds a client has no business
        # sending (handshake, text, metadata, error), the other control codes and ping (unused in
        # full streaming mode, and answered by no Kyutai server), and kinds we do not know.
        return _IGNORED

    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        return [_AUDIO_PREFIX + payload] if payload else []

    def text_out(self, text: str) -> list[Message]:
        return [_TEXT_PREFIX + text.encode("utf-8", "replace")]

    def offer_transcripts(self, model: str, delay_ms: float, *, query: Mapping[str, str] = NO_QUERY) -> None:
        self._input_text = wants_input_text(query)

    def input_text(self, pieces: Sequence[TranscriptPiece]) -> list[Message]:
        """Each piece with text as a metadata message, only for a client that asked (see the
        module's docstring: an unasked message would log an error in Kyutai's web client)."""
        if not self._input_text:
            return []
        return [_metadata({"type": "input_text", "text": piece.text, "frame": piece.frame,
                           "audio_ms": piece.audio_ms}) for piece in pieces if piece.text]

    def error(self, error: ProtocolError) -> list[Message]:
        return [_ERROR_PREFIX + error.message.encode("utf-8", "replace")]

    def end(self, end: SessionEnd) -> list[Message]:
        body: dict[str, Any] = {
            "type": "session.end",
            "reason": end.reason,
            "usage": {
                "frames_in": end.frames_in,
                "frames_out": end.frames_out,
                "seconds_in": end.seconds_in,
                "seconds_out": end.seconds_out,
            },
        }
        if end.error is not None:
            body["error"] = end.error
        return [_metadata(body)]
