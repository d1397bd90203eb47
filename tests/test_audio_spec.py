"""AudioFormat names and properties, AudioSpec defaults and rate validation."""

from __future__ import annotations

import attrs
import numpy as np
import pytest

import duplexrt.audio as audio
from duplexrt.audio import SUPPORTED_INPUT_RATES, AudioFormat, AudioFormatError, AudioSpec

MODEL_RATE = 24000


def test_public_names_are_exported() -> None:
    for name in (
        "AudioFormat", "AudioSpec", "AudioFormatError", "Decoder", "Encoder",
        "make_decoder", "make_encoder", "Framer", "StreamResampler", "SUPPORTED_INPUT_RATES",
    ):
        assert hasattr(audio, name), name
    assert SUPPORTED_INPUT_RATES == (8000, 16000, 24000, 44100, 48000)


def test_error_is_a_value_error() -> None:
    assert issubclass(AudioFormatError, ValueError)


@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_parse_is_case_insensitive(fmt: AudioFormat) -> None:
    assert AudioFormat.parse(fmt.value) is fmt
    assert AudioFormat.parse(fmt.value.upper()) is fmt
    assert AudioFormat.parse(f"  {fmt.value.title()} ") is fmt
    assert AudioFormat.parse(fmt) is fmt


@pytest.mark.parametrize("name", ["mp3", "", "pcm", "opus ogg", None, 3])
def test_parse_unknown_lists_allowed_names(name: object) -> None:
    with pytest.raises(AudioFormatError) as info:
        AudioFormat.parse(name)  # type: ignore[arg-type]
    message = str(info.value)
    assert "unknown audio format" in message
    for fmt in AudioFormat:
        assert fmt.value in message


def test_format_is_a_plain_string_on_the_wire() -> None:
    assert AudioFormat.OPUS == "opus"
    assert str(AudioFormat.PCM_S16LE) == "pcm_s16le"
    assert f"{AudioFormat.G711_ALAW}" == "g711_alaw"


def test_format_properties() -> None:
    assert [f.is_encoded for f in AudioFormat] == [False, False, False, False, True]
    assert [f.bytes_per_sample for f in AudioFormat] == [4, 2, 1, 1, None]
    assert [f.default_rate(MODEL_RATE) for f in AudioFormat] == [24000, 24000, 8000, 8000, 24000]
    assert AudioFormat.PCM_F32LE.default_rate(16000) == 16000


def test_opus_default_rate_falls_back_to_48k_for_exotic_model_rates() -> None:
    assert AudioFormat.OPUS.default_rate(32000) == 48000
    assert AudioFormat.OPUS.default_rate(16000) == 16000


def test_create_fills_default_rate() -> None:
    assert AudioSpec.create("g711_ulaw", model_rate=MODEL_RATE) == AudioSpec(AudioFormat.G711_ULAW, 8000)
    assert AudioSpec.create("PCM_S16LE", model_rate=MODEL_RATE) == AudioSpec(AudioFormat.PCM_S16LE, 24000)
    spec = AudioSpec.create(AudioFormat.OPUS, 48000, model_rate=MODEL_RATE)
    assert spec.format is AudioFormat.OPUS and spec.sample_rate == 48000
    assert spec.is_encoded
    assert str(spec) == "opus@48000"


@pytest.mark.parametrize("fmt", ["pcm_f32le", "pcm_s16le", "g711_ulaw", "g711_alaw"])
@pytest.mark.parametrize("rate", SUPPORTED_INPUT_RATES)
def test_pcm_formats_accept_supported_rates(fmt: str, rate: int) -> None:
    assert AudioSpec.create(fmt, rate, model_rate=MODEL_RATE).sample_rate == rate


@pytest.mark.parametrize("rate", [8000, 12000, 16000, 24000, 48000])
def test_opus_accepts_its_rates(rate: int) -> None:
    assert AudioSpec.create("opus", rate, model_rate=MODEL_RATE).sample_rate == rate


@pytest.mark.parametrize(
    ("fmt", "rate", "allowed"),
    [
        ("opus", 44100, "8000, 12000, 16000, 24000, 48000"),
        ("opus", 22050, "8000, 12000, 16000, 24000, 48000"),
        ("pcm_s16le", 12000, "8000, 16000, 24000, 44100, 48000"),
        ("g711_alaw", 11025, "8000, 16000, 24000, 44100, 48000"),
    ],
)
def test_unsupported_rate_names_allowed_rates(fmt: str, rate: int, allowed: str) -> None:
    with pytest.raises(AudioFormatError) as info:
        AudioSpec.create(fmt, rate, model_rate=MODEL_RATE)
    assert f"{fmt} does not support a sample rate of {rate} Hz" in str(info.value)
    assert allowed in str(info.value)


def test_model_rate_is_always_allowed_for_pcm() -> None:
    assert AudioSpec.create("pcm_f32le", 32000, model_rate=32000).sample_rate == 32000
    with pytest.raises(AudioFormatError, match="32000"):
        AudioSpec.create("pcm_f32le", 22050, model_rate=32000)


@pytest.mark.parametrize("rate", [16000.0, "16000", True, 0, -8000])
def test_rate_must_be_a_positive_integer(rate: object) -> None:
    with pytest.raises(AudioFormatError, match="positive integer"):
        AudioSpec.create("pcm_s16le", rate, model_rate=MODEL_RATE)  # type: ignore[arg-type]


def test_numpy_integer_rate_is_accepted() -> None:
    spec = AudioSpec.create("pcm_s16le", np.int64(16000), model_rate=MODEL_RATE)
    assert spec.sample_rate == 16000 and type(spec.sample_rate) is int


@pytest.mark.parametrize("model_rate", [0, None, 24000.0])
def test_bad_model_rate(model_rate: object) -> None:
    with pytest.raises(ValueError, match="model_rate"):
        AudioSpec.create("pcm_s16le", model_rate=model_rate)  # type: ignore[arg-type]


def test_direct_construction_normalises_and_checks_what_it_can() -> None:
    assert AudioSpec("OPUS", 48000).format is AudioFormat.OPUS  # type: ignore[arg-type]
    with pytest.raises(AudioFormatError):
        AudioSpec(AudioFormat.OPUS, 44100)
    with pytest.raises(AudioFormatError):
        AudioSpec("flac", 16000)  # type: ignore[arg-type]


def test_spec_is_frozen_and_hashable() -> None:
    spec = AudioSpec.create("pcm_s16le", model_rate=MODEL_RATE)
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        spec.sample_rate = 8000  # type: ignore[misc]
    assert {spec: 1}[AudioSpec(AudioFormat.PCM_S16LE, 24000)] == 1


def test_the_documented_rates_per_format():
    """README (Audio formats): PCM and G.711 at 8, 16, 24, 44.1 or 48 kHz; Opus at 8, 12, 16, 24
    or 48 kHz, and not 44.1."""
    from duplexrt.audio import AudioFormatError, AudioSpec

    for fmt in ("pcm_f32le", "pcm_s16le", "g711_ulaw", "g711_alaw"):
        for rate in (8000, 16000, 24000, 44100, 48000):
            assert AudioSpec.create(fmt, rate, model_rate=24000).sample_rate == rate
    for rate in (8000, 12000, 16000, 24000, 48000):
        assert AudioSpec.create("opus", rate, model_rate=24000).sample_rate == rate
    for fmt, rate in (("opus", 44100), ("pcm_s16le", 12000), ("g711_ulaw", 12000)):
        with pytest.raises(AudioFormatError):
            AudioSpec.create(fmt, rate, model_rate=24000)
