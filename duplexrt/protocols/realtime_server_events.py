"""Writing the OpenAI Realtime protocol's server events, in either naming.

The GA naming (``response.output_audio.delta``, format objects under ``session.audio``) and the
beta one (``response.audio.delta``, flat ``input_audio_format: "pcm16"``) say the same things
with different names and shapes; ``ServerEvents`` is the one place that knows both.  It keeps no
state of the conversation beyond the counter behind every ``event_id``: the translator
(``realtime.py``) decides what to say, this module how it is written.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.backends.base import Persona
from duplexrt.protocols.b64codec import encode
from duplexrt.protocols.realtime_client_events import G711_RATE, PCM_RATE
from duplexrt.protocols.realtime_items import message_item
from duplexrt.reasons import FinishReason
from duplexrt.wire.transport import Message

#: Each wire format by the name each naming gives it.
GA_NAMES = {
    AudioFormat.PCM_S16LE: "audio/pcm",
    AudioFormat.G711_ULAW: "audio/pcmu",
    AudioFormat.G711_ALAW: "audio/pcma",
}
BETA_NAMES = {
    AudioFormat.PCM_S16LE: "pcm16",
    AudioFormat.G711_ULAW: "g711_ulaw",
    AudioFormat.G711_ALAW: "g711_alaw",
}

#: SessionEnd.reason -> (response status, status_details reason).  The protocol's reasons are a
#: closed list; any other ending is an ``incomplete`` response whose ``status_details.error.code``
#: names it (``server_shutdown``, ``idle_timeout``, ...).
END_STATUS: dict[str, tuple[str, str | None]] = {
    FinishReason.STOP: ("completed", None),
    FinishReason.CLIENT_CLOSED: ("cancelled", "client_cancelled"),
    FinishReason.LENGTH: ("incomplete", "max_output_tokens"),
    FinishReason.ERROR: ("failed", None),
}
END_CODES: dict[str, str] = {FinishReason.SHUTDOWN: "server_shutdown"}


class Response:
    """The state of one response."""

    __slots__ = ("id", "item_id", "target", "frames", "audio_sent", "transcript",
                 "audio_prefix", "text_prefix", "fields")

    def __init__(self, response_id: str, item_id: str, target: int | None,
                 audio_type: str, text_type: str, fields: dict[str, Any] | None = None) -> None:
        self.id = response_id
        self.item_id = item_id
        #: What the client set in response.create that is echoed back (``metadata``).
        self.fields = fields or {}
        #: Turn mode: the response completes once this many frames of output have been sent.
        #: None: open-ended (duplex mode).
        self.target = target
        self.frames = 0  # model frames of output sent in this response
        self.audio_sent = False
        self.transcript: list[str] = []
        # Deltas are formatted by hand: the ids are ours and base64 needs no escaping, so the
        # per-frame path skips json.dumps scanning tens of kilobytes of payload.
        tail = (f'"response_id":"{response_id}","item_id":"{item_id}",'
                f'"output_index":0,"content_index":0,"delta":')
        self.audio_prefix = (f'{{"type":"{audio_type}",', tail)
        self.text_prefix = (f'{{"type":"{text_type}",', tail)

    def where(self) -> dict[str, Any]:
        """The fields that place an event in this response's one item and part."""
        return {"response_id": self.id, "item_id": self.item_id, "output_index": 0, "content_index": 0}


def usage(frames_in: int, frames_out: int, text_out: int = 0) -> dict[str, Any]:
    """One audio token per model frame, one text token per piece of model text."""
    return {
        "total_tokens": frames_in + frames_out + text_out,
        "input_tokens": frames_in,
        "output_tokens": frames_out + text_out,
        "input_token_details": {"audio_tokens": frames_in, "text_tokens": 0},
        "output_token_details": {"audio_tokens": frames_out, "text_tokens": text_out},
    }


class ServerEvents:
    """How this session's server events are written: GA naming, or beta (``beta=True``)."""

    def __init__(self, *, beta: bool) -> None:
        self.beta = beta
        self._event_ids = itertools.count(1)
        if beta:
            self.audio_delta = "response.audio.delta"
            self.audio_done = "response.audio.done"
            self.text_delta = "response.audio_transcript.delta"
            self.text_done = "response.audio_transcript.done"
            self.item_added_kind = "conversation.item.created"
        else:
            self.audio_delta = "response.output_audio.delta"
            self.audio_done = "response.output_audio.done"
            self.text_delta = "response.output_audio_transcript.delta"
            self.text_done = "response.output_audio_transcript.done"
            self.item_added_kind = "conversation.item.added"

    def event(self, kind: str, **fields: Any) -> str:
        return json.dumps({"type": kind, "event_id": f"event_{next(self._event_ids)}", **fields})

    def audio(self, response: Response, payload: bytes) -> str:
        """One audio delta, formatted by hand (see ``Response``)."""
        head, tail = response.audio_prefix
        return (f'{head}"event_id":"event_{next(self._event_ids)}",{tail}"'
                f'{encode(payload)}"}}')

    def text(self, response: Response, text: str) -> str:
        head, tail = response.text_prefix
        return f'{head}"event_id":"event_{next(self._event_ids)}",{tail}{json.dumps(text)}}}'

    def new_response(self, response_id: str, item_id: str, target: int | None,
                     fields: dict[str, Any] | None) -> Response:
        return Response(response_id, item_id, target, self.audio_delta, self.text_delta, fields)

    def item_added(self, previous: str | None, item: dict[str, Any]) -> list[Message]:
        """A new item in the conversation: beta says it was created; GA that it was added, and
        (for a whole item) done."""
        if self.beta:
            return [self.event("conversation.item.created", previous_item_id=previous, item=item)]
        return [self.event("conversation.item.added", previous_item_id=previous, item=item),
                self.event("conversation.item.done", previous_item_id=previous, item=item)]

    # -- names and objects ---------------------------------------------------------------------

    def format_name(self, spec: AudioSpec) -> str:
        names = BETA_NAMES if self.beta else GA_NAMES
        name = names.get(spec.format, spec.format.value)
        return f"{name} at {spec.sample_rate} Hz"

    @staticmethod
    def format_object(spec: AudioSpec) -> dict[str, Any]:
        body: dict[str, Any] = {"type": GA_NAMES.get(spec.format, spec.format.value)}
        if spec.format is AudioFormat.PCM_S16LE or spec.sample_rate != G711_RATE:
            body["rate"] = spec.sample_rate
        return body

    def session_object(self, session_id: str, model: str, input_spec: AudioSpec, output_spec: AudioSpec,
                       turn_detection: dict[str, Any] | None, persona: Persona | None = None,
                       transcription: dict[str, Any] | None = None) -> dict[str, Any]:
        """The session in effect.  ``persona``: a model's that takes one, shown as the client would
        set it (``instructions``, and the voice where its naming puts it); None: no such fields.
        ``transcription``: the input transcription in force (the server's STT model), if any."""
        if self.beta:
            session: dict[str, Any] = {
                "id": session_id,
                "object": "realtime.session",
                "model": model,
                "modalities": ["audio", "text"],
                "input_audio_format": BETA_NAMES.get(input_spec.format, input_spec.format.value),
                "output_audio_format": BETA_NAMES.get(output_spec.format, output_spec.format.value),
                "turn_detection": turn_detection,
            }
            # pcm16 means 24 kHz in the beta protocol; say so when the client chose another rate.
            for direction, spec in (("input", input_spec), ("output", output_spec)):
                if spec.format is AudioFormat.PCM_S16LE and spec.sample_rate != PCM_RATE:
                    session[f"{direction}_audio_sample_rate"] = spec.sample_rate
            if persona is not None:
                session["instructions"] = persona.text
                session["voice"] = persona.voice
            if transcription is not None:
                session["input_audio_transcription"] = transcription
            return session
        output: dict[str, Any] = {"format": self.format_object(output_spec)}
        session = {
            "id": session_id,
            "object": "realtime.session",
            "type": "realtime",
            "model": model,
            "output_modalities": ["audio"],
            "audio": {
                "input": {"format": self.format_object(input_spec), "turn_detection": turn_detection},
                "output": output,
            },
        }
        if persona is not None:
            session["instructions"] = persona.text
            output["voice"] = persona.voice
        if transcription is not None:
            session["audio"]["input"]["transcription"] = transcription
        return session

    def response_object(self, response: Response, status: str, details: dict[str, Any] | None,
                        usage: dict[str, Any] | None, output: list[dict[str, Any]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": response.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "usage": usage,
            "metadata": response.fields.get("metadata"),
        }
        if self.beta:
            body["modalities"] = ["audio", "text"]
        else:
            body["output_modalities"] = ["audio"]
        return body

    def assistant_item(self, response: Response, status: str, transcript: str | None) -> dict[str, Any]:
        content = [] if transcript is None else [
            {"type": "audio" if self.beta else "output_audio", "transcript": transcript}]
        return message_item(response.item_id, "assistant", content, beta=self.beta, status=status)

    # -- a response's opening and closing --------------------------------------------------------

    def response_opened(self, response: Response, item: dict[str, Any], previous: str | None) -> list[Message]:
        """A new response and its one output item (an assistant message with one audio part),
        in the order the protocol gives: clients create the per-item state they play audio from
        on these events, so they all come before the first delta."""
        return [
            self.event("response.created", response=self.response_object(response, "in_progress", None, None, [])),
            self.event("response.output_item.added", response_id=response.id, output_index=0, item=item),
            self.event(self.item_added_kind, previous_item_id=previous, item=item),
            self.event("response.content_part.added", **response.where(), part={"type": "audio", "transcript": ""}),
        ]

    def response_closed(self, response: Response, item: dict[str, Any], transcript: str, status: str,
                        details: dict[str, Any] | None, usage: dict[str, Any]) -> list[Message]:
        """The events that end a response: its part, its item, then the response itself."""
        where = response.where()
        messages: list[Message] = []
        if response.audio_sent:
            messages.append(self.event(self.audio_done, **where))
        if transcript:
            messages.append(self.event(self.text_done, **where, transcript=transcript))
        messages += [
            self.event("response.content_part.done", **where, part={"type": "audio", "transcript": transcript}),
            self.event("response.output_item.done", response_id=response.id, output_index=0, item=item),
        ]
        if not self.beta:
            messages.append(self.event("conversation.item.done", item=item))
        messages.append(self.event("response.done",
                                   response=self.response_object(response, status, details, usage, [item])))
        return messages
