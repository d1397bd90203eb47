"""Decoder / Encoder: round trips per format, streaming state, resampling, errors."""

from __future__ import annotations

import numpy as np
import pytest
import sphn

from duplexrt.audio import (
    AudioFormat,
    AudioFormatError,
    AudioSpec,
    Decoder,
    Encoder,
    Framer,
    make_decoder,
    make_encoder,
)

MODEL_RATE = 24000


def spec(fmt: str, rate: int | None = None) -> AudioSpec:
    return AudioSpec.create(fmt, rate, model_rate=MODEL_RATE)


def sine(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amplitude * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def noise(n: int, seed: int = 0, scale: float = 0.3) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def chunks(data, seed: int, max_size: int):
    """Cut ``data`` at random points (some pieces empty)."""
    rng = np.random.default_rng(seed)
    pos = 0
    while pos < len(data):
        size = int(rng.integers(0, max_size))
        yield data[pos : pos + size]
        pos += size


def decode_all(decoder: Decoder, payloads) -> np.ndarray:
    parts = [decoder.decode(p) for p in payloads]
    return np.concatenate([*parts, decoder.flush()])


def encode_all(encoder: Encoder, pieces) -> bytes:
    return b"".join([*(encoder.encode(p) for p in pieces), encoder.flush()])


def best_lag_correlation(reference: np.ndarray, decoded: np.ndarray, max_lag: int = 800) -> tuple[int, float]:
    """Codec/filter delay is unknown: search it, return (lag, correlation).

    The first and last few hundred samples are left out: codec warm-up at
    the start, zero padding of the last packet at the end.
    """
    skip = 1000
    n = min(len(reference), len(decoded) - max_lag) - 2 * skip
    ref = reference[skip : skip + n].astype(np.float64)
    window = decoded[skip : skip + n + max_lag].astype(np.float64)
    lag = int(np.argmax(np.correlate(window, ref, mode="valid")))
    return lag, float(np.corrcoef(ref, window[lag : lag + n])[0, 1])


# --- factories ------------------------------------------------------------

@pytest.mark.parametrize("fmt", list(AudioFormat))
def test_factories_build_matching_objects(fmt: AudioFormat) -> None:
    s = spec(fmt)
    decoder, encoder = make_decoder(s, MODEL_RATE), make_encoder(s, MODEL_RATE)
    assert isinstance(decoder, Decoder) and isinstance(encoder, Encoder)
    assert decoder.is_encoded is encoder.is_encoded is fmt.is_encoded
    assert decoder.spec == encoder.spec == s
    assert decoder.model_rate == encoder.model_rate == MODEL_RATE


def test_factories_check_rate_against_model() -> None:
    direct = AudioSpec(AudioFormat.PCM_S16LE, 12000)  # bypasses create()
    with pytest.raises(AudioFormatError, match="12000"):
        make_decoder(direct, MODEL_RATE)
    with pytest.raises(AudioFormatError, match="12000"):
        make_encoder(direct, MODEL_RATE)
    with pytest.raises(TypeError):
        make_decoder("pcm_s16le", MODEL_RATE)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="model_rate"):
        make_decoder(spec("pcm_s16le"), 0)


# --- pcm_f32le --------------------------------------------------------------

def test_f32_decode_is_zero_copy_view_of_payload() -> None:
    samples = np.clip(noise(3840), -1.0, 1.0)  # out of range would be clipped: a copy
    payload = samples.astype("<f4").tobytes()
    decoded = make_decoder(spec("pcm_f32le"), MODEL_RATE).decode(payload)
    assert decoded.dtype == np.float32 and decoded.shape == (3840,)
    assert decoded.base is payload
    assert np.shares_memory(decoded, np.frombuffer(payload, np.uint8))
    assert not decoded.flags.writeable
    assert np.array_equal(decoded, samples)


def test_f32_round_trip_is_exact() -> None:
    samples = np.clip(noise(5000, scale=2.0), -1.0, 1.0)  # -1 and 1 themselves pass untouched
    s = spec("pcm_f32le")
    payload = make_encoder(s, MODEL_RATE).encode(samples)
    assert payload == samples.astype("<f4").tobytes()
    decoded = make_decoder(s, MODEL_RATE).decode(payload)
    assert np.array_equal(decoded, samples) and decoded.base is payload


def test_f32_encode_passes_out_of_range_untouched() -> None:
    samples = noise(5000, scale=2.0)  # the model's own output is the model's business
    assert make_encoder(spec("pcm_f32le"), MODEL_RATE).encode(samples) == samples.astype("<f4").tobytes()


@pytest.mark.parametrize("rate", [MODEL_RATE, 16000])
def test_f32_finite_samples_out_of_range_are_clipped(rate: int) -> None:
    samples = noise(3200, seed=5, scale=2.0)
    samples[7] = 1e30
    samples[8] = -3.4e38
    assert np.abs(samples).max() > 1
    payload = samples.tobytes()
    decoded = make_decoder(spec("pcm_f32le", rate), MODEL_RATE).decode(payload)
    expected = make_decoder(spec("pcm_f32le", rate), MODEL_RATE).decode(np.clip(samples, -1, 1).tobytes())
    assert np.array_equal(decoded, expected)
    if rate == MODEL_RATE:
        assert decoded.min() == -1.0 and decoded.max() == 1.0 and decoded[7] == 1.0 and decoded[8] == -1.0
        assert np.frombuffer(payload, np.float32)[7] == 1e30  # the client's bytes are not written to


@pytest.mark.parametrize("bad, rate", [(np.nan, MODEL_RATE), (np.inf, MODEL_RATE), (-np.inf, 16000),
                                       (np.nan, 16000)])
def test_f32_non_finite_message_is_refused_and_the_stream_goes_on(bad: float, rate: int) -> None:
    good = noise(4000, seed=6)
    poisoned = noise(1000, seed=7)
    poisoned[[3, 500, 999]] = bad
    decoder = make_decoder(spec("pcm_f32le", rate), MODEL_RATE)
    first = decoder.decode(good[:2000].tobytes())
    with pytest.raises(AudioFormatError, match=r"3 NaN or infinite samples \(the first at sample 3\)"):
        decoder.decode(poisoned.tobytes())
    rest = decode_all(decoder, [good[2000:].tobytes()])
    # Exactly as if the refused message had never been sent (the resampler's state is untouched).
    assert np.array_equal(np.concatenate([first, rest]), decode_all(make_decoder(spec("pcm_f32le", rate),
                                                                                 MODEL_RATE), [good.tobytes()]))


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_f32_check_by_top_byte_decides_as_the_full_check(kind: type) -> None:
    """The check reads each sample's top byte first (every value of it, with the lowest and
    highest bits below it): whatever it lets through unchecked must be what the reductions would
    let through untouched, and the rest is refused (NaN, infinity) or clipped as before."""
    quiet = noise(1920, seed=8, scale=0.1).clip(-0.49, 0.49)
    for top in range(256):
        for low in (0x000000, 0x7FFFFF, 0x800000, 0xFFFFFF):
            samples = quiet.copy()
            samples.view(np.uint32)[5] = top << 24 | low
            value = samples[5]
            payload = kind(samples.astype("<f4").tobytes())
            decoder = make_decoder(spec("pcm_f32le"), MODEL_RATE)
            if not np.isfinite(value):
                with pytest.raises(AudioFormatError, match=r"1 NaN or infinite sample \(the first at sample 5\)"):
                    decoder.decode(payload)
                continue
            decoded = decoder.decode(payload)
            assert np.array_equal(decoded, np.clip(samples, -1.0, 1.0)), hex(top << 24 | low)
            if abs(value) <= 1.0:  # nothing to clip: the payload's own memory, not a copy
                assert np.shares_memory(decoded, np.frombuffer(payload, np.uint8))


def test_f32_quiet_message_skips_the_reductions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Numpy's reductions release the GIL over more than 500 samples (a context switch of the
    scheduler thread when it waits for the GIL): a message whose samples all stay under 0.5 in
    magnitude is checked without them; one at 0.5 or more takes them, and so does the message
    after it, until the reductions find one under 0.5 again."""
    from duplexrt.audio import formats

    calls: list[int] = []

    def counted_min(samples: np.ndarray) -> np.floating:
        calls.append(samples.size)
        return np.minimum.reduce(samples)

    monkeypatch.setattr(formats, "_MIN", counted_min)
    decoder = make_decoder(spec("pcm_f32le"), MODEL_RATE)
    quiet = noise(3840, seed=9, scale=0.1).clip(-0.4999999, 0.4999999)
    assert np.array_equal(decoder.decode(quiet.tobytes()), quiet) and calls == []
    loud = quiet.copy()
    loud[100] = -0.5
    assert np.array_equal(decoder.decode(loud.tobytes()), loud) and calls == [3840]
    assert np.array_equal(decoder.decode(loud.tobytes()), loud) and calls == [3840] * 2
    assert np.array_equal(decoder.decode(quiet.tobytes()), quiet) and calls == [3840] * 3
    assert np.array_equal(decoder.decode(quiet.tobytes()), quiet) and calls == [3840] * 3
    # Straight to the reductions after loud audio: NaN and out-of-range samples as before.
    decoder.decode(loud.tobytes())
    poisoned = loud.copy()
    poisoned[7] = np.nan
    with pytest.raises(AudioFormatError, match=r"1 NaN or infinite sample \(the first at sample 7\)"):
        decoder.decode(poisoned.tobytes())
    poisoned[7] = 1.5
    assert np.array_equal(decoder.decode(poisoned.tobytes()), np.clip(poisoned, -1.0, 1.0))


def test_f32_encode_accepts_float64() -> None:
    samples = noise(100).astype(np.float64)
    assert make_encoder(spec("pcm_f32le"), MODEL_RATE).encode(samples) == samples.astype("<f4").tobytes()


def test_decode_accepts_bytearray_and_memoryview() -> None:
    samples = np.clip(noise(480), -1.0, 1.0)
    payload = samples.tobytes()
    decoder = make_decoder(spec("pcm_f32le"), MODEL_RATE)
    for view in (bytearray(payload), memoryview(payload), memoryview(samples)):
        assert np.array_equal(decoder.decode(view), samples)
    s16 = make_decoder(spec("pcm_s16le"), MODEL_RATE)
    linear = np.arange(-5, 5, dtype="<i2")
    # A typed memoryview reports len() in items; the length check must use bytes.
    assert np.array_equal(s16.decode(memoryview(linear)) * 32768, linear)


# --- pcm_s16le --------------------------------------------------------------

def test_s16_round_trip_within_half_a_step() -> None:
    samples = np.clip(noise(10_000, scale=0.4), -1, 32767 / 32768)
    s = spec("pcm_s16le")
    payload = make_encoder(s, MODEL_RATE).encode(samples)
    assert len(payload) == 2 * len(samples)
    decoded = make_decoder(s, MODEL_RATE).decode(payload)
    assert decoded.dtype == np.float32
    assert np.max(np.abs(decoded - samples)) <= 0.5 / 32768 + 1e-9


def test_s16_decode_known_values() -> None:
    payload = np.array([0, 1, -1, 16384, -32768, 32767], dtype="<i2").tobytes()
    decoded = make_decoder(spec("pcm_s16le"), MODEL_RATE).decode(payload)
    assert decoded.tolist() == [0.0, 1 / 32768, -1 / 32768, 0.5, -1.0, 32767 / 32768]


def test_s16_encode_clips_and_rounds_to_nearest() -> None:
    x = np.array([1.0, 1.5, -1.0, -3.0, 1.4 / 32768, 1.6 / 32768, -1.6 / 32768, 0.25], dtype=np.float32)
    payload = make_encoder(spec("pcm_s16le"), MODEL_RATE).encode(x)
    assert np.frombuffer(payload, "<i2").tolist() == [32767, 32767, -32768, -32768, 1, 2, -2, 8192]


# --- G.711 ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_g711_round_trip_at_model_rate(fmt: str) -> None:
    samples = np.clip(noise(8000, scale=0.2), -0.95, 0.95)
    s = spec(fmt, MODEL_RATE)  # no resampling: isolates the codec
    payload = make_encoder(s, MODEL_RATE).encode(samples)
    assert len(payload) == len(samples)
    decoded = make_decoder(s, MODEL_RATE).decode(payload)
    assert np.all(np.abs(decoded - samples) <= np.abs(samples) / 32 + 16 / 32768)


@pytest.mark.parametrize("fmt", ["g711_ulaw", "g711_alaw"])
def test_g711_8k_round_trip_through_resamplers(fmt: str) -> None:
    s = spec(fmt)
    assert s.sample_rate == 8000
    samples = sine(440, MODEL_RATE, 1.0)
    encoder, decoder = make_encoder(s, MODEL_RATE), make_decoder(s, MODEL_RATE)
    payload = encode_all(encoder, chunks(samples, seed=1, max_size=3000))
    assert abs(len(payload) - 8000) <= 2  # one byte per 8 kHz sample
    decoded = decode_all(decoder, chunks(payload, seed=2, max_size=1000))
    assert abs(len(decoded) - len(samples)) <= 4
    lag, corr = best_lag_correlation(samples, decoded, max_lag=100)
    assert corr > 0.99


def test_g711_decode_known_bytes() -> None:
    ulaw = make_decoder(spec("g711_ulaw", MODEL_RATE), MODEL_RATE).decode(bytes([0xFF, 0x00, 0x80]))
    assert (ulaw * 32768).tolist() == [0, -32124, 32124]
    alaw = make_decoder(spec("g711_alaw", MODEL_RATE), MODEL_RATE).decode(bytes([0xD5, 0x2A]))
    assert (alaw * 32768).tolist() == [8, -32256]


# --- resampled input/output -------------------------------------------------

def test_s16_16k_input_is_resampled_to_model_rate() -> None:
    s = spec("pcm_s16le", 16000)
    wire = (sine(1000, 16000, 1.0) * 32768).astype("<i2").tobytes()
    decoder = make_decoder(s, MODEL_RATE)
    out = decode_all(decoder, [wire[i : i + 640] for i in range(0, len(wire), 640)])  # 20 ms messages
    assert out.dtype == np.float32
    assert abs(len(out) - 24000) <= 2
    steady = out[1200:-1200]
    peak_hz = np.argmax(np.abs(np.fft.rfft(steady * np.hanning(len(steady))))) * 24000 / len(steady)
    assert abs(peak_hz - 1000) < 2
    assert np.max(np.abs(steady)) == pytest.approx(0.5, abs=0.01)


def test_resampled_decoding_does_not_depend_on_message_size() -> None:
    s = spec("pcm_f32le", 44100)
    wire = noise(44100, seed=5).tobytes()
    whole = decode_all(make_decoder(s, MODEL_RATE), [wire])
    cut = decode_all(make_decoder(s, MODEL_RATE), [wire[i : i + 4 * 777] for i in range(0, len(wire), 4 * 777)])
    assert np.array_equal(whole, cut)
    assert abs(len(whole) - 24000) <= 2


def test_encoder_resamples_to_wire_rate() -> None:
    s = spec("pcm_s16le", 16000)
    encoder = make_encoder(s, MODEL_RATE)
    samples = sine(1000, MODEL_RATE, 1.0)
    payload = encode_all(encoder, [samples[i : i + 1920] for i in range(0, len(samples), 1920)])
    assert abs(len(payload) // 2 - 16000) <= 2
    back = decode_all(make_decoder(s, MODEL_RATE), [payload])
    lag, corr = best_lag_correlation(samples, back, max_lag=200)
    assert corr > 0.999


def test_flush_without_resampler_is_empty() -> None:
    s = spec("pcm_s16le")
    assert make_decoder(s, MODEL_RATE).flush().size == 0
    assert make_encoder(s, MODEL_RATE).flush() == b""


# --- errors -----------------------------------------------------------------

@pytest.mark.parametrize(
    ("fmt", "size", "message"),
    [
        ("pcm_s16le", 3, "pcm_s16le payload of 3 bytes is not a whole number of 2-byte samples"),
        ("pcm_s16le", 1, "pcm_s16le payload of 1 byte is not a whole number of 2-byte samples"),
        ("pcm_f32le", 6, "pcm_f32le payload of 6 bytes is not a whole number of 4-byte samples"),
    ],
)
def test_partial_sample_payload_is_rejected(fmt: str, size: int, message: str) -> None:
    decoder = make_decoder(spec(fmt), MODEL_RATE)
    with pytest.raises(AudioFormatError) as info:
        decoder.decode(bytes(size))
    assert str(info.value) == message


def test_decoder_state_survives_a_rejected_payload() -> None:
    s = spec("pcm_s16le", 16000)
    wire = (noise(3200, seed=7) * 32768).astype("<i2").tobytes()
    reference = decode_all(make_decoder(s, MODEL_RATE), [wire[:2000], wire[2000:]])
    decoder = make_decoder(s, MODEL_RATE)
    first = decoder.decode(wire[:2000])
    with pytest.raises(AudioFormatError):
        decoder.decode(b"\x01\x02\x03")
    rest = decoder.decode(wire[2000:])
    assert np.array_equal(np.concatenate([first, rest, decoder.flush()]), reference)


def test_empty_payload_decodes_to_nothing() -> None:
    for fmt in ("pcm_f32le", "pcm_s16le", "g711_ulaw", "opus"):
        out = make_decoder(spec(fmt), MODEL_RATE).decode(b"")
        assert out.dtype == np.float32 and out.size == 0


# --- Opus -------------------------------------------------------------------

@pytest.fixture(scope="module")
def opus_stream() -> tuple[np.ndarray, bytes]:
    """Two seconds of 440 Hz at 24 kHz, encoded independently with sphn."""
    samples = sine(440, 24000, 2.0)
    writer = sphn.OpusStreamWriter(24000)
    data = b"".join(writer.append_pcm(samples[i : i + 960]) for i in range(0, len(samples), 960))
    return samples, data


def test_opus_round_trip_correlates() -> None:
    samples = sine(440, MODEL_RATE, 2.0)
    s = spec("opus")
    payload = encode_all(make_encoder(s, MODEL_RATE), [samples[i : i + 1920] for i in range(0, len(samples), 1920)])
    assert payload.startswith(b"OggS")
    decoded = decode_all(make_decoder(s, MODEL_RATE), [payload])
    assert decoded.dtype == np.float32
    assert len(decoded) == len(samples)  # 48000 is a whole number of packets
    lag, corr = best_lag_correlation(samples, decoded)
    assert corr > 0.95


@pytest.mark.parametrize("rate", [24000, 48000, 16000])
def test_opus_delay_is_a_few_milliseconds(rate: int) -> None:
    # A pure sine cannot pin the delay down (it aliases every period), so
    # measure it with a chirp: libopus adds 6.5 ms of look-ahead and sphn's
    # reader does not trim the pre-skip, so about 156 samples at 24 kHz.
    t = np.arange(2 * MODEL_RATE) / MODEL_RATE
    chirp = (0.5 * np.sin(2 * np.pi * (200 * t + 400 * t**2))).astype(np.float32)
    s = spec("opus", rate)
    decoded = decode_all(make_decoder(s, MODEL_RATE), [encode_all(make_encoder(s, MODEL_RATE), [chirp])])
    lag, corr = best_lag_correlation(chirp, decoded)
    assert corr > 0.95
    assert 0 < lag * 1000 / MODEL_RATE < 10


@pytest.mark.parametrize("rate", [48000, 16000])
def test_opus_round_trip_with_resampling(rate: int) -> None:
    samples = sine(440, MODEL_RATE, 1.0)
    s = spec("opus", rate)
    payload = encode_all(make_encoder(s, MODEL_RATE), chunks(samples, seed=rate, max_size=4000))
    decoded = decode_all(make_decoder(s, MODEL_RATE), chunks(payload, seed=rate + 1, max_size=500))
    assert abs(len(decoded) - len(samples)) <= 960 * MODEL_RATE // rate + 4  # last packet padded
    lag, corr = best_lag_correlation(samples, decoded)
    assert corr > 0.95


def test_opus_decode_split_anywhere_matches_whole(opus_stream) -> None:
    _, data = opus_stream
    whole = make_decoder(spec("opus"), MODEL_RATE).decode(data)
    assert len(whole) == 48000
    for seed in range(3):
        decoder = make_decoder(spec("opus"), MODEL_RATE)
        pieces = [decoder.decode(p) for p in chunks(data, seed=seed, max_size=400)]
        assert np.array_equal(np.concatenate(pieces), whole)
    byte_by_byte = make_decoder(spec("opus"), MODEL_RATE)
    assert np.array_equal(np.concatenate([byte_by_byte.decode(data[i : i + 1]) for i in range(len(data))]), whole)


@pytest.mark.parametrize("rate", [8000, 24000, 48000])
def test_opus_long_recording_in_one_message(rate: int) -> None:
    # sphn cannot decode more than 5 s per call; the decoder must hide that.
    samples = noise(MODEL_RATE * 12, seed=rate, scale=0.1)
    samples[: MODEL_RATE * 6] = 0.0  # silence packs the most audio per byte
    s = spec("opus", rate)
    payload = encode_all(make_encoder(s, MODEL_RATE), [samples])
    whole = decode_all(make_decoder(s, MODEL_RATE), [payload])
    pieces = decode_all(make_decoder(s, MODEL_RATE), list(chunks(payload, seed=1, max_size=300)))
    assert np.array_equal(whole, pieces)
    assert abs(len(whole) - len(samples)) <= 960 * MODEL_RATE // rate + 4


def test_opus_decode_accepts_bytearray_and_memoryview(opus_stream) -> None:
    _, data = opus_stream
    whole = make_decoder(spec("opus"), MODEL_RATE).decode(data)
    decoder = make_decoder(spec("opus"), MODEL_RATE)
    half = len(data) // 2
    out = np.concatenate([decoder.decode(bytearray(data[:half])), decoder.decode(memoryview(data)[half:])])
    assert np.array_equal(out, whole)


def test_opus_encode_independent_of_chunking() -> None:
    samples = noise(30_000, seed=11, scale=0.1)
    s = spec("opus")
    whole = encode_all(make_encoder(s, MODEL_RATE), [samples])
    chunked = encode_all(make_encoder(s, MODEL_RATE), chunks(samples, seed=12, max_size=2500))
    assert chunked == whole


def test_opus_encoder_buffers_to_whole_packets_and_flush_pads() -> None:
    encoder = make_encoder(spec("opus"), MODEL_RATE)
    assert encoder.encode(np.zeros(500, dtype=np.float32)) == b""  # less than one packet
    first = encoder.encode(np.zeros(500, dtype=np.float32))  # completes packet one
    assert first.startswith(b"OggS")
    tail = encoder.flush()  # 40 samples held: padded to a full packet
    decoded = make_decoder(spec("opus"), MODEL_RATE).decode(first + tail)
    assert len(decoded) == 2 * 960


@pytest.mark.parametrize(
    "garbage",
    [b"garbage" * 10, b"OggS" + bytes(100), np.random.default_rng(0).bytes(5000)],
)
def test_opus_garbage_raises_format_error(garbage: bytes) -> None:
    decoder = make_decoder(spec("opus"), MODEL_RATE)
    with pytest.raises(AudioFormatError, match="corrupt Ogg Opus stream"):
        decoder.decode(garbage)
    # An Ogg stream cannot resync: the decoder stays failed, with a clear error.
    with pytest.raises(AudioFormatError, match="start a new stream"):
        decoder.decode(b"OggS")


def test_opus_garbage_mid_stream(opus_stream) -> None:
    _, data = opus_stream
    decoder = make_decoder(spec("opus"), MODEL_RATE)
    good = decoder.decode(data[:2000])
    assert good.size > 0
    with pytest.raises(AudioFormatError):
        decoder.decode(b"x" * 300 + data[2000:])


def test_opus_mutated_streams_never_crash(opus_stream) -> None:
    """Random damage either decodes or raises AudioFormatError, nothing else."""
    _, data = opus_stream
    rng = np.random.default_rng(2024)
    failures = 0
    for _ in range(60):
        damaged = bytearray(data)
        for _ in range(int(rng.integers(1, 10))):
            damaged[int(rng.integers(len(damaged)))] = int(rng.integers(256))
        decoder = make_decoder(spec("opus"), MODEL_RATE)
        try:
            for piece in chunks(bytes(damaged), seed=int(rng.integers(1 << 30)), max_size=2000):
                assert decoder.decode(piece).dtype == np.float32
        except AudioFormatError:
            failures += 1
    assert failures > 0  # the damage was real enough to be noticed sometimes


# --- decode + frame pipeline ------------------------------------------------

@pytest.mark.parametrize(("fmt", "rate"), [("pcm_f32le", 24000), ("pcm_s16le", 16000), ("g711_ulaw", 8000)])
def test_decode_then_frame_yields_model_frames(fmt: str, rate: int) -> None:
    s = spec(fmt, rate)
    samples = sine(300, rate, 1.0, amplitude=0.3)
    payload = make_encoder(AudioSpec.create(fmt, rate, model_rate=rate), rate).encode(samples)
    sample_bytes = s.format.bytes_per_sample
    decoder, framer = make_decoder(s, MODEL_RATE), Framer(1920)
    frames = []
    step = sample_bytes * (rate // 50)  # 20 ms messages
    for i in range(0, len(payload), step):
        frames += framer.push(decoder.decode(payload[i : i + step]))
    frames += framer.push(decoder.flush())
    assert all(f.shape == (1920,) and f.dtype == np.float32 for f in frames)
    assert len(frames) == 24000 // 1920


@pytest.mark.parametrize("wire", ["pcm_f32le", "pcm_s16le", "g711_ulaw"])
@pytest.mark.parametrize("rate", [24000, 16000])
def test_encoding_rows_is_encoding_them_joined(wire, rate):
    """``encode_rows`` (what a session sends a batch of frames with) gives exactly the bytes of
    ``encode`` over the frames joined, whether or not the format can skip the join."""
    rng = np.random.default_rng(7)
    rows = list(np.clip(rng.standard_normal((3, 1920)) * 0.3, -1, 1).astype(np.float32))
    spec = AudioSpec.create(AudioFormat(wire), rate, model_rate=24000)
    joined, by_rows = make_encoder(spec, 24000), make_encoder(spec, 24000)
    expected = joined.encode(np.concatenate(rows[:2])) + joined.encode(rows[2])
    assert by_rows.encode_rows(rows[:2]) + by_rows.encode_rows(rows[2:]) == expected
