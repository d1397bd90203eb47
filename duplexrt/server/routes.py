"""How the server builds each route's translator from the request (the routes: duplexrt/routes.py)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import attrs

from duplexrt.audio import AudioFormatError
from duplexrt.backends.base import PersonaRequest
from duplexrt.config import Config
from duplexrt.protocols.base import Translator
from duplexrt.protocols.options import duplex_persona, duplex_specs, moshi_persona, wants_continuous, wants_duplex
from duplexrt.protocols.raw import RawTranslator
from duplexrt.routes import ROUTE_TABLE, RouteInfo
from duplexrt.server.http import BadRequest, RequestHead
from duplexrt.transcripts.ids import new_call_id


@attrs.frozen
class Route:
    name: str
    #: Builds the session's translator from the request; raises BadRequest for bad options.
    translator: Callable[[RequestHead, Config], Translator]
    #: Largest message accepted on this route.
    max_message_bytes: Callable[[Config], int]
    #: The route sends audio as base64 inside JSON (realtime, live): what its resume journal's
    #: bytes per second of audio are worked out from (``server/budget.py``).
    base64_audio: bool = False
    #: A client may resume a session after a drop (``runtime.resume_window_s``); False for a
    #: protocol that cannot (Twilio's): a drop ends the session at once.
    resumable: bool = True


def _duplex(head: RequestHead, config: Config) -> Translator:
    """``/v1/duplex?format=pcm_s16le&rate=16000``: binary PCM both ways, JSON control;
    ``&instructions=...&voice=...``: the persona, for a model that takes one (checked by the
    server at admission, ``Server._check_url_persona``)."""
    try:
        input_spec, output_spec = duplex_specs(head.query, config.audio.sample_rate)
    except AudioFormatError as exc:
        raise BadRequest(400, str(exc)) from None
    translator = RawTranslator(input_spec, output_spec, announce=True)
    translator.call_id = new_call_id("call")  # in session.created and session.end: the transcript's id
    return _with_persona(translator, duplex_persona(head.query))


def _realtime(head: RequestHead, config: Config, *, duplex: bool = False) -> Translator:
    from duplexrt.protocols.realtime import RealtimeTranslator

    beta = "realtime=v1" in head.header("openai-beta").replace(" ", "").lower()
    duplex = duplex or wants_duplex(head.query)
    realtime = config.realtime
    translator = RealtimeTranslator(model_rate=config.audio.sample_rate, beta=beta, duplex=duplex,
                            model=head.query.get("model") or config.backend.name,
                            max_message_seconds=config.audio.max_message_seconds,
                            duplex_gate_dbfs=realtime.duplex_gate_dbfs
                            if realtime.duplex_split_responses and not wants_continuous(head.query) else None,
                            duplex_hangover_ms=realtime.duplex_hangover_ms,
                            frame_seconds=config.audio.frame_seconds,
                            server_vad=realtime.turn_detection == "server_vad",
                            session_id=new_call_id("sess"))
    translator.call_id = translator.session_id  # session.created's session.id: the transcript's id
    return translator


def _moshi(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.moshi import MoshiTranslator

    return _with_persona(MoshiTranslator(model_rate=config.audio.sample_rate), moshi_persona(head.query))


def _with_persona(translator: Translator, request: PersonaRequest) -> Translator:
    """The persona a URL asked for, kept by the translator until the server checks it."""
    translator.persona.request = request
    return translator


def _live(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.live import LiveTranslator

    translator = LiveTranslator(model_rate=config.audio.sample_rate, frame_seconds=config.audio.frame_seconds,
                                model=config.backend.name, max_message_seconds=config.audio.max_message_seconds,
                                session_id=new_call_id("live"))
    translator.call_id = translator.session_id  # the session resource's id: the transcript's id
    return translator


def _twilio(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.twilio import TwilioTranslator

    return TwilioTranslator(model_rate=config.audio.sample_rate, frame_seconds=config.audio.frame_seconds,
                            max_message_seconds=config.audio.max_message_seconds)


#: How the server builds each protocol's translator, and which message limit it takes.
_BUILDERS: dict[str, tuple[Callable[..., Translator], Callable[[Config], int]]] = {
    "duplex": (_duplex, lambda c: c.server.max_message_bytes),
    "realtime": (_realtime, lambda c: c.server.realtime_max_message_bytes),
    "moshi": (_moshi, lambda c: c.server.max_message_bytes),
    "live": (_live, lambda c: c.server.realtime_max_message_bytes),
    "twilio": (_twilio, lambda c: c.server.max_message_bytes),
}


def _route(info: RouteInfo) -> Route:
    build, max_message_bytes = _BUILDERS[info.protocol]
    if info.variant:  # /v1/realtime/duplex: duplex without the query string
        build = partial(build, duplex=True)
    return Route(info.protocol, build, max_message_bytes, base64_audio=info.protocol in ("realtime", "live", "twilio"),
                 resumable=info.protocol != "twilio")


ROUTES: dict[str, Route] = {info.path: _route(info) for info in ROUTE_TABLE}
