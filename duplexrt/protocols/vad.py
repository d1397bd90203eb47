"""Speech detection for the Realtime protocol: a VAD on the client's input, a level gate on the output.

Both work on the audio as it is on the wire (pcm16 or G.711 at the client's rate), inside the
translator: they need no thread and no decoded copy from the session.

* ``InputVad`` is the server VAD that ``turn_detection: {"type": "server_vad"}`` asks for.  The
  speech/non-speech decision per 20 ms window is WebRTC's VAD (``webrtcvad-wheels``: a small C
  extension, no model file), which accepts 8, 16, 32 or 48 kHz; other rates are brought to one of
  those first.  A spectral-flatness check keeps steady broadband noise, which WebRTC's VAD
  calls speech, from starting a turn.  Around it sit the protocol's rules: speech starts after a short run of speech
  windows (reported ``prefix_padding_ms`` earlier), and stops after ``silence_duration_ms`` of
  non-speech.
* ``OutputGate`` tells whether a batch of the model's output is sound or silence, by its mean
  power against a dBFS threshold: a full-duplex model's continuous output is cut into responses
  at its pauses.
"""

from __future__ import annotations

import numpy as np
import webrtcvad

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.audio.g711 import alaw_decode, ulaw_decode
from duplexrt.protocols.vad_entry_points import rfft_rows, speech_test

__all__ = ["InputVad", "OutputGate", "VadSettings"]

#: The rates WebRTC's VAD takes, and the window it is asked about.
_VAD_RATES = (8000, 16000, 32000, 48000)
_WINDOW_MS = 20
#: Speech must last this long before it counts as started: one speech-like click is not a turn.
_MIN_SPEECH_MS = 60
#: WebRTC's VAD takes loud steady broadband noise (a fan, hiss) for speech; a window that flat
#: (white noise sits near 0.5, voiced speech near 0.1) is not speech whatever it says.
_MAX_FLATNESS = 0.4
_NO_SAMPLES = np.empty(0, dtype=np.int16)


def _as_int16(raw: bytes, fmt: AudioFormat) -> np.ndarray:
    """The wire audio as int16 samples (the translator only lets pcm16 and G.711 in)."""
    if fmt is AudioFormat.PCM_S16LE:
        return np.frombuffer(raw, dtype="<i2")
    codes = np.frombuffer(raw, dtype=np.uint8)
    decoded = ulaw_decode(codes) if fmt is AudioFormat.G711_ULAW else alaw_decode(codes)
    return (decoded * 32767.0).astype(np.int16)


class VadSettings:
    """``turn_detection`` as the server applies it (server_vad; semantic_vad is served by it)."""

    __slots__ = ("threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                 "interrupt_response")

    def __init__(self, threshold: float = 0.5, prefix_padding_ms: int = 300,
                 silence_duration_ms: int = 500, create_response: bool = True,
                 interrupt_response: bool = True) -> None:
        self.threshold = threshold
        self.prefix_padding_ms = prefix_padding_ms
        self.silence_duration_ms = silence_duration_ms
        self.create_response = create_response
        self.interrupt_response = interrupt_response

    @property
    def mode(self) -> int:
        """WebRTC's aggressiveness (0..3) for the protocol's threshold (0..1): a higher threshold
        asks for more certainty before calling a window speech."""
        return min(3, max(0, round(self.threshold * 3)))


#: A window in a run the noise check has not settled: (its append's windows, its row) where WebRTC's
#: VAD heard speech and the noise check has not judged it; True or False where the verdict is known.
_Entry = tuple[np.ndarray, int] | bool


class InputVad:
    """Speech start and stop over a stream of client audio, in milliseconds of that audio.

    The noise check (an FFT per window) is the VAD's dearest part, so it is asked only where its
    answer can change an event.  A window WebRTC's VAD calls speech is left unjudged and counted
    the way that cannot miss an event: as speech toward a start (which needs ``_MIN_SPEECH_MS`` of
    it), as noise toward a stop (``silence_duration_ms``).  Only when that count reaches its bound
    are the unjudged windows judged, the latest first (one batch with the rest of the append, then
    earlier ones only if the answer still depends on them), and the run counted again from the
    last window that breaks it.  A speaker who keeps talking costs one noise check per
    ``silence_duration_ms`` instead of one per append; steady noise before speech, one batch of
    the windows that matter per append (per ``_MIN_SPEECH_MS`` with shorter appends).  The events
    and their times are those of judging every window (tests/test_vad_decisions.py).
    """

    def __init__(self, settings: VadSettings, spec: AudioSpec) -> None:
        self.settings = settings
        self._vad = webrtcvad.Vad(settings.mode)
        self._speech_test = speech_test(self._vad)  # WebRTC's answer for one window, at the least cost
        self.elapsed_ms = 0.0  # audio fed so far
        self.speaking = False
        # The current run toward an event, unjudged windows counted as above (exact when none
        # are left): speech before speech has started, silence after; and the windows since the
        # run's first unjudged one, in order.
        self._speech_ms = 0.0
        self._silence_ms = 0.0
        self._pending: list[_Entry] = []
        self.set_spec(spec)

    def set_mode(self, mode: int) -> None:
        self._vad.set_mode(mode)

    def set_spec(self, spec: AudioSpec) -> None:
        """The client's input format changed: what is still carried is dropped (a part window)."""
        if self._pending:  # counted in the old window length: settled before it changes
            if self.speaking:
                self._silence_ms = self._settle(self._pending, self._silence_ms, True)
            else:
                self._speech_ms = self._settle(self._pending, self._speech_ms, False)
            self._pending = []
        self._format = spec.format
        rate = spec.sample_rate
        self._in_window = max(1, round(rate * _WINDOW_MS / 1000))
        if rate in _VAD_RATES:
            self._vad_rate = rate
        elif rate % 8000 == 0 and rate < 8000 * 16:
            self._vad_rate = 8000  # whole-number decimation, averaged: cheap and alias-damped
        else:
            self._vad_rate = 16000
        self._vad_window = self._vad_rate * _WINDOW_MS // 1000
        self._window_ms = self._in_window * 1000 / rate
        self._carry = _NO_SAMPLES

    def feed(self, raw: bytes) -> list[tuple[str, int]]:
        """Decide on the whole windows ``raw`` completes; return the transitions it brings, as
        ``("started", audio_start_ms)`` or ``("stopped", audio_end_ms)``."""
        samples = _as_int16(raw, self._format)
        carry = self._carry
        if carry.size:
            samples = np.concatenate((carry, samples))
        in_window = self._in_window
        whole = samples.size // in_window
        used = whole * in_window
        # Only a part window is carried: an append of whole windows (the usual case) copies nothing.
        self._carry = samples[used:].copy() if used < samples.size else _NO_SAMPLES
        if not whole:
            return []
        windows = self._for_vad(samples[:used] if used < samples.size else samples, whole)
        rate, size = self._vad_rate, windows.shape[1]
        # One copy of all the windows, read through views: not one array view and copy per window.
        # Each window's verdict: None where WebRTC's VAD heard speech (the noise check to judge).
        step = size * 2
        with memoryview(windows.tobytes()) as block:
            speech = self._speech_test
            verdicts: list[bool | None] = [None if speech(block[at:at + step], rate, size) else False
                                           for at in range(0, whole * step, step)]
        # The run counters in locals, stored back once: this loop runs per 20 ms window.
        events: list[tuple[str, int]] = []
        window_ms = self._window_ms
        settings = self.settings
        elapsed, speech_ms, silence_ms, speaking = self.elapsed_ms, self._speech_ms, self._silence_ms, self.speaking
        pending = self._pending
        for index in range(whole):
            said = verdicts[index]
            elapsed += window_ms
            if not speaking:
                if said is False:
                    speech_ms = 0.0
                    pending = []
                    continue
                if said is None:
                    pending.append((windows, index))
                elif pending:
                    pending.append(True)
                speech_ms += window_ms
                if speech_ms < _MIN_SPEECH_MS:
                    continue  # no start here even if every unjudged window is speech
                if pending:  # a start may be due: judge, and count the run from the last noise
                    speech_ms = self._settle(pending, speech_ms, False, windows, verdicts, index)
                    pending = []
                    if speech_ms < _MIN_SPEECH_MS:
                        continue
                speaking = True
                start = elapsed - speech_ms - settings.prefix_padding_ms
                events.append(("started", max(0, round(start))))
                continue
            if said:  # judged speech (with an earlier window): the silence run ends
                silence_ms = 0.0
                pending = []
                continue
            if said is None:
                pending.append((windows, index))
            elif pending:
                pending.append(False)
            silence_ms += window_ms
            if silence_ms < settings.silence_duration_ms:
                continue  # no stop here even if every unjudged window is noise
            if pending:  # a stop may be due: judge, and count the run from the last speech
                silence_ms = self._settle(pending, silence_ms, True, windows, verdicts, index)
                pending = []
                if verdicts[index]:
                    continue  # this window is speech: no stop here, however short the pause asked
            if silence_ms >= settings.silence_duration_ms:
                speaking = False
                speech_ms = silence_ms = 0.0
                events.append(("stopped", round(elapsed)))
        self.elapsed_ms, self._speech_ms, self._silence_ms, self.speaking = elapsed, speech_ms, silence_ms, speaking
        self._pending = pending
        return events

    def _settle(self, pending: list[_Entry], run_ms: float, breaks: bool, windows: np.ndarray | None = None,
                verdicts: list[bool | None] | None = None, index: int = -1) -> float:
        """The run at the last window of ``pending`` once its windows are judged: counted from the
        last window whose verdict is ``breaks`` (speech breaks a silence run, noise a speech run),
        or ``run_ms`` if none is.  Judged from the latest back, stopping at the first that breaks
        the run: this append's ``windows`` from ``index`` (the last of ``pending``) to the end
        first (their ``verdicts`` are filled in), then its earlier ones, then all earlier
        appends' at once, each in one batch."""
        if windows is not None and verdicts is not None:
            _judge(windows, verdicts, index)
        earlier: dict[tuple[int, int], bool] | None = None  # (id(block), row) -> speech, earlier appends
        for position in range(len(pending) - 1, -1, -1):
            entry = pending[position]
            if entry is True or entry is False:
                said = entry
            else:
                block, row = entry
                if block is windows and verdicts is not None:
                    if verdicts[row] is None:  # this append, before index: judge them all at once
                        _judge(windows, verdicts, min(other[1] for other in pending
                                                      if type(other) is tuple and other[0] is windows))
                    said = bool(verdicts[row])
                else:
                    if earlier is None:  # every earlier append's unjudged windows, in one batch
                        older = [other for other in pending if type(other) is tuple and other[0] is not windows]
                        flatness = _flatness(np.stack([rows[at] for rows, at in older])).tolist()
                        earlier = {(id(rows), at): value < _MAX_FLATNESS
                                   for (rows, at), value in zip(older, flatness, strict=True)}
                    said = earlier[(id(block), row)]
            if said is breaks:  # the run restarts after it, counted as the per-window loop counts it
                run = 0.0
                for _ in range(len(pending) - 1 - position):
                    run += self._window_ms
                return run
        return run_ms

    def _for_vad(self, block: np.ndarray, whole: int) -> np.ndarray:
        """``whole`` windows (one a row) at a rate WebRTC's VAD takes."""
        size = self._vad_window
        if self._in_window == size:
            return block.reshape(whole, size)
        if self._in_window % size == 0:  # average each run of ``factor`` samples (strided adds)
            factor = self._in_window // size
            # In place, one ufunc call a step: the first add widens, the rest reuse its array.
            total = np.add(block[0::factor], block[1::factor], dtype=np.int32)
            for offset in range(2, factor):
                np.add(total, block[offset::factor], out=total)
            np.floor_divide(total, factor, out=total)
            return total.astype(np.int16).reshape(whole, size)
        windows = block.reshape(whole, self._in_window)
        positions = np.linspace(0, windows.shape[1] - 1, size)
        grid = np.arange(windows.shape[1])
        return np.stack([np.interp(positions, grid, row) for row in windows]).astype(np.int16)


def _judge(windows: np.ndarray, verdicts: list[bool | None], start: int) -> None:
    """Give every unjudged window of ``verdicts`` from ``start`` on the noise check's answer, in
    one batch (numpy's cost is per call: one FFT over several windows costs about one window's)."""
    last = len(verdicts) - 1
    while last >= start and verdicts[last] is not None:
        last -= 1
    if last < start:
        return
    flatness = _flatness(windows[start:last + 1]).tolist()
    for at in range(start, last + 1):
        if verdicts[at] is None:
            verdicts[at] = flatness[at - start] < _MAX_FLATNESS


def _flatness(windows: np.ndarray) -> np.ndarray:
    """Spectral flatness per window (1: white noise, near 0: a voice's harmonics)."""
    # Ufunc reductions and in-place steps, not ndarray.mean and temporaries: on speech-like
    # input this runs for every append, and numpy's cost per call is most of its time.
    power = np.abs(rfft_rows(windows.astype(np.float32)))
    np.multiply(power, power, out=power)
    power += 1e-3
    bins = power.shape[1]
    log_mean = np.add.reduce(np.log(power), axis=1)
    log_mean /= bins
    return np.exp(log_mean, out=log_mean) * bins / np.add.reduce(power, axis=1)


class OutputGate:
    """Sound or silence, for one batch of model output in the client's output format."""

    def __init__(self, threshold_dbfs: float, spec: AudioSpec) -> None:
        self.threshold_dbfs = threshold_dbfs
        self.set_spec(spec)

    def set_spec(self, spec: AudioSpec) -> None:
        self._format = spec.format
        # Mean power of a full-scale int16 signal at the threshold: compared without a log.
        self._floor = (10 ** (self.threshold_dbfs / 20) * 32768.0) ** 2

    def quiet_tail(self, payload: bytes, frames: int) -> int:
        """How many of the batch's last frames are quiet (``frames``: all of them).  A batch is
        judged frame by frame: a client that sends faster than real time gets batches of many
        frames, and a pause must be measured from where the sound ended, not from the batch."""
        samples = _as_int16(payload, self._format).astype(np.float32)
        per_frame = samples.size // frames if frames else 0
        if not per_frame:
            return frames
        rows = samples[samples.size - per_frame * frames:].reshape(frames, per_frame)
        loud = np.flatnonzero(np.einsum("ij,ij->i", rows, rows) > self._floor * per_frame)
        return frames if not loud.size else frames - 1 - int(loud[-1])
