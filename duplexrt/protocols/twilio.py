"""Twilio Media Streams (``/twilio/media``): a phone call, bidirectional (``<Connect><Stream>``).

Every message is a JSON text message with an ``"event"`` field; audio is base64 G.711 mu-law at
8 kHz, mono, both ways (the session resamples it to and from the model's rate, as for ``g711_ulaw``
on the other routes).  Our own reading of Twilio's public "Media Streams - WebSocket Messages"
page; the route's behaviour, event by event:

From Twilio:

* ``connected`` (first, once): nothing to do.  The call is not started by it.
* ``start``: the call starts: its ``streamSid`` (``start.streamSid``, else the top-level one) is
  kept for every message the server sends.  A ``mediaFormat`` other than ``audio/x-mulaw`` at
  8000 Hz mono, a ``start`` without a stream SID, or a second ``start`` is fatal (close 1008).
  Its ``customParameters`` (TwiML ``<Parameter>``s): ``api_key`` when the server has
  ``server.api_key`` and the upgrade carried none (Twilio strips the query string and sends no
  header: the server upgrades this route without a key and hands it to ``require_key``); a
  ``start`` without the right key, or any event but one ``connected`` before it, is fatal (1008,
  ``unauthorized``), and so is no ``start`` within the first-message timeout
  (``first_messages``).  ``instructions`` and ``voice`` ask for the call's persona on a model
  that takes one, before any media (a refused one: fatal, ``invalid_persona``).
* ``media``: the caller's audio (``media.payload``, base64 mu-law) goes to the model.  Only the
  ``inbound`` track (or a message that names none) is the caller; any other track is ignored.
  A ``media`` before ``start`` is fatal (close 1008): there is no stream to answer.  A payload
  that is missing, not base64, or longer than ``audio.max_message_seconds``, a ``streamSid``
  other than the call's, and a ``sequenceNumber`` that is not above every one seen so far are
  dropped (that message only: the call goes on), logged once per kind per call and counted.
  Twilio numbers its messages 1, 2, 3, ...; a WebSocket keeps their order, so a number that goes
  back is a replay or a duplicate, never a late message worth waiting for: the server never holds
  audio back to reorder it.  A gap (a lost message) is accepted as is.
* ``mark``: Twilio's receipt for one of the server's marks (below): the audio sent before it has
  been played to the caller.  Twilio expects no answer; the server notes how far playback got
  (``played_frames``).
* ``dtmf``: ignored (no duplexrt model takes keypresses).
* ``stop``: the call is over: the end of input.  The model answers what it was given (its last
  ``media``), the server sends its last ``mark`` (below) and closes the WebSocket (1000); the
  session ends with reason ``stop``.  Anything after ``stop`` is not read (a second ``stop``
  included).  Twilio itself has stopped listening by then; a test client or a bridge hears the
  whole answer and knows it has.
* Any other event is ignored (logged once per name): Twilio may add events, and a call should not
  end for one this server does not know.  A message that is not a JSON object with a string
  ``event`` (binary, invalid JSON) is not Twilio's protocol at all: fatal (close 1003 / 1007).

From the server (only the three Twilio accepts; anything else would be warning 31951 on the call):

* ``media``: ``{"event": "media", "streamSid": SID, "media": {"payload": B64}}``, one per batch of
  model output (one 80 ms frame at real-time pace), silence included: a full-duplex model is
  heard continuously.
* ``mark``: ``{"event": "mark", "streamSid": SID, "mark": {"name": "duplexrt-N"}}`` after the
  ``media`` that brings the output to N model frames, about once a second of output
  (``mark_every_seconds``); Twilio sends it back once N frames have been played.  The session's
  last message is a mark named ``duplexrt-end:REASON;frames_in=I;frames_out=O`` (the finish
  reason: ``stop``, ``shutdown``, ``error``, ...; the model frames in and out): after it the
  server closes the connection.
* ``clear``: never.  A full-duplex model has no turns to cut: it hears the caller while it speaks
  and stops (or goes on) by itself, and its output reaches Twilio at the model's own pace, so
  Twilio's buffer holds only network jitter, never a reply that should be dropped on barge-in.
  No duplexrt session has a barge-in notion for such models (there is no ``ClearOutput`` for
  them), so there is nothing ``clear`` would follow.

Errors: Twilio's protocol has no error message from the server, so a non-fatal error (the dropped
messages above) is logged (the first of each kind in a call, at warning) and counted, never
sent; a fatal one ends the call: the last mark (``duplexrt-end:error``), then a Close with its
code (1003, 1007 or 1008) and ``code: message`` as the reason.  Twilio does not resume a stream: the
route has no resume token, and a dropped connection ends the session at once (its slot freed).
"""

from __future__ import annotations

import hmac
import json
import logging
from collections import Counter
from typing import Any

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends.base import PersonaError
from duplexrt.protocols.b64codec import decode_strict, encode
from duplexrt.protocols.base import Translator
from duplexrt.protocols.events import (Event, Ignored, InputEnd, AudioIn, ProtocolError, SessionEnd, json_object,
                                      quote)
from duplexrt.reasons import CloseCode
from duplexrt.wire.transport import Message

__all__ = ["END_MARK_PREFIX", "MARK_PREFIX", "TwilioTranslator"]

log = logging.getLogger("duplexrt.twilio")

_RATE = 8000
#: What the server's mark names start with; the rest is the output frames sent before it.
MARK_PREFIX = "duplexrt-"
#: The last mark's name starts with this; then the finish reason and the usage
#: (``duplexrt-end:stop;frames_in=15;frames_out=15``).
END_MARK_PREFIX = "duplexrt-end:"


def _fatal(code: str, message: str, close_code: int = CloseCode.POLICY_VIOLATION) -> ProtocolError:
    """An error that ends the call: its message, the Close frame's reason, starts with its code
    (Twilio's protocol has no error message to carry the code)."""
    return ProtocolError(code, f"{code}: {message}", close_code=close_code, fatal=True)


def _sequence(value: object) -> int | None:
    """A ``sequenceNumber`` (Twilio sends a string of digits; a number is taken too), or None."""
    if isinstance(value, str) and value.isdigit() and len(value) <= 18:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


class TwilioTranslator(Translator):
    """One call on a bidirectional Twilio Media Stream."""

    def __init__(self, *, model_rate: int = 24000, frame_seconds: float = 0.08,
                 max_message_seconds: float | None = None, mark_every_seconds: float = 1.0,
                 api_key: str = "") -> None:
        self.input_spec = self.output_spec = AudioSpec.create(AudioFormat.G711_ULAW, _RATE, model_rate=model_rate)
        #: The call's stream and call SIDs, from ``start``.
        self.stream_sid: str | None = None
        self.call_sid: str | None = None
        self.started = False
        self.stopped = False
        #: The highest ``sequenceNumber`` seen.
        self.last_sequence = 0
        #: Output frames sent, and played to the caller as far as Twilio's mark receipts say.
        self.frames_sent = 0
        self.played_frames = 0
        self.marks_sent = 0
        #: Messages dropped (non-fatal errors), by code; unknown events ignored, by name.
        self.dropped: Counter[str] = Counter()
        self.unknown: Counter[str] = Counter()
        self._mark_every = max(1, round(mark_every_seconds / frame_seconds))
        self._next_mark = self._mark_every
        self._max_chars = (4 * -(-int(max_message_seconds * _RATE) // 3)
                           if max_message_seconds is not None else None)
        self._max_seconds = max_message_seconds
        self._head = ""  # '{"event":"media","streamSid":"MZ...","media":{"payload":"'
        #: The key ``start.customParameters.api_key`` must carry ("": none needed; the server
        #: sets it when it has ``server.api_key`` and the upgrade carried no key).
        self._api_key = api_key
        self._messages = 0  # messages parsed: with a key to check, only ``connected`` may precede start
        #: With a key to check, ``connected`` and the ``start`` that carries it must both come within
        #: the first-message timeout (``server.first_message_timeout_s``).
        self.first_messages = 2 if api_key else 1
        self._mark_head = ""  # '{"event":"mark","streamSid":"MZ...","mark":{"name":"'

    # -- Twilio -> server --------------------------------------------------------------------------

    def parse(self, message: Message) -> Event:
        if not isinstance(message, str):
            return _fatal("binary_not_supported", "Twilio Media Streams messages are JSON text; "
                          "audio goes base64 in media.payload", CloseCode.UNSUPPORTED_DATA)
        data = json_object(message)
        if isinstance(data, ProtocolError):
            return _fatal(data.code, data.message, CloseCode.INVALID_PAYLOAD)
        kind = data.get("event")
        if type(kind) is not str:
            return _fatal("invalid_event", 'Twilio messages are JSON objects with a string "event"',
                          CloseCode.INVALID_PAYLOAD)
        self._messages += 1
        if self._api_key and not self.started and kind != "start" and (kind != "connected" or self._messages > 1):
            return _fatal("unauthorized", f"{quote(kind[:64])} before start: this server needs its API key in "
                                          "start.customParameters.api_key, in start, right after connected")
        sequence = _sequence(data.get("sequenceNumber"))
        if kind == "media":
            return self._media(data, sequence)
        if sequence is not None and sequence > self.last_sequence:
            self.last_sequence = sequence
        if kind == "start":
            return self._start(data)
        if kind == "stop":
            if self.stopped:
                return Ignored()
            self.stopped = True
            return InputEnd()
        if kind == "mark":
            self._mark(data)
            return Ignored()
        if kind in ("connected", "dtmf"):
            return Ignored()
        name = kind[:64]
        if not self.unknown[name]:
            log.info("twilio stream %s: ignoring unknown event %s", self.stream_sid, quote(kind))
        self.unknown[name] += 1
        return Ignored()

    def _start(self, data: dict[str, Any]) -> Event:
        if self.started:
            return _fatal("start_repeated", "a second start: one Media Stream per WebSocket connection")
        start = data.get("start")
        if type(start) is not dict:
            return _fatal("invalid_start", "start needs a 'start' object")
        sid = start.get("streamSid", data.get("streamSid"))
        if not isinstance(sid, str) or not sid or len(sid) > 128:
            return _fatal("invalid_start", f"start needs a streamSid (a string of at most 128 characters), "
                                           f"got {quote(sid)}")
        media_format = start.get("mediaFormat")
        if media_format is not None:
            if type(media_format) is not dict or (
                    media_format.get("encoding", "audio/x-mulaw") != "audio/x-mulaw"
                    or media_format.get("sampleRate", _RATE) != _RATE or media_format.get("channels", 1) != 1):
                return _fatal("unsupported_format", "this route takes audio/x-mulaw at 8000 Hz, one channel; "
                                                    f"start.mediaFormat was {quote(media_format)}")
        custom = start.get("customParameters")
        custom = custom if type(custom) is dict else {}
        if self._api_key:
            offered = custom.get("api_key")
            if not isinstance(offered, str) or not hmac.compare_digest(offered.encode(), self._api_key.encode()):
                return _fatal("unauthorized", "a valid API key is required in start.customParameters.api_key "
                                              '(TwiML: <Parameter name="api_key" value="KEY"/>)')
        if (refused := self._ask_persona(custom)) is not None:
            return refused
        call_sid = start.get("callSid")
        self.call_sid = call_sid[:128] if isinstance(call_sid, str) else None
        self.stream_sid = sid
        self.started = True
        self._head = '{"event":"media","streamSid":' + json.dumps(sid) + ',"media":{"payload":"'
        self._mark_head = '{"event":"mark","streamSid":' + json.dumps(sid) + ',"mark":{"name":"' + MARK_PREFIX
        return Ignored()

    def require_key(self, api_key: str) -> None:
        """The call's ``start`` must carry ``api_key`` in ``customParameters.api_key`` (the server
        has ``server.api_key`` and the upgrade carried none: Twilio sends no header, no query)."""
        self._api_key = api_key
        self.first_messages = 2 if api_key else 1

    def _ask_persona(self, custom: dict[str, Any]) -> ProtocolError | None:
        """``customParameters`` ``instructions`` and ``voice``: the call's persona, on a model that
        takes one (asked at start, before any media: the session fixes it at the first frame);
        accepted and unused otherwise, as the other routes do."""
        text, voice = custom.get("instructions"), custom.get("voice")
        text = text if isinstance(text, str) else None
        voice = voice if isinstance(voice, str) else None
        if not self.persona.taken or (text is None and voice is None):
            return None
        try:
            self.persona.ask(text, voice)
        except PersonaError as exc:
            return _fatal("invalid_persona", str(exc)[:500])
        return None

    def _media(self, data: dict[str, Any], sequence: int | None) -> Event:
        if not self.started:
            return _fatal("media_before_start", "media before start: a Media Stream starts with start")
        if self.stopped:
            return Ignored()
        if sequence is not None:
            if sequence <= self.last_sequence:
                return self._drop("out_of_order", f"sequenceNumber {sequence} after {self.last_sequence}: "
                                                  "a replayed or duplicate media message, dropped")
            self.last_sequence = sequence
        elif "sequenceNumber" in data:
            return self._drop("invalid_sequence", "sequenceNumber must be a string of digits, got "
                                                  f"{quote(data['sequenceNumber'])}")
        sid = data.get("streamSid")
        if sid is not None and sid != self.stream_sid:
            return self._drop("wrong_stream", f"media for stream {quote(sid)}, not this call's {self.stream_sid}")
        media = data.get("media")
        if type(media) is not dict:
            return self._drop("invalid_media", "media needs a 'media' object")
        track = media.get("track")
        if track is not None and track != "inbound":
            return Ignored()  # another track (a unidirectional stream's outbound): not the caller
        payload = media.get("payload")
        if not isinstance(payload, str) or not payload:
            return self._drop("invalid_media", f"media.payload must be non-empty base64, got {quote(payload)}")
        if self._max_chars is not None and len(payload) > self._max_chars:
            return self._drop("audio_too_long", f"media.payload holds about {len(payload) * 3 // 4 / _RATE:.2f} s; "
                                                f"at most {self._max_seconds:g} s per message "
                                                "(audio.max_message_seconds)")
        try:
            raw = decode_strict(payload)
        except ValueError:
            return self._drop("invalid_base64", "media.payload is not valid base64")
        return AudioIn(raw)

    def _mark(self, data: dict[str, Any]) -> None:
        mark = data.get("mark")
        name = mark.get("name") if type(mark) is dict else None
        if isinstance(name, str) and name.startswith(MARK_PREFIX):
            frames = name[len(MARK_PREFIX):]
            if frames.isdigit() and len(frames) <= 18 and int(frames) <= self.frames_sent:
                self.played_frames = max(self.played_frames, int(frames))

    def _drop(self, code: str, message: str) -> ProtocolError:
        return ProtocolError(code, message)

    # -- server -> Twilio --------------------------------------------------------------------------

    @property
    def buffered_frames(self) -> int:
        """Output frames sent that Twilio has not yet said were played (as of its last mark)."""
        return self.frames_sent - self.played_frames

    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        if not self.started or not payload:
            return []
        # By hand: base64 needs no escaping, so the per-frame path skips json.dumps.
        messages: list[Message] = [self._head + encode(payload) + '"}}']
        self.frames_sent += frames
        if self.frames_sent >= self._next_mark:
            self._next_mark = self.frames_sent + self._mark_every
            self.marks_sent += 1
            messages.append(self._mark_head + str(self.frames_sent) + '"}}')
        return messages

    def error(self, error: ProtocolError) -> list[Message]:
        # Twilio takes media, mark and clear only: an error is logged (and a fatal one is the close
        # reason), never sent.
        if not error.fatal:
            if not self.dropped[error.code]:
                log.warning("twilio stream %s: dropped a message (%s: %s); the call goes on, later ones "
                            "of this kind are counted", self.stream_sid, error.code, error.message)
            self.dropped[error.code] += 1
        return []

    def end(self, end: SessionEnd) -> list[Message]:
        if self.dropped or self.unknown:
            log.info("twilio stream %s (call %s) ended %s: messages dropped %s, unknown events ignored %s",
                     self.stream_sid, self.call_sid, end.reason, dict(self.dropped), dict(self.unknown))
        if not self.started:
            return []  # no stream to say anything on
        # Twilio has no end message: a last mark, then the server closes the WebSocket.
        name = f"{END_MARK_PREFIX}{end.reason};frames_in={end.frames_in};frames_out={end.frames_out}"
        return [self._mark_head[:-len(MARK_PREFIX)] + name + '"}}']
