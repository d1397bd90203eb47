"""Which protocol each WebSocket path speaks, and how its options come from the request."""

from __future__ import annotations

from collections.abc import Callable

import attrs

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
from duplexrt.config import Config
from duplexrt.protocols.base import Translator
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
    """``/v1/duplex?format=pcm_s16le&rate=16000``: binary PCM both ways, JSON control.
    ``output_format`` and ``output_rate`` default to the input's."""
    model_rate = config.audio.sample_rate
    try:
        fmt = AudioFormat.parse(head.query.get("format", "pcm_f32le"))
        if fmt.is_encoded:
            raise AudioFormatError(f"{fmt.value} is not raw audio; /v1/duplex takes pcm_f32le, pcm_s16le, "
                                   "g711_ulaw or g711_alaw (Opus clients use /api/chat)")
        rate = _rate(head.query.get("rate"))
        input_spec = AudioSpec.create(fmt, rate, model_rate=model_rate)
        out_fmt = AudioFormat.parse(head.query.get("output_format", fmt.value))
        if out_fmt.is_encoded:
            raise AudioFormatError(f"output_format {out_fmt.value} is not raw audio")
        out_rate = _rate(head.query.get("output_rate")) or (input_spec.sample_rate if out_fmt is fmt else None)
        output_spec = AudioSpec.create(out_fmt, out_rate, model_rate=model_rate)
    except AudioFormatError as exc:
        raise BadRequest(400, str(exc)) from None
    return RawProtocol(input_spec, output_spec, announce=True)


def _rate(text: str | None) -> int | None:
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise AudioFormatError(f"rate must be a whole number of Hz, got {text!r}") from None


def _realtime(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.realtime import RealtimeProtocol

    beta = "realtime=v1" in head.header("openai-beta").replace(" ", "").lower()
    duplex = head.query.get("duplex", "").lower() in ("1", "true", "yes")
    return RealtimeProtocol(model_rate=config.audio.sample_rate, beta=beta, duplex=duplex,
                            model=head.query.get("model") or config.backend.name)


def _moshi(head: RequestHead, config: Config) -> Translator:
    from duplexrt.protocols.moshi import MoshiProtocol

    return MoshiProtocol(model_rate=config.audio.sample_rate)


ROUTES: dict[str, Route] = {
    "/v1/duplex": Route("duplex", _duplex, lambda c: c.server.max_message_bytes),
    "/v1/realtime": Route("realtime", _realtime, lambda c: c.server.realtime_max_message_bytes),
    "/api/chat": Route("moshi", _moshi, lambda c: c.server.max_message_bytes),
}
