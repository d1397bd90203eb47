"""A route's query options (protocols/options.py) by plain calls."""

from __future__ import annotations

import pytest

from duplexrt.audio import AudioFormat, AudioFormatError
from duplexrt.protocols.options import duplex_specs, wants_continuous, wants_duplex

MODEL = 24000


def test_duplex_defaults_to_f32_at_the_model_rate_both_ways():
    input_spec, output_spec = duplex_specs({}, MODEL)
    assert (input_spec.format, input_spec.sample_rate) == (AudioFormat.PCM_F32LE, MODEL)
    assert output_spec == input_spec


def test_duplex_output_follows_the_input_unless_told():
    input_spec, output_spec = duplex_specs({"format": "pcm_s16le", "rate": "16000"}, MODEL)
    assert (output_spec.format, output_spec.sample_rate) == (AudioFormat.PCM_S16LE, 16000)
    _, other = duplex_specs({"format": "pcm_s16le", "rate": "16000", "output_format": "pcm_f32le"}, MODEL)
    assert (other.format, other.sample_rate) == (AudioFormat.PCM_F32LE, MODEL)  # another format: model rate
    _, rated = duplex_specs({"format": "pcm_s16le", "output_rate": "8000"}, MODEL)
    assert rated.sample_rate == 8000


def test_duplex_defaults_given_by_the_caller_yield_to_the_query():
    input_spec, _ = duplex_specs({}, MODEL, default_format="pcm_s16le", default_rate=16000)
    assert (input_spec.format, input_spec.sample_rate) == (AudioFormat.PCM_S16LE, 16000)
    input_spec, _ = duplex_specs({"format": "pcm_f32le"}, MODEL, default_format="pcm_s16le")
    assert input_spec.format is AudioFormat.PCM_F32LE


@pytest.mark.parametrize(("query", "words"), [
    ({"format": "opus"}, "/api/chat"),
    ({"output_format": "opus"}, "not raw audio"),
    ({"rate": "fast"}, "rate must be a whole number"),
    ({"output_rate": "1.5"}, "output_rate must be a whole number"),
    ({"format": "mp3"}, "mp3"),
])
def test_duplex_refuses_what_the_route_cannot_carry_and_says_why(query, words):
    with pytest.raises(AudioFormatError, match=words):
        duplex_specs(query, MODEL)


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "yes"])
def test_flags_on(value):
    assert wants_duplex({"duplex": value}) and wants_continuous({"continuous": value})


@pytest.mark.parametrize("query", [{}, {"duplex": "0"}, {"duplex": ""}, {"duplex": "no"}, {"continuous": "1"}])
def test_duplex_flag_off(query):
    assert not wants_duplex(query)
    assert wants_continuous(query) == (query.get("continuous") == "1")
