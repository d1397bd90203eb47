"""The contract between a session and a wire protocol.

A translator is sans-IO: it turns each client message into one event for the session, and each
thing the session has to say (audio, model text, an error, the end) into the protocol's messages.
It never touches a socket, a clock or the runtime, so it is tested with plain calls.

The session calls ``audio_out`` for every batch of model audio it sends, so translators keep that
path to a list of one message where they can.

The persona (a role prompt and a voice, ``backends/base.py``) is shared by a translator and its
session through ``PersonaChoice``.  A caller may ask for a persona until its first audio frame
goes to the model; then the session fixes it (``PersonaChoice.fix``) and hands it to the slot,
before that frame (``SlotLease.set_persona``).  Routes whose persona comes in the URL
(``/v1/duplex``, ``/api/chat``) have it fixed when the session starts.  Asking again after that is
no change when it asks for the persona in effect (a framework that repeats its whole
``session.update`` keeps working) and ``PersonaLocked`` otherwise.

Every request is checked as it is asked (``Backend.check_persona``, on the trio thread), so a
translator can answer a bad one at once, and echo the persona in effect; nothing is checked, fixed
or echoed for a model that takes no persona (``check`` None): its routes behave as they did before
personas existed.  The caller's strings reach ``check_persona`` exactly as they came: an empty
prompt, control characters or any other Unicode are the backend's to judge.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from duplexrt.audio import AudioSpec
from duplexrt.backends.base import Persona, PersonaError, PersonaRequest
from duplexrt.protocols.events import Event, ProtocolError, SessionEnd
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.wire.transport import Message

#: ``offer_transcripts``'s default: a URL with no query string.
NO_QUERY: Mapping[str, str] = MappingProxyType({})


#: ``Backend.check_persona``: a request checked and completed with the defaults, or PersonaError.
PersonaCheck = Callable[[PersonaRequest], Persona]


class PersonaLocked(PersonaError):
    """A persona change after the session's persona was fixed (its first audio frame): the call
    goes on with the persona it has."""


#: OpenAI's stock voice names (Realtime and GPT-Live): on a model that takes a persona and has no
#: voice of that name, the model's default voice (see ``PersonaChoice.ask``).
STOCK_VOICES = frozenset({"alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx",
                          "sage", "shimmer", "verse"})


class PersonaChoice:
    """What one session's caller asked to be, checked, until the session fixes it."""

    __slots__ = ("check", "request", "_persona", "fixed")

    def __init__(self, request: PersonaRequest | None = None) -> None:
        #: The model's check (set by the session, or by the server at admission); None: the
        #: model takes no persona, and nothing here does anything.
        self.check: PersonaCheck | None = None
        #: Everything the caller asked for so far (a field it never named stays None: the default).
        self.request = request if request is not None else PersonaRequest()
        self._persona: Persona | None = None  # ``request`` checked, once it has been
        #: Set once the persona went to the model: from then on it does not change.
        self.fixed = False

    @property
    def taken(self) -> bool:
        """Whether the model takes a persona."""
        return self.check is not None

    def ask(self, text: str | None = None, voice: str | None = None) -> Persona:
        """The caller asks for ``text`` and/or ``voice`` (None keeps what it asked before, or the
        default): the persona now in effect.  Raises PersonaError for one the model refuses (the
        persona in effect stays), PersonaLocked for a change once it is fixed."""
        check = self.check
        if check is None:
            raise PersonaError("this model takes no persona")
        if voice is not None and voice.strip().lower() in STOCK_VOICES:
            # OpenAI's own voice names are what the SDKs and agent frameworks send when their
            # user chose nothing (LiveKit and pipecat send "alloy"; pipecat ends the call on any
            # error): one the model does not have means "the model's default voice".
            try:
                check(PersonaRequest(None, voice))
            except PersonaError:
                voice = ""
        request = PersonaRequest(text if text is not None else self.request.text,
                                 voice if voice is not None else self.request.voice)
        current = self._persona
        if request == self.request and current is not None:
            return current  # asked again, as it is: nothing to check
        if self.fixed:
            assert current is not None  # fixing checks it
            try:
                same = check(request) == current  # the default voice by its name, say
            except PersonaError:
                same = False
            if not same:
                raise PersonaLocked(
                    f"the persona (instructions and voice) is fixed once the session's first audio reaches "
                    f"the model; this one stays: voice {current.voice!r}")
            return current
        persona = check(request)
        self.request, self._persona = request, persona
        return persona

    def current(self) -> Persona | None:
        """The persona in effect (the defaults when nothing was asked); None for a model that
        takes none.  Raises PersonaError only when the model refuses its own defaults."""
        if self.check is None:
            return None
        if self._persona is None:
            self._persona = self.check(self.request)
        return self._persona

    def shown(self) -> Persona | None:
        """``current()`` for a translator to echo: None also when the model refuses its own
        defaults (the session then ends, saying so, before any frame: ``Reader.set_persona``)."""
        try:
            return self.current()
        except PersonaError:
            return None

    def fix(self) -> Persona | None:
        """The session hands the persona to the model: it is fixed from now on."""
        persona = self.current()
        self.fixed = True
        return persona


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
    #: The id this session's client is told when it starts (Realtime's ``session.id``, Live's,
    #: ``/v1/duplex``'s ``session.created`` ``id``), set by the server when it builds the route's
    #: translator: what the client fetches the call's transcript by (``GET /v1/transcripts/{id}``).
    #: Random (``transcripts/ids.py``); None on a route that tells its client no id.
    call_id: str | None = None
    #: Whether the session fixes the persona when it starts (a route whose persona comes in the
    #: URL) rather than at the caller's first audio frame (one that may set it in an event).
    persona_at_start: bool = False
    #: How many messages must arrive within ``server.first_message_timeout_s`` of the upgrade
    #: (Twilio's route, when its key comes in ``start``: ``connected`` and ``start``).
    first_messages: int = 1
    _persona_choice: PersonaChoice | None = None

    @property
    def persona(self) -> PersonaChoice:
        """The session's persona (``PersonaChoice``, above): what the caller asked for, checked
        by the model once the session (or the server, at admission) has set its ``check``."""
        choice = self._persona_choice
        if choice is None:
            choice = self._persona_choice = PersonaChoice()
        return choice

    def persona_ready(self) -> list[Message]:
        """Messages to send once the model has taken the session's persona (its prompt is in):
        a protocol whose client waits for a sign before it speaks (the Moshi handshake, as
        NVIDIA's PersonaPlex server sends it) gives that sign here.  Only for a model that takes
        a persona; none by default."""
        return []

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

    def offer_transcripts(self, model: str, delay_ms: float, *, query: Mapping[str, str] = NO_QUERY) -> None:
        """The server writes down what its callers say (``[transcriber]``: the model's name, and
        how far its text lags the audio): a protocol whose client asks for that (Realtime's
        ``input_audio_transcription``, or in the URL's ``query``: Moshi's ``?input_text=1``,
        whose clients cannot ask any other way) may now grant it.  Called by the server before
        the session starts; by default nothing changes."""

    def input_text(self, pieces: Sequence[TranscriptPiece]) -> list[Message]:
        """Messages carrying what the caller said (a transcriber's pieces, each placed on the
        caller's timeline: ``TranscriptPiece.audio_ms``); none by default."""
        return []

    @abc.abstractmethod
    def error(self, error: ProtocolError) -> list[Message]:
        """The protocol's error message for ``error``."""

    @abc.abstractmethod
    def end(self, end: SessionEnd) -> list[Message]:
        """The last messages of the session: usage and the finish reason, as the protocol says
        them.  Also used when the server shuts down (reason ``shutdown``)."""
