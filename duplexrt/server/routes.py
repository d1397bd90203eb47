"""Which protocol each WebSocket path speaks, and how its options come from the request."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from duplexrt.audio import AudioFormatError
from duplexrt.config import Config
from duplexrt.protocols.base import Translator
from duplexrt.protocols.options import duplex_specs, wants_continuous, wants_duplex
from duplexrt.protocols.raw import RawProtocol
from duplexrt.server.http import BadRequest, RequestHead


@attrs.frozen
class Route:
    name: str
    #: Builds the session's translator from the request; raises BadRequest for bad options.
    translator: Callable[[RequestHead, Config], Translator]
    #: Largest message accepted on this route.
    max_message_bytes: Callable[[Config], int]


def _duplex(head: RequestHead, config: Config) -> Translator:
    """``/v1/duplex?format=pcm_s16le&rate=16000``: binary PCM both ways, JSON control."""
    try:
        input_spec, output_spec = duplex_specs(head.query, config.audio.sample_rate)
    except AudioFormatError as exc:
        raise BadRequest(400, str(exc)) from None
    return RawProtocol(input_spec, output_spec, announce=True)


def _realtime(head: RequestHead, config: Config, *, duplex: bool = False) -> Translator:
    from duplexrt.protocols.realtime import RealtimeProtocol

    beta = "realtime=v1" in head.header("openai-beta").replace(" ", "").lower()
    duplex = duplex or wants_duplex(head.query)
    realtime = config.realtime
    return RealtimeProtocol(model_rate=config.audio.sample_rate, beta=beta, duplex=duplex,
                            model=head.query.get("model") or config.backend.name,
                            max_message_seconds=config.audio.max_message_seconds,
                            duplex_gate_dbfs=realtime.duplex_gate_dbfs
                            if realtime.duplex_split_responses and not wants_continuous(head.query) else None,
                            duplex_hangover_ms=realtime.duplex_hangover_ms,
                            frame_seconds=config.audio.frame_seconds,
                            server_vad=realtime.turn_detection == "server_vad")


def _moshi(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.moshi import MoshiProtocol

    return MoshiProtocol(model_rate=config.audio.sample_rate)


def _live(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.live import LiveProtocol

    return LiveProtocol(model_rate=config.audio.sample_rate, frame_seconds=config.audio.frame_seconds,
                        model=config.backend.name, max_message_seconds=config.audio.max_message_seconds)


ROUTES: dict[str, Route] = {
    "/v1/duplex": Route("duplex", _duplex, lambda c: c.server.max_message_bytes),
    "/v1/realtime": Route("realtime", _realtime, lambda c: c.server.realtime_max_message_bytes),
    # Duplex without the query string: frameworks append their own ``?model=`` to a base URL.
    "/v1/realtime/duplex": Route("realtime", lambda h, c: _realtime(h, c, duplex=True),
                                 lambda c: c.server.realtime_max_message_bytes),
    "/api/chat": Route("moshi", _moshi, lambda c: c.server.max_message_bytes),
    "/v1/live/sessions": Route("live", _live, lambda c: c.server.realtime_max_message_bytes),
}
