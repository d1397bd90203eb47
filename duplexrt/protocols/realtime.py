"""The OpenAI Realtime protocol: JSON text events over a WebSocket, audio as base64 inside them.

Both namings of the protocol are spoken.  The GA one (``response.output_audio.delta``, format
objects such as ``{"type": "audio/pcm", "rate": 24000}`` under ``session.audio.input.format``) is
the default; ``beta=True`` (a client that sent ``OpenAI-Beta: realtime=v1``) gets the beta event
names (``response.audio.delta``) and the flat beta session object (``input_audio_format:
"pcm16"``).  Either session shape is accepted from either kind of client.

A full-duplex model speaks all the time; the protocol only decides what the client hears:

* turn mode (the default): output audio goes to the client only while a response is active.
  ``response.create`` opens one that answers all the input submitted so far: it completes once the
  model's output has caught up with that input (one output frame per input frame), and carries
  exactly those frames: output past its end waits for the next response.  A commit ends the turn
  (``EndTurn``): a translation model is fed its end-of-input flush, which the response then carries.  Output that comes before
  any ``response.create`` is held (bounded) and becomes the next response's start.
  ``response.cancel`` (or ``output_audio_buffer.clear``) ends the response, and the rest of its
  answer, which the model is still producing, is dropped as it comes: never sent later.
* duplex mode (``duplex=True``, for ``/v1/realtime/duplex`` or ``/v1/realtime?duplex=1``): the
  model's continuous output is cut into responses at its pauses (``OutputGate``: a level gate with
  a hang-over), so each burst of speech is one response with its own item; silence between bursts
  is not sent.  ``response.create`` opens a response at once (it ends at the next pause);
  ``response.cancel`` ends the current one and drops the rest of that burst.  With no gate, one
  open-ended response lasts the whole session.

Every response goes through the protocol's whole lifecycle, the events clients build their
per-item state on: ``response.created`` (with the client's ``metadata``), ``response.output_item.added``,
``conversation.item.added`` (beta: ``conversation.item.created``), ``response.content_part.added``,
the deltas, then the ``done`` events in reverse and ``response.done``.

Server VAD (``turn_detection``, on by default as in OpenAI's service) reports speech start and
stop; in turn mode it commits the turn, answers it (``create_response``) and cancels a response
the user talks over (``interrupt_response``).  Conversation items are ids and echoes: audio in a
created item is fed to the model, text is acknowledged but cannot reach a speech-only model.
Settings that cannot be honoured (tools, idle timeouts, input transcription on a server without
a transcriber) get a non-fatal ``unsupported_setting`` error naming the field; others that change
nothing audible (voice, instructions, for a model that takes no persona) are simply not in force,
and ``session.updated`` shows only what is.

Input transcription (a server with ``[transcriber]``, ``offer_transcripts``): a session that asks
for it (GA ``session.audio.input.transcription``, beta ``session.input_audio_transcription``, any
model name: the server's own STT model serves it, and ``session.updated`` names that) gets the
caller's words as ``conversation.item.input_audio_transcription.delta`` events on its user items
and one ``.completed`` per item once all of its text is out (``realtime_transcripts``); null turns
it off.

Persona (a model that takes one, such as PersonaPlex: ``Backend.takes_persona``).  ``session.update``
sets it: ``instructions`` is the role prompt, the voice is GA's ``session.audio.output.voice`` or
beta's ``session.voice``; a field left out keeps what was set before (at first, the model's
default).  ``session.created`` and every ``session.updated`` show the persona in effect (GA:
``instructions`` and ``audio.output.voice``; beta: ``instructions`` and ``voice``).  It is fixed
when the session's first audio frame reaches the model.  A persona the model refuses (an unknown
voice, a path as a voice, a prompt over the model's cap) gets a non-fatal ``invalid_persona``
error with the model's reason (the voices there are); a change after the first audio gets a
non-fatal ``persona_locked`` error; in both cases the rest of the ``session.update`` is applied and
the call goes on with the persona it had.  pipecat treats every ``error`` event as fatal, and
frameworks re-send their whole session (instructions and voice included) when one setting
changes: so an update that repeats the persona in effect is no change and gets no error, and
only an actual change after the first audio does.  A caller of such a model sets its persona in
its first ``session.update``, before any audio, with a voice the model has; OpenAI's stock voice
names (``alloy``...), which SDKs and frameworks send when their user chose none, mean the model's
default voice (``protocols.base.STOCK_VOICES``), and ``session.updated`` shows which that is.

One "token" of usage is one model frame (80 ms).

This module is the state machine (responses, held audio, turns); reading the client's events is in
``realtime_client_events`` and writing the server's, in either naming, in
``realtime_server_events``.

Nothing the client sends is echoed back at full length: values quoted in errors and client event ids
are cut to about 100 characters, so a client that sends huge values and never reads cannot make
each queued reply huge.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends.base import PersonaError
from duplexrt.protocols.b64audio import Base64Audio
from duplexrt.protocols.base import NO_QUERY, PersonaLocked, Translator
from duplexrt.protocols.events import (
    AudioIn,
    ClearInput,
    ClearOutput,
    EndTurn,
    Event,
    ProtocolError,
    Reconfigure,
    Reply,
    SessionEnd,
    clip,
    json_object,
    quote,
)
from duplexrt.protocols.realtime_client_events import (
    BINARY,
    PCM_RATE,
    UNSET,
    UNSUPPORTED,
    bad_type,
    client_event_id,
    read_session_update,
    response_fields,
)
from duplexrt.protocols.realtime_items import TEXT_LIMIT, Items, client_item, message_item
from duplexrt.protocols.realtime_server_events import END_CODES, END_STATUS, Response, ServerEvents, usage
from duplexrt.protocols.realtime_session import read_persona, read_transcription, render_turn_detection
from duplexrt.protocols.realtime_transcripts import CallerTranscripts
from duplexrt.protocols.vad import InputVad, OutputGate, VadSettings
from duplexrt.reasons import FinishReason
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.wire.transport import Message

__all__ = ["RealtimeTranslator"]

_session_ids = itertools.count(1)

#: Turn mode: at most this many seconds of model audio are held while no response is active;
#: beyond it the oldest is dropped.  Seconds, not bytes: a client that makes the model talk
#: faster than real time holds no more (docs/operator.md's per-session memory table).
MAX_HELD_SECONDS = 30.0


class _ZeroProgress:
    """Counters for a translator no session has attached yet."""

    frames_in = 0
    frames_out = 0
    frames_answered = 0
    max_frames: int | None = None


class RealtimeTranslator(Translator):
    """One session of the OpenAI Realtime protocol (GA or beta naming, turn or duplex mode)."""

    def __init__(self, *, model_rate: int = 24000, beta: bool = False, duplex: bool = False,
                 model: str = "duplexrt", session_id: str | None = None,
                 max_message_seconds: float | None = None, duplex_gate_dbfs: float | None = None,
                 duplex_hangover_ms: float = 480.0, frame_seconds: float = 0.08,
                 server_vad: bool = False) -> None:
        self.model_rate = model_rate
        self.beta = beta
        self.duplex = duplex
        self.model = model
        self.session_id = session_id or f"sess_{next(_session_ids)}"
        self.input_spec = AudioSpec.create(AudioFormat.PCM_S16LE, PCM_RATE, model_rate=model_rate)
        self.output_spec = self.input_spec
        self.progress = _ZeroProgress()
        #: Audio one append may carry (``audio.max_message_seconds``), checked on the base64 text.
        self.max_message_seconds = max_message_seconds
        self._out = ServerEvents(beta=beta)  # how this session's events are written
        self._audio = self._audio_rules()
        self._item_ids = itertools.count(1)
        self._response_ids = itertools.count(1)
        self._response: Response | None = None
        self._last_response_id: str | None = None
        self._last_item_id: str | None = None
        self._pending_input = False  # audio appended since the last commit or clear
        # Turn mode: the model's audio that arrives before the client asks for a response is
        # held (up to a bound) and given as that response's first deltas.  A fast model answers
        # a turn before the client's response.create arrives; dropping that would lose the reply.
        self._held: list[tuple[bytes, int]] = []
        self._held_bytes = 0
        self._held_frames = 0
        # Turn mode: output below this frame count belongs to a response the client cancelled
        # (or cleared): it is dropped as it arrives, never held for the next response.
        self._discard_below = 0
        self._fatal_sent = False
        self._items = Items()
        #: server VAD on the input (``turn_detection``); None: the client commits turns itself.
        self._vad: InputVad | None = InputVad(VadSettings(), self.input_spec) if server_vad else None
        self._speech_item: str | None = None  # the user item the current speech will become
        # Duplex mode with a gate: the model's output is cut into responses at its pauses (a
        # batch under the gate's level for ``_hangover`` frames ends the response).  None: one
        # open-ended response for the whole session.
        self._gate = OutputGate(duplex_gate_dbfs, self.output_spec) if duplex and duplex_gate_dbfs is not None else None
        self._hangover = max(1, math.ceil(duplex_hangover_ms / 1000 / frame_seconds - 1e-9))
        self._max_held_frames = max(1, int(MAX_HELD_SECONDS / frame_seconds + 1e-9))
        self._frame_ms = frame_seconds * 1e3
        #: The server's transcriber (``offer_transcripts``): its model's name and delay; None: none.
        self._stt: tuple[str, float] | None = None
        #: The caller's transcript, while the session asks for it (None: not asked, or off).
        self._transcripts: CallerTranscripts | None = None
        # Where a commit ends an item, on the model's frame timeline (the one transcript pieces
        # are placed on): the audio appended (wire ms), anchored to the frames submitted at the
        # last point the two were known to agree.  A turn-mode commit pads the caller's last
        # frame and feeds the flush frames after it, and a clear drops a part frame: the first
        # append after either anchors again (by then the session has submitted those frames).
        self._wire_ms = 0.0
        self._anchor_wire_ms = 0.0
        self._anchor_model_ms = 0.0
        self._reanchor = False
        self._vad_wire_ms = 0.0  # the wire position the VAD's own clock started at
        self._quiet = 0  # frames under the gate since the last loud one
        self._muted = False  # duplex: the client cancelled this burst; drop it until a pause
        handlers: dict[str, Callable[[dict[str, Any]], Event]] = {
            "input_audio_buffer.append": self._append,
            "input_audio_buffer.commit": self._commit,
            "input_audio_buffer.clear": self._clear_input,
            "output_audio_buffer.clear": self._clear_output,
            "session.update": self._session_update,
            "response.create": self._response_create,
            "response.cancel": self._response_cancel,
            "conversation.item.create": self._item_create,
            "conversation.item.truncate": self._item_truncate,
            "conversation.item.delete": self._item_delete,
            "conversation.item.retrieve": self._item_retrieve,
        }
        for name in UNSUPPORTED:
            handlers[name] = self._unsupported
        self._handlers = handlers

    # -- server -> client ----------------------------------------------------------------------

    def start(self) -> list[Message]:
        extra = {} if self.resume_token is None else {"resume_token": self.resume_token}
        messages: list[Message] = [self._out.event("session.created", session=self._session_object(), **extra)]
        if self.duplex and self._gate is None:
            messages += self._open_response(None)
        return messages

    def audio_out(self, payload: bytes, frames: int) -> list[Message]:
        messages = self._audio_out(payload, frames)
        if self._transcripts is not None:
            # The transcriber stepped these frames too: items whose audio ended the model's
            # delay before them have all their text.
            answered = (self.progress.frames_answered + frames) * self._frame_ms
            messages += self._transcripts.progress(answered)
        return messages

    def offer_transcripts(self, model: str, delay_ms: float, *, query: Mapping[str, str] = NO_QUERY) -> None:
        self._stt = (model, delay_ms)

    def input_text(self, pieces: Sequence[TranscriptPiece]) -> list[Message]:
        transcripts = self._transcripts
        if transcripts is None:
            return []
        return list(transcripts.pieces(pieces, self.progress.frames_answered * self._frame_ms))

    def _audio_out(self, payload: bytes, frames: int) -> list[Message]:
        if self._discard_below:
            if self.progress.frames_answered < self._discard_below:
                return []  # the rest of a cancelled response (the batch was split at its end)
            self._discard_below = 0
        if self._gate is not None:
            return self._gated_out(payload, frames)
        response = self._response
        if response is None:
            if not self.duplex:
                self._hold(payload, frames)
            return []
        messages: list[Message] = [self._delta_message(response, payload)] if payload else []
        response.frames += frames
        target = response.target
        if target is None or self.progress.frames_answered + frames < target:
            return messages
        return [*messages, *self._close_response("completed", None)]

    def _gated_out(self, payload: bytes, frames: int) -> list[Message]:
        """Duplex mode with a gate: sound opens a response, a pause as long as the hang-over
        closes it; silence between responses is not sent.  An encoder tail (no frames) goes with
        whatever is open."""
        assert self._gate is not None
        quiet = self._gate.quiet_tail(payload, frames) if frames else 0
        loud = quiet < frames
        self._quiet = quiet if loud else self._quiet + frames
        paused = self._quiet >= self._hangover
        if self._muted:  # the rest of a burst the client cancelled
            self._muted = not paused
            return []
        response = self._response
        messages: list[Message] = []
        if response is None:
            if not loud:
                return []
            messages += self._open_response(None)
            self._quiet = quiet  # the batch's own quiet tail counts toward the pause
            response = self._response
            assert response is not None
        if payload:
            messages.append(self._delta_message(response, payload))
        response.frames += frames
        if paused:
            messages += self._close_response("completed", None)
        return messages

    def _delta_message(self, response: Response, payload: bytes) -> str:
        response.audio_sent = True
        return self._out.audio(response, payload)

    def next_boundary(self) -> int | None:
        """Where the output changes hands: the end of the cancelled response being dropped, or
        the active turn-mode response's target.  Frames past it belong to the next response."""
        if self._discard_below > self.progress.frames_answered:
            return self._discard_below
        response = self._response
        return None if response is None else response.target

    def recode_held(self, recode: Callable[[Sequence[bytes]], list[bytes]]) -> None:
        if not self._held:
            return
        payloads = recode([payload for payload, _ in self._held])
        self._held = [(payload, frames) for payload, (_, frames) in zip(payloads, self._held, strict=True)]
        self._held_bytes = sum(len(payload) for payload in payloads)

    def _hold(self, payload: bytes, frames: int) -> None:
        if not payload:
            return
        self._held.append((payload, frames))
        self._held_bytes += len(payload)
        self._held_frames += frames
        while self._held_frames > self._max_held_frames and len(self._held) > 1:
            dropped, dropped_frames = self._held.pop(0)
            self._held_bytes -= len(dropped)
            self._held_frames -= dropped_frames

    def _release_held(self) -> list[Message]:
        """The held audio as the new response's first deltas (already counted as answered)."""
        held, self._held, self._held_bytes, self._held_frames = self._held, [], 0, 0
        messages: list[Message] = []
        response = self._response
        for payload, frames in held:
            if response is None:
                break
            if payload:
                messages.append(self._delta_message(response, payload))
            response.frames += frames
        return messages

    def text_out(self, text: str) -> list[Message]:
        response = self._response
        if response is None or not text:
            return []
        if self._discard_below and self.progress.frames_answered < self._discard_below:
            return []  # the cancelled answer's text, not the new response's
        response.transcript.append(text)
        return [self._out.text(response, text)]

    def error(self, error: ProtocolError) -> list[Message]:
        if error.fatal:
            self._fatal_sent = True
        return [self._out.event("error", error={
            "type": "invalid_request_error",
            "code": error.code,
            "message": error.message,
            "param": None,
            "event_id": error.event_id,
        })]

    def end(self, end: SessionEnd) -> list[Message]:
        if self._response is None:
            if end.reason == FinishReason.ERROR and not self._fatal_sent:
                # No response to fail, but the client still hears why the session ends.
                return [self._out.event("error", error={
                    "type": "server_error", "code": "server_error", "param": None, "event_id": None,
                    "message": end.error or "internal server error"})]
            return []
        status, reason = END_STATUS.get(end.reason, ("incomplete", None))
        messages: list[Message] = []
        error: dict[str, str | None] | None = None
        if end.reason not in END_STATUS:
            code = END_CODES.get(end.reason, end.reason)
            error = {"type": "server_error", "code": code, "message": f"the session ended: {code}"}
        if end.reason == FinishReason.ERROR:
            if self._fatal_sent:  # the client's own error was already sent as such
                error = {"type": "invalid_request_error", "code": None, "message": end.error}
            else:
                message = end.error or "internal server error"
                error = {"type": "server_error", "code": "server_error", "message": message}
                messages.append(self._out.event("error", error={**error, "param": None, "event_id": None}))
        details: dict[str, Any] = {"type": status, "reason": reason}
        if error is not None:
            details["error"] = error
        messages += self._close_response(status, details, usage(end.frames_in, end.frames_out, end.text_tokens_out))
        return messages

    # -- client -> server ----------------------------------------------------------------------

    def parse(self, message: Message) -> Event:
        if not isinstance(message, str):
            return BINARY
        raw = self._audio.read_append(message)  # the usual append, without json scanning its base64
        if raw is not None:
            return self._take_audio(raw)
        data = json_object(message)
        if isinstance(data, ProtocolError):
            return data
        kind = data.get("type")
        handler = self._handlers.get(kind) if type(kind) is str else None
        if handler is None:
            return bad_type(data, kind)
        return handler(data)

    def _append(self, data: dict[str, Any]) -> Event:
        raw = self._audio.decode(data.get("audio"), client_event_id(data))
        if isinstance(raw, ProtocolError):
            return raw
        return self._take_audio(raw)

    def _take_audio(self, raw: bytes) -> AudioIn:
        self._pending_input = True
        if self._reanchor:
            self._reanchor = False
            self._anchor_wire_ms = self._wire_ms
            self._anchor_model_ms = self.progress.frames_in * self._frame_ms
        spec = self.input_spec
        self._wire_ms += len(raw) / ((spec.format.bytes_per_sample or 1) * spec.sample_rate) * 1e3
        if self._vad is not None:
            return AudioIn(raw, self._detect(raw))
        return AudioIn(raw)

    def _audio_rules(self) -> Base64Audio:
        """How appends are checked in the current input format (``audio.max_message_seconds``
        bounds the base64 text before it is decoded)."""
        spec = self.input_spec
        return Base64Audio("input_audio_buffer.append", spec.format.bytes_per_sample or 1, spec.sample_rate,
                           self._out.format_name(spec), self.max_message_seconds)

    def _detect(self, raw: bytes) -> tuple[Message, ...]:
        """Server VAD over one append: speech start (barge-in) and stop (commit, and in turn mode
        the automatic response)."""
        vad = self._vad
        assert vad is not None
        messages: list[Message] = []
        for what, ms in vad.feed(raw):
            if what == "started":
                self._speech_item = self._new_item_id()
                messages.append(self._out.event("input_audio_buffer.speech_started", audio_start_ms=ms,
                                            item_id=self._speech_item))
                if self._transcripts is not None:
                    messages += self._transcripts.speech_started(self._speech_item)
                response = self._response
                if response is not None and vad.settings.interrupt_response and not self.duplex:
                    messages += self._cancel(response, "turn_detected")
                continue
            item_id = self._speech_item or self._new_item_id()
            self._speech_item = None
            messages.append(self._out.event("input_audio_buffer.speech_stopped", audio_end_ms=ms, item_id=item_id))
            messages += self._commit_item(item_id, self._model_ms(self._vad_wire_ms + ms))
            if vad.settings.create_response and not self.duplex and self._response is None:
                messages += self._turn_response(None)
        return tuple(messages)

    def _commit_item(self, item_id: str, end_ms: float) -> list[Message]:
        """The input so far (to ``end_ms`` on the caller's timeline) becomes a user item:
        committed, then added to the conversation; its transcript follows, if asked for."""
        self._pending_input = False
        item = message_item(item_id, "user", [{"type": "input_audio", "transcript": None}], beta=self.beta)
        previous = self._items.add(item)
        self._last_item_id = item_id
        messages = [self._out.event("input_audio_buffer.committed", previous_item_id=previous, item_id=item_id),
                    *self._out.item_added(previous, item)]
        if self._transcripts is not None:
            messages += self._transcripts.committed(item_id, end_ms)
        return messages

    def _commit(self, data: dict[str, Any]) -> Event:
        if not self._pending_input:
            return ProtocolError("input_audio_buffer_commit_empty",
                                 "nothing to commit: no audio was appended since the last commit or clear",
                                 event_id=client_event_id(data))
        item_id = self._speech_item or self._new_item_id()
        self._speech_item = None
        messages = tuple(self._commit_item(item_id, self._model_ms(self._wire_ms)))
        if not self.duplex:
            self._reanchor = True  # the session pads the last frame and feeds the flush
        # Turn mode: the commit ends the speaker's turn, so a translation model is fed its
        # end-of-input flush and the next response carries the rest of the translation.
        return Reply(messages) if self.duplex else EndTurn(messages)

    def _clear_input(self, data: dict[str, Any]) -> Event:
        self._pending_input = False
        if self._transcripts is not None:
            self._transcripts.cleared(self._model_ms(self._wire_ms))
        self._reanchor = True  # the part frame held is dropped
        return ClearInput(messages=(self._out.event("input_audio_buffer.cleared"),))

    def _clear_output(self, data: dict[str, Any]) -> Event:
        response = self._response
        self._held, self._held_bytes, self._held_frames = [], 0, 0
        messages: list[Message] = []
        if response is not None and response.target is not None:
            # The frames dropped now will never be sent, so a turn-mode response could not reach
            # its target: clearing what it was saying cancels it.
            messages += self._cancel(response)
        response_id = response.id if response is not None else self._last_response_id or ""
        messages.append(self._out.event("output_audio_buffer.cleared", response_id=response_id))
        return ClearOutput(messages=tuple(messages))

    def _response_create(self, data: dict[str, Any]) -> Event:
        if self._response is not None:
            return ProtocolError("conversation_already_has_active_response",
                                 f"response {self._response.id} is still in progress; "
                                 "cancel it or wait for its response.done",
                                 event_id=client_event_id(data))
        fields = response_fields(data)
        if isinstance(fields, ProtocolError):
            return fields
        if self.duplex:
            self._muted = False
            return Reply(tuple(self._open_response(None, fields)))
        return Reply(tuple(self._turn_response(fields)))

    def _turn_response(self, fields: dict[str, Any] | None) -> list[Message]:
        """Turn mode: a response that answers all the input submitted so far."""
        progress = self.progress
        target = progress.frames_in
        created = self._open_response(target, fields)
        deltas = self._release_held()
        if progress.frames_answered < target:
            return [*created, *deltas]
        return [*created, *deltas, *self._close_response("completed", None)]

    def _response_cancel(self, data: dict[str, Any]) -> Event:
        response = self._response
        wanted = data.get("response_id")
        if response is None or (isinstance(wanted, str) and wanted and wanted != response.id):
            what = f"response {quote(wanted)} is not" if isinstance(wanted, str) and wanted else "no response is"
            return ProtocolError("response_cancel_not_active", f"{what} in progress",
                                 event_id=client_event_id(data))
        return Reply(tuple(self._cancel(response)))

    def _cancel(self, response: Response, reason: str = "client_cancelled") -> list[Message]:
        """End ``response`` as cancelled.  In turn mode the model is still producing the rest of
        its answer (up to the target): that output is dropped as it comes, so that it is neither
        sent now nor held and replayed as the start of the next response."""
        if response.target is not None:
            self._discard_below = max(self._discard_below, response.target)
        elif self._gate is not None:
            self._muted = True  # the rest of this burst, until the model pauses
        return self._close_response("cancelled", {"type": "cancelled", "reason": reason})

    # -- conversation items ---------------------------------------------------------------------

    def _item_create(self, data: dict[str, Any]) -> Event:
        """An item from the client.  Audio in it is fed to the model like appended audio; text
        is acknowledged but cannot reach a speech-only model (docs/integrator.md says so)."""
        event_id = client_event_id(data)
        item = data.get("item")
        if type(item) is not dict:
            return ProtocolError("invalid_type" if item is not None else "missing_required_parameter",
                                 "conversation.item.create needs an 'item' object", event_id=event_id)
        given = item.get("id")
        if given is not None and not (isinstance(given, str) and 0 < len(given) <= 64):
            return ProtocolError("invalid_value", f"item.id must be a string of 1 to 64 characters, got {quote(given)}",
                                 event_id=event_id)
        item_id = given or self._new_item_id()
        if self._items.get(item_id) is not None:
            return ProtocolError("item_already_exists", f"item {quote(item_id)} already exists", event_id=event_id)
        content = item.get("content")
        pieces: list[bytes] = []
        heard: list[Message] = []  # what a server VAD makes of the item's audio
        for part in content if type(content) is list else ():
            if type(part) is dict and part.get("audio") is not None:
                fed = self._append({"audio": part["audio"], "event_id": event_id})
                if not isinstance(fed, AudioIn):
                    return fed
                pieces.append(bytes(fed.payload))
                heard += fed.messages
        raw = b"".join(pieces)
        if raw:
            self._pending_input = False  # the item holds its own audio: nothing to commit
        rendered = client_item(item_id, item, beta=self.beta)
        previous = self._items.add(rendered)
        self._last_item_id = item_id
        messages = tuple(self._out.item_added(previous, rendered))
        return AudioIn(raw, (*heard, *messages)) if raw else Reply(messages)

    def _item_truncate(self, data: dict[str, Any]) -> Event:
        """The client stopped playing an item: if it is the response still speaking, that
        response ends now and the rest of its audio is dropped (unsent audio included)."""
        event_id = client_event_id(data)
        item_id, audio_end_ms = data.get("item_id"), data.get("audio_end_ms")
        if not isinstance(item_id, str) or not item_id:
            return ProtocolError("missing_required_parameter", "conversation.item.truncate needs 'item_id'",
                                 event_id=event_id)
        if isinstance(audio_end_ms, bool) or not isinstance(audio_end_ms, int) or audio_end_ms < 0:
            return ProtocolError("invalid_value", "'audio_end_ms' must be a whole number of milliseconds "
                                 f">= 0, got {quote(audio_end_ms)}", event_id=event_id)
        if self._items.get(item_id) is None:
            return ProtocolError("item_not_found", f"no item {quote(item_id)} in this conversation",
                                 event_id=event_id)
        truncated = self._out.event("conversation.item.truncated", item_id=item_id, content_index=0,
                                audio_end_ms=audio_end_ms)
        response = self._response
        if response is None or response.item_id != item_id:
            return Reply((truncated,))
        return ClearOutput(messages=(truncated, *self._cancel(response)))

    def _item_delete(self, data: dict[str, Any]) -> Event:
        item_id = data.get("item_id")
        if not isinstance(item_id, str) or not self._items.delete(item_id):
            return ProtocolError("item_not_found", f"no item {quote(item_id)} in this conversation",
                                 event_id=client_event_id(data))
        return Reply((self._out.event("conversation.item.deleted", item_id=item_id),))

    def _item_retrieve(self, data: dict[str, Any]) -> Event:
        item_id = data.get("item_id")
        item = self._items.get(item_id) if isinstance(item_id, str) else None
        if item is None:
            return ProtocolError("item_not_found", f"no item {quote(item_id)} in this conversation",
                                 event_id=client_event_id(data))
        return Reply((self._out.event("conversation.item.retrieved", item=item),))

    def _unsupported(self, data: dict[str, Any]) -> Event:
        return ProtocolError("unsupported_event",
                             f"{data['type']} is not supported by this server; the session goes on",
                             event_id=client_event_id(data))

    # -- session.update ---------------------------------------------------------------------------

    def _session_update(self, data: dict[str, Any]) -> Event:
        update = read_session_update(data, self.model_rate, self._out.format_name)
        if isinstance(update, ProtocolError):
            return update
        event_id = client_event_id(data)
        specs, detection = update.specs, update.turn_detection
        persona = self.persona
        asked: tuple[str | None, str | None] = (None, None)
        if persona.taken:  # else instructions and voice are accepted and not in force, as ever
            fields = read_persona(data["session"])
            if isinstance(fields, str):
                return ProtocolError("invalid_value", fields, event_id=event_id)
            asked = fields
        transcription = read_transcription(data["session"])
        unsupported = update.unsupported
        if self._stt is not None:  # a transcriber serves it: not a refusal
            unsupported = [(field, why) for field, why in unsupported if "transcription" not in field]
        warnings = [self._warning(field, why, event_id) for field, why in unsupported]
        # Everything checked: apply.  Other fields (tools, modalities, ...) change nothing here,
        # so they are neither kept nor echoed: session.updated shows what is in effect.
        if asked != (None, None):
            warnings += self._ask_persona(*asked, event_id=event_id)
        if detection is not UNSET:
            self._set_turn_detection(detection)
        if self._stt is not None and transcription is not None:
            self._set_transcription(transcription)
        new_input = specs.get("input", self.input_spec)
        new_output = specs.get("output", self.output_spec)
        changed = new_input != self.input_spec or new_output != self.output_spec
        self.input_spec = new_input
        self.output_spec = new_output
        self._audio = self._audio_rules()
        if self._vad is not None and "input" in specs:
            self._vad.set_spec(new_input)
        if self._gate is not None:
            self._gate.set_spec(new_output)
        updated = self._out.event("session.updated", session=self._session_object())
        if changed:
            return Reconfigure(input_spec=new_input, output_spec=new_output, messages=(updated, *warnings))
        # Same formats: the session's decoder and encoder keep their state (no resampler restart).
        return Reply((updated, *warnings))

    def _ask_persona(self, text: str | None, voice: str | None, *, event_id: str | None) -> list[Message]:
        """The caller asks for a persona: nothing to say when the model takes it (or it is the one
        in effect), else a non-fatal error with the model's reason (see the module docstring)."""
        try:
            self.persona.ask(text, voice)
        except PersonaLocked as exc:
            error = ProtocolError("persona_locked", f"{clip(str(exc), 500)}; the rest of the session.update is "
                                  "applied and the session goes on", event_id=event_id)
        except PersonaError as exc:
            error = ProtocolError("invalid_persona", f"the persona (instructions and voice) was refused: "
                                  f"{clip(str(exc), 500)}; the persona in effect is unchanged, the rest of the "
                                  "session.update is applied and the session goes on", event_id=event_id)
        else:
            return []
        return self.error(error)

    def _set_transcription(self, on: bool) -> None:
        """Transcripts on (from the next piece on) or off (what was pending is dropped)."""
        if not on:
            self._transcripts = None
        elif self._transcripts is None:
            assert self._stt is not None
            self._transcripts = CallerTranscripts(self._out, delay_ms=self._stt[1], frame_ms=self._frame_ms,
                                                  finish=self._item_transcribed)

    def _item_transcribed(self, item_id: str, transcript: str) -> None:
        """A user item's transcript is complete: ``conversation.item.retrieve`` shows it."""
        item = self._items.get(item_id)
        if item is not None and item.get("content"):
            item["content"][0]["transcript"] = clip(transcript, TEXT_LIMIT)

    def _set_turn_detection(self, settings: VadSettings | None) -> None:
        if settings is None:
            self._vad = None
        elif self._vad is None:
            self._vad = InputVad(settings, self.input_spec)
            self._vad_wire_ms = self._wire_ms
        else:  # new settings, same stream: speech under way stays under way
            self._vad.settings = settings
            self._vad.set_mode(settings.mode)

    def _warning(self, field: str, why: str, event_id: str | None) -> Message:
        """A setting that cannot be honoured: said once, as a non-fatal error naming the field."""
        return self.error(ProtocolError("unsupported_setting", f"{field}: {why}; the rest of the "
                                        "session.update is applied and the session goes on", event_id=event_id))[0]

    # -- helpers ------------------------------------------------------------------------------------

    def resumed(self, token: str, received: int) -> list[Message]:
        """A duplexrt event (no OpenAI client sends a resume): the next token, and how many client
        events the session took."""
        return [self._out.event("session.resumed", resume_token=token, received=received)]

    def _model_ms(self, wire_ms: float) -> float:
        """A wire position (ms of audio appended) on the model's frame timeline."""
        return self._anchor_model_ms + (wire_ms - self._anchor_wire_ms)

    def _new_item_id(self) -> str:
        return f"item_{next(self._item_ids)}"

    def _turn_detection_object(self) -> dict[str, Any] | None:
        return None if self._vad is None else render_turn_detection(self._vad.settings, duplex=self.duplex)

    def _session_object(self) -> dict[str, Any]:
        transcription = None
        if self._transcripts is not None and self._stt is not None:
            transcription = {"model": self._stt[0]}
        return self._out.session_object(self.session_id, self.model, self.input_spec, self.output_spec,
                                        self._turn_detection_object(), self.persona.shown(), transcription)

    def _open_response(self, target: int | None, fields: dict[str, Any] | None = None) -> list[Message]:
        """A new response and its one output item, announced before any of its deltas."""
        response = self._out.new_response(f"resp_{next(self._response_ids)}", self._new_item_id(), target, fields)
        self._response = response
        self._last_response_id = response.id
        self._quiet = 0
        item = self._out.assistant_item(response, "in_progress", None)
        previous = self._items.add(item)
        self._last_item_id = response.item_id
        return self._out.response_opened(response, item, previous)

    def _close_response(self, status: str, details: dict[str, Any] | None,
                        usage_: dict[str, Any] | None = None) -> list[Message]:
        """The events that end the active response, which is then closed."""
        response = self._response
        assert response is not None
        self._response = None
        transcript = "".join(response.transcript)
        item = self._out.assistant_item(response, "completed" if status == "completed" else "incomplete",
                                        transcript)
        if self._items.get(response.item_id) is not None:
            self._items.add(item)  # replaces the in-progress rendering, in place
        if usage_ is None:
            frames_in = response.target if response.target is not None else self.progress.frames_in
            usage_ = usage(frames_in, response.frames, len(response.transcript))
        return self._out.response_closed(response, item, transcript, status, details, usage_)
