"""The server VAD's events against its rules applied to every window, one by one.

``InputVad`` leaves the noise check out wherever its answer cannot change an event (while speech
goes on, until a stop could be due).  These tests hold it to a plain reference that judges every
window, WebRTC's VAD then the noise check, with the same rules: on voiced sound, hiss (which
WebRTC's VAD calls speech and the noise check does not), silence and mixtures, in appends of
every size, with the pause length, padding and aggressiveness a client may set, and with the
format and settings changed mid-stream.  Events and their times must be the same, exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import webrtcvad

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.protocols import vad as vad_module
from duplexrt.protocols.vad import InputVad, VadSettings, _flatness


class EveryWindow:
    """REFERENCE: the VAD's rules, every window judged by both checks (pcm16 at 8, 16 or 24 kHz)."""

    def __init__(self, settings: VadSettings, rate: int) -> None:
        self.settings = settings
        self.vad = webrtcvad.Vad(settings.mode)
        self.elapsed = self.speech = self.silence = 0.0
        self.speaking = False
        self.set_rate(rate)

    def set_rate(self, rate: int) -> None:
        self.rate, self.size = rate, round(rate * 0.02)
        self.window_ms = self.size * 1000 / rate
        self.carry = np.empty(0, np.int16)

    def feed(self, raw: bytes) -> list[tuple[str, int]]:
        samples = np.concatenate([self.carry, np.frombuffer(raw, "<i2")])
        whole = samples.size // self.size
        self.carry = samples[whole * self.size:]
        events = []
        for k in range(whole):
            window, rate = samples[k * self.size:(k + 1) * self.size], self.rate
            if rate == 24000:  # the mean of each 3 samples, rounded down
                window, rate = (window.reshape(-1, 3).astype(np.int32).sum(axis=1) // 3).astype(np.int16), 8000
            said = self.vad.is_speech(window.tobytes(), rate) and float(_flatness(window[None])[0]) < 0.4
            self.elapsed += self.window_ms
            if said:
                self.speech += self.window_ms
                self.silence = 0.0
                if not self.speaking and self.speech >= 60:
                    self.speaking = True
                    events.append(("started", max(0, round(self.elapsed - self.speech - self.settings.prefix_padding_ms))))
            else:
                self.speech = 0.0
                if self.speaking:
                    self.silence += self.window_ms
                    if self.silence >= self.settings.silence_duration_ms:
                        self.speaking = False
                        self.silence = 0.0
                        events.append(("stopped", round(self.elapsed)))
        return events


def sound(rng: np.random.Generator, rate: int, seconds: float) -> np.ndarray:
    """Segments of voiced sound, hiss, silence and both at once, 20 to 900 ms each."""
    pieces, total = [], int(rate * seconds)
    while sum(piece.size for piece in pieces) < total:
        size = int(rate * rng.uniform(0.02, 0.9))
        t = np.arange(size) / rate
        kind = rng.choice(["voice", "hiss", "silence", "both"], p=[0.4, 0.2, 0.25, 0.15])
        f0 = rng.uniform(90, 260)
        voice = sum(np.sin(2 * np.pi * f0 * h * t + h) / h for h in range(1, 8)) * rng.uniform(2000, 7000)
        hiss = rng.standard_normal(size) * rng.uniform(1500, 6000)
        pieces.append({"voice": voice, "hiss": hiss, "silence": rng.standard_normal(size) * 3,
                       "both": voice + hiss * rng.uniform(0.2, 1.2)}[kind])
    return np.clip(np.concatenate(pieces)[:total], -32768, 32767).astype("<i2")


def spec(rate: int) -> AudioSpec:
    return AudioSpec.create(AudioFormat.PCM_S16LE, rate, model_rate=24000)


@pytest.mark.parametrize("seed", range(24))
def test_events_are_those_of_judging_every_window(seed):
    rng = np.random.default_rng(seed)
    settings = VadSettings(threshold=float(rng.choice([0.0, 0.5, 1.0])),
                           prefix_padding_ms=int(rng.choice([0, 300])),
                           silence_duration_ms=int(rng.choice([0, 20, 60, 140, 200, 500, 700])))
    rate = int(rng.choice([24000, 16000, 8000]))
    ours, reference = InputVad(settings, spec(rate)), EveryWindow(settings, rate)
    raw = sound(rng, rate, 8.0).tobytes()
    fixed = int(rng.choice([0, 1920 * rate // 24000]))  # 80 ms appends, or sizes at random
    got, expected, at = [], [], 0
    while at < len(raw):
        size = 2 * (fixed or int(rng.integers(1, 2400)))
        got += ours.feed(raw[at:at + size])
        expected += reference.feed(raw[at:at + size])
        at += size
    assert got == expected


def test_the_reference_runs_see_starts_and_stops_in_most_streams():
    """The comparison above is not vacuous: the streams do start and stop speech, often."""
    starts = 0
    for seed in range(6):
        reference = EveryWindow(VadSettings(silence_duration_ms=200), 24000)
        starts += sum(kind == "started" for kind, _ in reference.feed(sound(np.random.default_rng(seed), 24000, 8.0).tobytes()))
    assert starts >= 12


@pytest.mark.parametrize("seed", range(8))
def test_format_and_settings_changes_mid_stream_change_nothing_else(seed):
    """A new input rate (a new window length) or new settings in the middle of a pause: the
    silence counted so far is settled as it was counted."""
    rng = np.random.default_rng(100 + seed)
    settings = VadSettings(silence_duration_ms=500)
    rate = 24000
    ours, reference = InputVad(settings, spec(rate)), EveryWindow(settings, rate)
    got, expected = [], []
    for _ in range(12):
        raw = sound(rng, rate, rng.uniform(0.3, 1.5)).tobytes()
        size = 2 * int(rng.integers(100, 2400))
        for at in range(0, len(raw), size):
            got += ours.feed(raw[at:at + size])
            expected += reference.feed(raw[at:at + size])
        change = rng.choice(["rate", "settings", "mode"])
        if change == "rate":
            rate = 16000 if rate == 24000 else 24000
            ours.set_spec(spec(rate))
            reference.set_rate(rate)
        elif change == "settings":
            new = VadSettings(threshold=settings.threshold, silence_duration_ms=int(rng.choice([40, 200, 800])),
                              prefix_padding_ms=int(rng.choice([0, 300])))
            ours.settings = reference.settings = settings = new
        else:
            mode = int(rng.integers(0, 4))
            ours.set_mode(mode)
            reference.vad.set_mode(mode)
    assert got == expected


def test_a_speaker_who_keeps_talking_costs_a_noise_check_per_pause_length(monkeypatch):
    """Voiced sound for 10 s in 80 ms appends: once speech has started, the noise check runs about
    once per silence_duration_ms (500 ms: 25 windows), not once per append (125)."""
    calls = []
    flatness = vad_module._flatness

    def counted(windows):
        calls.append(len(windows))
        return flatness(windows)

    monkeypatch.setattr(vad_module, "_flatness", counted)
    t = np.arange(24000 * 10) / 24000
    voice = (sum(np.sin(2 * np.pi * 140 * h * t + h) / h for h in range(1, 8)) * 5000).astype("<i2").tobytes()
    ours = InputVad(VadSettings(), spec(24000))
    events = [event for at in range(0, len(voice), 3840) for event in ours.feed(voice[at:at + 3840])]
    assert [kind for kind, _ in events] == ["started"]
    assert len(calls) <= 500 // 25 + 3, calls


def test_24k_reaches_webrtc_s_vad_as_the_floor_of_each_three_samples_mean():
    """24 kHz (the protocol's rate, the only allowed one that needs it) is decimated to 8 kHz by
    the mean of each run of three samples, rounded down, exactly, full scale included."""
    rate = 24000
    rng = np.random.default_rng(rate)
    vad = InputVad(VadSettings(), spec(rate))
    factor = rate // 8000
    samples = rng.integers(-32768, 32768, size=factor * 160 * 5).astype(np.int16)
    samples[:factor * 4] = [-32768] * (factor * 2) + [32767] * (factor * 2)
    expected = (samples.reshape(-1, factor).astype(np.int64).sum(axis=1) // factor).astype(np.int16)
    got = vad._for_vad(samples, 5)
    assert got.shape == (5, 160) and got.dtype == np.int16
    np.testing.assert_array_equal(got.ravel(), expected)


@pytest.mark.parametrize(("append_ms", "most_calls", "most_rows"), [(20, 100 // 3 + 1, 100 // 3 + 1), (80, 25, 50)])
def test_steady_hiss_costs_a_noise_check_per_start_length_not_per_window(monkeypatch, append_ms, most_calls, most_rows):
    """2 s of loud hiss (WebRTC's VAD calls it speech; the noise check does not): no start, and the
    check runs once per 60 ms of it with 20 ms appends (not once per append), and on the windows
    that matter with 80 ms appends (two of each four)."""
    calls: list[int] = []
    flatness = vad_module._flatness

    def counted(windows):
        calls.append(len(windows))
        return flatness(windows)

    monkeypatch.setattr(vad_module, "_flatness", counted)
    hiss = (np.random.default_rng(3).standard_normal(24000 * 2) * 5000).astype("<i2").tobytes()
    ours = InputVad(VadSettings(), spec(24000))
    size = 48 * append_ms
    assert [event for at in range(0, len(hiss), size) for event in ours.feed(hiss[at:at + size])] == []
    assert len(calls) <= most_calls and sum(calls) <= most_rows, calls


@pytest.mark.parametrize("size", [160, 320, 640, 960, 161])
def test_the_noise_check_s_fft_is_numpy_s_rfft_bit_for_bit(size):
    from duplexrt.protocols.vad_entry_points import rfft_rows

    rows = (np.random.default_rng(size).standard_normal((5, size)) * 3000).astype(np.float32)
    expected = np.fft.rfft(rows, axis=1)
    got = rfft_rows(rows)
    assert got.dtype == expected.dtype == np.complex64
    assert got.tobytes() == expected.tobytes()
    assert rfft_rows(rows[2:3]).tobytes() == expected[2:3].tobytes()


def test_webrtc_s_vad_is_asked_through_its_c_function_with_the_same_answers():
    """The speech test calls ``_webrtcvad.process`` itself (no Python wrapper per window) and
    says what ``Vad.is_speech`` says, window for window, at every rate the VAD uses."""
    from duplexrt.protocols import vad_entry_points

    assert vad_entry_points._C_PROCESS_AGREES and vad_entry_points._UFUNC_AGREES  # this install takes the cheap calls
    rng = np.random.default_rng(5)
    for rate in (8000, 16000, 32000, 48000):
        size = rate // 50
        t = np.arange(size * 200) / rate
        signal = np.concatenate([np.sin(2 * np.pi * 180 * t[:size * 100]) * 4000,
                                 rng.standard_normal(size * 100) * rng.uniform(10, 4000)]).astype("<i2")
        wrapped = webrtcvad.Vad(2)
        speech = vad_entry_points.speech_test(webrtcvad.Vad(2))
        for at in range(0, signal.size, size):
            window = signal[at:at + size].tobytes()
            assert bool(speech(window, rate, size)) == wrapped.is_speech(window, rate)
