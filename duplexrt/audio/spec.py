"""What a client says it will send or wants back: wire format and sample rate.

Validation lives here, at session setup, so that the per-message code in
``formats`` can trust its configuration and stay free of checks.
"""

from __future__ import annotations

import enum
import operator
from typing import SupportsIndex

import attrs

from .errors import AudioFormatError

__all__ = ["OPUS_RATES", "SUPPORTED_INPUT_RATES", "AudioFormat", "AudioSpec"]

#: Rates accepted for raw PCM and G.711 (the model rate is always accepted too).
SUPPORTED_INPUT_RATES: tuple[int, ...] = (8000, 16000, 24000, 44100, 48000)

#: The only rates libopus can decode to / encode from (so also sphn's limits).
OPUS_RATES: tuple[int, ...] = (8000, 12000, 16000, 24000, 48000)

# G.711 is a telephony codec: 8 kHz is what every gateway sends by default.
_G711_DEFAULT_RATE = 8000


class AudioFormat(str, enum.Enum):
    """Audio encodings a client can use on the wire (always mono).

    A ``str`` mix-in so the value can go straight into JSON and compare equal
    to the plain name; ``str()`` returns the wire name for the same reason.
    """

    PCM_F32LE = "pcm_f32le"
    PCM_S16LE = "pcm_s16le"
    G711_ULAW = "g711_ulaw"
    G711_ALAW = "g711_alaw"
    OPUS = "opus"  # an Ogg Opus stream, cut into messages at arbitrary points

    def __str__(self) -> str:
        return self.value

    @property
    def is_encoded(self) -> bool:
        """True for stateful compressed codecs (Opus).

        Their coding costs far more than the table lookups of the other
        formats (hundreds of microseconds per message rather than a few), so
        the server may want to schedule it differently, e.g. off the loop.
        """
        return self is AudioFormat.OPUS

    @property
    def bytes_per_sample(self) -> int | None:
        """Bytes per sample on the wire, or None for variable-rate Opus."""
        return _BYTES_PER_SAMPLE[self]

    def default_rate(self, model_rate: int) -> int:
        """Rate assumed when the client names a format but no rate.

        G.711 essentially always means 8 kHz.  For everything else the model
        rate is the natural default since it needs no resampling; Opus falls
        back to 48 kHz (its native rate) if the model rate is not one it can
        do.
        """
        if self is AudioFormat.G711_ULAW or self is AudioFormat.G711_ALAW:
            return _G711_DEFAULT_RATE
        if self is AudioFormat.OPUS and model_rate not in OPUS_RATES:
            return 48000
        return model_rate

    def allowed_rates(self, model_rate: int) -> tuple[int, ...]:
        """Sample rates this format can use on the wire with the given model."""
        if self is AudioFormat.OPUS:
            return OPUS_RATES
        if model_rate in SUPPORTED_INPUT_RATES:
            return SUPPORTED_INPUT_RATES
        return tuple(sorted((*SUPPORTED_INPUT_RATES, model_rate)))

    @classmethod
    def parse(cls, name: AudioFormat | str) -> AudioFormat:
        """Look up a format by its wire name, ignoring case and surrounding space."""
        if isinstance(name, cls):
            return name
        if isinstance(name, str):
            try:
                return cls(name.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(member.value for member in cls)
        raise AudioFormatError(f"unknown audio format {name!r}; expected one of: {allowed}")


_BYTES_PER_SAMPLE: dict[AudioFormat, int | None] = {
    AudioFormat.PCM_F32LE: 4,
    AudioFormat.PCM_S16LE: 2,
    AudioFormat.G711_ULAW: 1,
    AudioFormat.G711_ALAW: 1,
    AudioFormat.OPUS: None,
}


def _as_format(value: AudioFormat | str) -> AudioFormat:
    # A named function: attrs' converters (and mypy's attrs plugin) take no bound classmethod.
    return AudioFormat.parse(value)


def _as_rate(value: object, what: str = "sample rate") -> int:
    # operator.index accepts int and numpy integers but not floats or bools
    # masquerading as rates ("16000.5", True).
    if not isinstance(value, bool) and isinstance(value, SupportsIndex):
        try:
            rate = operator.index(value)
        except TypeError:
            pass
        else:
            if rate > 0:
                return rate
    raise AudioFormatError(f"{what} must be a positive integer number of Hz, got {value!r}")


def check_model_rate(model_rate: int) -> int:
    """Validate the model's own rate (a server setting, hence a plain ValueError)."""
    if isinstance(model_rate, bool) or not isinstance(model_rate, int) or model_rate <= 0:
        raise ValueError(f"model_rate must be a positive integer, got {model_rate!r}")
    return model_rate


def check_rate(format: AudioFormat, sample_rate: int, model_rate: int) -> None:
    """Raise AudioFormatError unless ``format`` can run at ``sample_rate``."""
    allowed = format.allowed_rates(model_rate)
    if sample_rate not in allowed:
        names = ", ".join(str(rate) for rate in allowed)
        raise AudioFormatError(
            f"{format.value} does not support a sample rate of {sample_rate} Hz; "
            f"allowed rates: {names}"
        )


def _validate_opus_rate(instance: AudioSpec, attribute: attrs.Attribute, rate: int) -> None:
    # The PCM rate limits depend on the model rate, which a spec does not
    # carry (make_decoder/make_encoder check those); Opus limits do not.
    if instance.format is AudioFormat.OPUS:
        check_rate(AudioFormat.OPUS, rate, model_rate=0)


@attrs.frozen
class AudioSpec:
    """A wire format plus the sample rate it runs at.

    Build it with :meth:`create`, which fills in the default rate and checks
    the rate against the model; direct construction only normalises the
    format name and checks what can be checked without the model rate.
    """

    format: AudioFormat = attrs.field(converter=_as_format)
    sample_rate: int = attrs.field(converter=_as_rate, validator=_validate_opus_rate)

    @classmethod
    def create(
        cls,
        format: AudioFormat | str,
        sample_rate: int | None = None,
        *,
        model_rate: int,
    ) -> AudioSpec:
        """Validated spec; ``sample_rate=None`` means the format's default."""
        check_model_rate(model_rate)
        fmt = AudioFormat.parse(format)
        rate = fmt.default_rate(model_rate) if sample_rate is None else _as_rate(sample_rate)
        check_rate(fmt, rate, model_rate)
        return cls(fmt, rate)

    @property
    def is_encoded(self) -> bool:
        return self.format.is_encoded

    def __str__(self) -> str:
        return f"{self.format.value}@{self.sample_rate}"
