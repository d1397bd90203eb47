"""What a route's query string means, shared by the server that reads it and the clients that
write it, so the two can never disagree."""

from __future__ import annotations

from collections.abc import Mapping

from duplexrt.audio import AudioFormat, AudioFormatError, AudioSpec
from duplexrt.backends.base import PersonaRequest


def duplex_specs(query: Mapping[str, str], model_rate: int, *, default_format: str | None = None,
                 default_rate: int | None = None) -> tuple[AudioSpec, AudioSpec]:
    """``/v1/duplex?format=&rate=&output_format=&output_rate=``: the input and output formats.
    The output defaults to the input's format, and to its rate when the format is the same.
    Raises AudioFormatError for anything the route cannot carry."""
    fmt = AudioFormat.parse(query.get("format") or default_format or AudioFormat.PCM_F32LE.value)
    if fmt.is_encoded:
        raise AudioFormatError(f"/v1/duplex takes raw audio (pcm_f32le, pcm_s16le, g711_ulaw or "
                               f"g711_alaw), not {fmt.value}; Opus clients use /api/chat")
    input_spec = AudioSpec.create(fmt, _rate(query.get("rate"), "rate") or default_rate,
                                  model_rate=model_rate)
    out_fmt = AudioFormat.parse(query.get("output_format") or fmt.value)
    if out_fmt.is_encoded:
        raise AudioFormatError(f"output_format {out_fmt.value} is not raw audio")
    out_rate = _rate(query.get("output_rate"), "output_rate") or (
        input_spec.sample_rate if out_fmt is fmt else None)
    return input_spec, AudioSpec.create(out_fmt, out_rate, model_rate=model_rate)


def wants_duplex(query: Mapping[str, str]) -> bool:
    """``/v1/realtime?duplex=1``: one continuous response instead of turns."""
    return query.get("duplex", "").lower() in ("1", "true", "yes")


def wants_continuous(query: Mapping[str, str]) -> bool:
    """``?duplex=1&continuous=1``: duplex mode as one open-ended response for the whole session,
    not one response per burst of speech (for clients that count every output frame, such as
    ``duplexrt client``: silence between bursts is otherwise not sent)."""
    return query.get("continuous", "").lower() in ("1", "true", "yes")


def duplex_persona(query: Mapping[str, str]) -> PersonaRequest:
    """``/v1/duplex?instructions=...&voice=...``: the persona asked for (a parameter left out
    keeps the model's default; one given, even empty, goes to the model's check as it is)."""
    return PersonaRequest(query.get("instructions"), query.get("voice"))


#: The query parameters NVIDIA's PersonaPlex web client sends to ``/api/chat`` besides its persona
#: (``client/src/pages/Conversation/Conversation.tsx``).  Accepted and ignored, so that client
#: works unmodified: sampling is the deployment's (``backend.options``), not each caller's, and
#: the worker and e-mail fields belong to NVIDIA's own queue.  NVIDIA's server ignores the
#: sampling values too (it has them commented out).
MOSHI_IGNORED_PARAMETERS = (
    "text_temperature", "text_topk", "audio_temperature", "audio_topk", "pad_mult", "text_seed",
    "audio_seed", "repetition_penalty_context", "repetition_penalty", "worker_auth_id", "email",
)


def moshi_persona(query: Mapping[str, str]) -> PersonaRequest:
    """``/api/chat?text_prompt=...&voice_prompt=NATF2.pt``: the persona as NVIDIA's client asks
    for it, exactly as sent (its voices are files, ``NATF2.pt``: the model's check takes a voice by
    that name or without the ``.pt``, and refuses a path).  The other parameters its client sends
    are ignored (``MOSHI_IGNORED_PARAMETERS``)."""
    return PersonaRequest(query.get("text_prompt"), query.get("voice_prompt"))


def wants_input_text(query: Mapping[str, str]) -> bool:
    """``/api/chat?input_text=1``: send what the caller said (a server with ``[transcriber]``).
    Opt-in because the Moshi protocol has no message for it and its web clients are strict:
    Kyutai's and NVIDIA's decoders throw on a kind they do not know, and log an error for every
    metadata message their server-info schema does not match (``protocols/moshi.py``)."""
    return query.get("input_text", "").lower() in ("1", "true", "yes")


def _rate(text: str | None, name: str) -> int | None:
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise AudioFormatError(f"{name} must be a whole number of Hz, got {text!r}") from None
