"""The client side of each route's protocol, sans-IO: messages to send, and what a message received means.

One class per route.  Each builds the messages that carry audio already in its wire format
(``audio``), the messages that say the input is over (``end_input``) or that the client has heard
enough (``finish``), and turns every message received into audio or an event (``parse``).  None of
them touches a socket or a clock, so ``duplexrt client``, ``duplexrt simulate --url`` and the
in-process simulation share them, and they are tested with plain calls.

``parse`` returns audio as the buffer itself (bytes, or a memoryview of the message), with no
wrapper object: audio is nearly every message, and the load generator should cost next to nothing.
Anything else comes back as one of the events below.

How a conversation ends differs by route:

* ``/v1/duplex`` (raw): the client sends ``input.end``; the server answers the rest, sends
  ``session.end`` with usage, and closes.
* ``/v1/realtime`` in turn mode: the client appends everything, commits and asks for a response;
  the server sends the response's audio and ``response.done``; the client closes.  What the model
  said before ``response.create`` is held by duplexrt's server and sent as the response's first
  deltas (a server that drops it instead gives only the rest).
* ``/v1/realtime?duplex=1``: one open-ended response carries every output frame.  The protocol has
  no end of input, so the client counts what it has heard; once it has caught up with what it
  sent, it cancels the response (``response.cancel``), reads ``response.done`` (with usage) and
  closes.
* ``/api/chat`` (Moshi): no end of input either, and no goodbye: once the client has heard as much
  as it sent, it hangs up.
* ``/v1/live/sessions`` (Live): the client speaks first (``session.start``) and waits for
  ``session.started``; at the end it sends ``session.close``, the server answers the rest, sends
  ``session.closed`` with usage, and closes.
* ``/twilio/media`` (Twilio Media Streams): the client sends ``connected`` and ``start``, then its
  audio, then ``stop``; the server answers the rest, sends its last mark ``duplexrt-end:REASON``
  and closes.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import attrs

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
from duplexrt.protocols import b64codec
from duplexrt.protocols import moshi as moshi_wire
from duplexrt.protocols.options import duplex_specs, wants_duplex
from duplexrt.reasons import FinishReason
from duplexrt.routes import CLIENT_ROUTES
from duplexrt.wire.transport import Message

__all__ = [
    "AUDIO_TYPES", "ROUTES", "ClientProtocol", "DuplexClient", "Ended", "MoshiClient", "Opened",
    "LiveClient", "Other", "RealtimeClient", "ServerError", "Text", "TwilioClient", "UnknownRoute", "client_for_url",
    "route_of",
]

Buffer = bytes | bytearray | memoryview

#: What ``parse`` returns for audio.
AUDIO_TYPES = (bytes, bytearray, memoryview)

#: Route path -> protocol name.  A path that ends with one of these (behind a proxy prefix) counts.
ROUTES: dict[str, str] = CLIENT_ROUTES

#: The model clock the client assumes for padding input to whole frames on routes that have no
#: end of input (80 ms at 24 kHz, duplexrt's default and Moshi's).
DEFAULT_FRAME_SECONDS = 0.08


# -- events ----------------------------------------------------------------------------------------


@attrs.frozen
class Opened:
    """The server's greeting (``session.created``, the Moshi handshake)."""

    info: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Ended:
    """The server's account of the end: its finish reason (``stop`` when all went well) and usage.
    ``frames_out`` counts model frames of audio; None where the server did not say."""

    reason: str
    frames_in: int | None = None
    frames_out: int | None = None
    error: str | None = None
    info: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class ServerError:
    """An error event from the server (the session may go on, or end right after)."""

    code: str | None
    message: str

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"


@attrs.frozen
class Text:
    """Model text."""

    text: str


@attrs.frozen
class Other:
    """Anything else the protocol allows (an acknowledgement, metadata, a pong)."""

    kind: str
    info: Any = None


Event = Opened | Ended | ServerError | Text | Other


class UnknownRoute(ValueError):
    """The URL's path is none of the routes a client knows how to speak."""


# -- the contract ----------------------------------------------------------------------------------


class ClientProtocol(abc.ABC):
    """One conversation's client-side protocol state."""

    #: The route's protocol: ``duplex``, ``realtime``, ``moshi``, ``live`` or ``twilio``.
    name: str
    #: What this client sends, and what it expects back (which ``Opened`` may update).
    input_spec: AudioSpec
    output_spec: AudioSpec
    #: The server speaks first: wait for its greeting before sending.
    greets: bool = True
    #: The conversation ends only once the client has heard as much output as it sent input
    #: (``finish`` then says what to send); otherwise the server ends it after ``end_input``.
    needs_catch_up: bool = False
    #: After ``Ended``, the server closes the connection; otherwise the client does.
    server_closes: bool = True
    #: Input is padded to whole model frames before sending (routes with no end of input never
    #: flush a partial frame, so its output would never come).
    pads_input: bool = False

    def url(self, url: str) -> str:
        """``url`` with whatever query the route needs to speak this protocol's formats."""
        return url

    def hello(self) -> list[Message]:
        """Messages the client sends first, before waiting for the greeting (Live's
        ``session.start``)."""
        return []

    def opened(self, event: Opened) -> None:
        """The server's greeting arrived (it may say what the output format is)."""

    def audio(self, payload: Buffer) -> Message:
        """The message carrying ``payload``, audio already in ``input_spec``."""
        return payload  # type: ignore[return-value]  # sent as is: every transport sends a bytes-like as binary

    def end_input(self) -> list[Message]:
        """Messages that say there is no more audio."""
        return []

    def finish(self) -> list[Message]:
        """Messages to send once all output has been heard (``needs_catch_up`` protocols)."""
        return []

    @abc.abstractmethod
    def parse(self, message: Message) -> Buffer | Event:
        """One message from the server: audio (a buffer, in ``output_spec``) or an event."""


def _append_event(kind: str, payload: Buffer) -> str:
    """A JSON append event carrying base64 audio, formatted by hand: base64 needs no escaping,
    and json.dumps would scan every byte again (the load generator sends one per frame)."""
    return '{"type":"' + kind + '","audio":"' + b64codec.encode(payload) + '"}'


def _delta_audio(kind: str, data: dict) -> bytes | ServerError:
    """The audio of a JSON delta event (Realtime, Live), or the error its bad base64 is."""
    delta = data.get("delta")
    try:
        return b64codec.decode(delta) if isinstance(delta, str) else b""
    except ValueError:
        return ServerError("invalid_base64", f"{kind} carried audio that is not base64")


def _json_object(message: str) -> dict[str, Any] | None:
    try:
        data = json.loads(message)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def _json_event(message: Message) -> dict[str, Any] | Other:
    """A JSON route's server event as an object, or what else it was (``Other``)."""
    if not isinstance(message, str):
        return Other("binary", message)
    data = _json_object(message)
    return Other("invalid", message) if data is None else data


def _object_field(data: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``data[key]`` where it is a JSON object, else an empty one: a server's event read as far
    as it goes, never a crash on a field of the wrong shape."""
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _name_lookup(table: Mapping[str, str], key: object) -> str | None:
    """``table.get(key)`` for a string key, None for any other value (a list is not even
    hashable)."""
    return table.get(key) if isinstance(key, str) else None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _with_query(url: str, updates: Mapping[str, str]) -> str:
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query.update(updates)
    return urlunsplit(parts._replace(query=urlencode(query)))


# -- /v1/duplex --------------------------------------------------------------------------------------


class DuplexClient(ClientProtocol):
    """Raw PCM (or G.711) both ways, JSON control: ``input.end`` in, ``session.end`` back.

    The in-process simulation speaks it too, over an in-memory transport to a session whose raw
    translator does not greet (``greets=False``) and may carry any format, Opus included."""

    name = "duplex"

    def __init__(self, input_spec: AudioSpec, output_spec: AudioSpec | None = None, *,
                 greets: bool = True) -> None:
        self.input_spec = input_spec
        self.output_spec = output_spec or input_spec
        self.greets = greets
        self._end = json.dumps({"type": "input.end"})

    def url(self, url: str) -> str:
        updates = {"format": self.input_spec.format.value, "rate": str(self.input_spec.sample_rate)}
        if self.output_spec != self.input_spec:
            updates["output_format"] = self.output_spec.format.value
            updates["output_rate"] = str(self.output_spec.sample_rate)
        return _with_query(url, updates)

    def opened(self, event: Opened) -> None:
        output = event.info.get("output")
        if isinstance(output, dict):
            try:
                self.output_spec = AudioSpec(output["format"], output["sample_rate"])
            except (KeyError, TypeError, AudioFormatError):
                pass  # keep what was asked for

    def end_input(self) -> list[Message]:
        return [self._end]

    def parse(self, message: Message) -> Buffer | Event:
        if not isinstance(message, str):
            return message
        data = _json_object(message)
        if data is None:
            return Other("invalid", message)
        kind = data.get("type")
        if kind == "session.end":
            usage = _object_field(data, "usage")
            return Ended(str(data.get("reason")), _int_or_none(usage.get("frames_in")),
                         _int_or_none(usage.get("frames_out")), data.get("error"), data)
        if kind == "error":
            return ServerError(data.get("code"), str(data.get("message")))
        if kind == "session.created":
            return Opened(data)
        if kind == "text":
            return Text(str(data.get("text", "")))
        return Other(str(kind), data)


# -- /v1/realtime ------------------------------------------------------------------------------------


_REALTIME_RATE = 24000
_AUDIO_DELTAS = ("response.output_audio.delta", "response.audio.delta")
_TEXT_DELTAS = ("response.output_audio_transcript.delta", "response.audio_transcript.delta")
#: response.done status (and status_details.reason) -> the finish reason, as the other routes say it.
#: ``cancelled`` is the client's own word: the Realtime status does not say how the client left.
_STATUS_REASONS: dict[str, str] = {"completed": FinishReason.STOP, "failed": FinishReason.ERROR}
_DETAIL_REASONS: dict[str, str] = {"server_shutdown": FinishReason.SHUTDOWN, "max_output_tokens": FinishReason.LENGTH,
                                   "client_cancelled": "cancelled"}


class RealtimeClient(ClientProtocol):
    """The OpenAI Realtime protocol, pcm16 at 24 kHz (the protocol's default format) both ways."""

    name = "realtime"
    server_closes = False
    pads_input = True

    def __init__(self, *, duplex: bool = False, model_rate: int = 24000) -> None:
        self.duplex = duplex
        self.needs_catch_up = duplex
        self.input_spec = AudioSpec.create(AudioFormat.PCM_S16LE, _REALTIME_RATE, model_rate=model_rate)
        self.output_spec = self.input_spec
        self._cancelled = False
        self._appended = False

    def url(self, url: str) -> str:
        # continuous: every output frame is sent, silence too, so the client can count them.
        return _with_query(url, {"duplex": "1", "continuous": "1"}) if self.duplex else url

    def audio(self, payload: Buffer) -> Message:
        self._appended = True
        return _append_event("input_audio_buffer.append", payload)

    def end_input(self) -> list[Message]:
        if self.duplex or not self._appended:
            return []
        return [json.dumps({"type": "input_audio_buffer.commit"}), json.dumps({"type": "response.create"})]

    def finish(self) -> list[Message]:
        if not self.duplex:
            return []
        self._cancelled = True
        return [json.dumps({"type": "response.cancel"})]

    def parse(self, message: Message) -> Buffer | Event:
        data = _json_event(message)
        if isinstance(data, Other):
            return data
        kind = data.get("type")
        if kind in _AUDIO_DELTAS:
            return _delta_audio(kind, data)
        if kind == "response.done":
            return self._ended(data)
        if kind == "error":
            error = _object_field(data, "error")
            return ServerError(error.get("code"), str(error.get("message")))
        if kind in _TEXT_DELTAS:
            return Text(str(data.get("delta", "")))
        if kind == "session.created":
            return Opened(data)
        return Other(str(kind), data)

    def _ended(self, data: dict[str, Any]) -> Ended:
        response = _object_field(data, "response")
        status = response.get("status")
        details = _object_field(response, "status_details")
        reason: str
        if status == "cancelled" and self._cancelled:
            reason = FinishReason.STOP  # the client asked for it: it had heard everything
        else:
            reason = (_name_lookup(_STATUS_REASONS, status) or _name_lookup(_DETAIL_REASONS, details.get("reason"))
                      or str(status))
        error = details.get("error") if isinstance(details.get("error"), dict) else None
        usage = _object_field(response, "usage")
        out_details = _object_field(usage, "output_token_details")
        frames_out = _int_or_none(out_details.get("audio_tokens"))
        if frames_out is None:
            frames_out = _int_or_none(usage.get("output_tokens"))
        return Ended(reason, _int_or_none(usage.get("input_tokens")), frames_out,
                     error.get("message") if error else None, data)


# -- /api/chat -----------------------------------------------------------------------------------------


_MOSHI_RATE = 24000


class MoshiClient(ClientProtocol):
    """Kyutai's Moshi protocol: binary messages, a kind byte first; Ogg Opus at 24 kHz both ways."""

    name = "moshi"
    needs_catch_up = True
    pads_input = True

    def __init__(self) -> None:
        self.input_spec = AudioSpec(AudioFormat.OPUS, _MOSHI_RATE)
        self.output_spec = self.input_spec

    def audio(self, payload: Buffer) -> Message:
        return bytes((moshi_wire.AUDIO,)) + payload

    def parse(self, message: Message) -> Buffer | Event:
        if isinstance(message, str) or not message:
            return Other("invalid", message)
        kind = message[0]
        if kind == 1:
            return message[1:]
        if kind == 0:
            return Opened({"handshake": bytes(message[1:]).hex()})
        if kind == 2:
            return Text(bytes(message[1:]).decode("utf-8", "replace"))
        if kind == 5:
            return ServerError("error", bytes(message[1:]).decode("utf-8", "replace"))
        if kind == 4:
            data = _json_object(bytes(message[1:]).decode("utf-8", "replace"))
            if data is not None and data.get("type") == "session.end":
                usage = _object_field(data, "usage")
                return Ended(str(data.get("reason")), _int_or_none(usage.get("frames_in")),
                             _int_or_none(usage.get("frames_out")), data.get("error"), data)
            return Other("metadata", data)
        return Other(f"kind {kind}", message)


# -- /v1/live/sessions ----------------------------------------------------------------------------------


_LIVE_FORMATS = {AudioFormat.PCM_S16LE: "audio/pcm", AudioFormat.G711_ULAW: "audio/pcmu",
                 AudioFormat.G711_ALAW: "audio/pcma"}
#: session.closed reason -> the finish reason, as the other routes say it (when the server does
#: not send duplexrt's own ``finish_reason``).
_LIVE_REASONS: dict[str, str] = {"close_requested": FinishReason.STOP, "expired": FinishReason.LENGTH,
                                  "remote_hangup": FinishReason.SHUTDOWN, "connection_lost": FinishReason.ERROR}


class LiveClient(ClientProtocol):
    """OpenAI's full-duplex Live protocol: ``session.start`` first, base64 audio in JSON both ways,
    ``session.close`` at the end.  pcm16 at 24 kHz by default, or G.711 at 8 kHz."""

    name = "live"

    def __init__(self, input_format: AudioFormat = AudioFormat.PCM_S16LE, *, model_rate: int = 24000,
                 model: str = "duplexrt") -> None:
        if input_format not in _LIVE_FORMATS:
            raise AudioFormatError(f"/v1/live/sessions takes pcm_s16le, g711_ulaw or g711_alaw, "
                                   f"not {input_format.value}")
        rate = _REALTIME_RATE if input_format is AudioFormat.PCM_S16LE else 8000
        self.input_spec = AudioSpec.create(input_format, rate, model_rate=model_rate)
        self.output_spec = self.input_spec
        self.model = model

    def hello(self) -> list[Message]:
        audio = {"format": {"type": _LIVE_FORMATS[self.input_spec.format], "rate": self.input_spec.sample_rate}}
        return [json.dumps({"type": "session.start", "session": {"model": self.model, "audio": audio}})]

    def audio(self, payload: Buffer) -> Message:
        return _append_event("session.input_audio.append", payload)

    def end_input(self) -> list[Message]:
        return [json.dumps({"type": "session.close"})]

    def parse(self, message: Message) -> Buffer | Event:
        data = _json_event(message)
        if isinstance(data, Other):
            return data
        kind = data.get("type")
        if kind == "session.output_audio.delta":
            return _delta_audio(kind, data)
        if kind == "session.output_transcript.delta":
            return Text(str(data.get("delta", "")))
        if kind == "session.closed":
            usage = _object_field(data, "usage")
            reason = data.get("finish_reason")
            if not isinstance(reason, str):
                reason = _name_lookup(_LIVE_REASONS, data.get("reason")) or str(data.get("reason"))
            return Ended(reason, _int_or_none(usage.get("frames_in")), _int_or_none(usage.get("frames_out")),
                         None, data)
        if kind == "error":
            error = _object_field(data, "error")
            return ServerError(error.get("code"), str(error.get("message")))
        if kind == "session.started":
            return Opened(data)
        return Other(str(kind), data)


# -- /twilio/media --------------------------------------------------------------------------------------


_TWILIO_RATE = 8000
_TWILIO_END_MARK = "duplexrt-end:"  # the server's last mark: duplexrt-end:REASON;frames_in=I;frames_out=O


def _digits(value: str | None) -> int | None:
    return int(value) if value is not None and value.isdigit() and len(value) < 19 else None


class TwilioClient(ClientProtocol):
    """Twilio's side of a bidirectional Media Stream, as Twilio's docs write its messages:
    ``connected`` and ``start`` first, one ``media`` per piece of audio (base64 mu-law 8 kHz,
    numbered as Twilio numbers them), and ``stop`` to end the call.  The server sends no greeting;
    after ``stop`` it sends the rest of its answer, then its last mark
    ``duplexrt-end:REASON;frames_in=I;frames_out=O`` (``Ended``), and closes.  Its other marks come back as ``Other("mark", name)``."""

    name = "twilio"
    greets = False

    def __init__(self, *, model_rate: int = 24000, stream_sid: str = "MZ" + "0" * 32,
                 call_sid: str = "CA" + "0" * 32, account_sid: str = "AC" + "0" * 32) -> None:
        self.input_spec = AudioSpec.create(AudioFormat.G711_ULAW, _TWILIO_RATE, model_rate=model_rate)
        self.output_spec = self.input_spec
        self.stream_sid, self.call_sid, self.account_sid = stream_sid, call_sid, account_sid
        self.sequence = 0  # the last sequenceNumber sent
        self.chunk = 0
        self.samples = 0  # sent so far: media.timestamp is their length in ms
        self._media_head = ('{"event":"media","sequenceNumber":"%d","media":{"track":"inbound","chunk":"%d",'
                            '"timestamp":"%d","payload":"')
        self._media_tail = '"},"streamSid":' + json.dumps(stream_sid) + "}"

    def _next(self) -> str:
        self.sequence += 1
        return str(self.sequence)

    def hello(self) -> list[Message]:
        start = {"accountSid": self.account_sid, "streamSid": self.stream_sid, "callSid": self.call_sid,
                 "tracks": ["inbound"], "customParameters": {},
                 "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": _TWILIO_RATE, "channels": 1}}
        return [json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}),
                json.dumps({"event": "start", "sequenceNumber": self._next(), "start": start,
                            "streamSid": self.stream_sid})]

    def audio(self, payload: Buffer) -> Message:
        self.sequence += 1
        self.chunk += 1
        head = self._media_head % (self.sequence, self.chunk, self.samples * 1000 // _TWILIO_RATE)
        self.samples += len(payload)
        return head + b64codec.encode(payload) + self._media_tail

    def end_input(self) -> list[Message]:
        return [self.stop()]

    def stop(self) -> Message:
        """The call's ``stop`` event."""
        return json.dumps({"event": "stop", "sequenceNumber": self._next(), "streamSid": self.stream_sid,
                           "stop": {"accountSid": self.account_sid, "callSid": self.call_sid}})

    def mark(self, name: str) -> Message:
        """A ``mark`` as Twilio sends it back once the audio before the server's mark ``name`` has played."""
        return json.dumps({"event": "mark", "sequenceNumber": self._next(), "streamSid": self.stream_sid,
                           "mark": {"name": name}})

    def parse(self, message: Message) -> Buffer | Event:
        data = _json_event(message)
        if isinstance(data, Other):
            return data
        kind = data.get("event")
        if kind == "media":
            payload = _object_field(data, "media").get("payload")
            try:
                return b64codec.decode(payload) if isinstance(payload, str) else b""
            except ValueError:
                return ServerError("invalid_base64", "media carried audio that is not base64")
        if kind == "mark":
            name = _object_field(data, "mark").get("name")
            if isinstance(name, str) and name.startswith(_TWILIO_END_MARK):
                reason, *fields = name[len(_TWILIO_END_MARK):].split(";")
                usage = dict(field.partition("=")[::2] for field in fields)
                return Ended(reason, _digits(usage.get("frames_in")), _digits(usage.get("frames_out")), info=data)
            return Other("mark", name)
        return Other(str(kind), data)


# -- choosing one ----------------------------------------------------------------------------------------


def route_of(url: str) -> str:
    """The protocol a URL's path speaks; raises UnknownRoute for any other path."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise UnknownRoute(f"{url!r} is not a WebSocket URL (ws://HOST:PORT/ROUTE or wss://...)")
    path = parts.path.rstrip("/") or "/"
    for route, name in ROUTES.items():
        if path == route or path.endswith(route):
            return name
    raise UnknownRoute(f"unknown route {parts.path or '/'!r}: expected one of {', '.join(ROUTES)} "
                       "(or name the protocol with --protocol)")


def query_of(url: str) -> dict[str, str]:
    return dict(parse_qsl(urlsplit(url).query, keep_blank_values=True))


def client_for_url(url: str, *, protocol: str | None = None, input_format: str | None = None,
                   input_rate: int | None = None, model_rate: int = 24000) -> ClientProtocol:
    """The client protocol for ``url``.  ``/v1/duplex`` takes its formats from the URL's query
    (``format``, ``rate``, ``output_format``, ``output_rate``) where given, else from
    ``input_format`` / ``input_rate`` (default pcm_f32le at the model rate); ``/v1/realtime``
    speaks duplex mode when the query has ``duplex=1``."""
    name = protocol or route_of(url)
    query = query_of(url)
    if name == "duplex":
        input_spec, output_spec = duplex_specs(query, model_rate, default_format=input_format,
                                               default_rate=input_rate)
        return DuplexClient(input_spec, output_spec)
    if name == "realtime":
        return RealtimeClient(duplex=wants_duplex(query), model_rate=model_rate)
    if name == "moshi":
        return MoshiClient()
    if name == "live":
        fmt = AudioFormat.parse(input_format) if input_format in ("g711_ulaw", "g711_alaw") else AudioFormat.PCM_S16LE
        return LiveClient(fmt, model_rate=model_rate)
    if name == "twilio":
        return TwilioClient(model_rate=model_rate)
    raise UnknownRoute(f"unknown protocol {name!r}: expected duplex, realtime, moshi, live or twilio")
