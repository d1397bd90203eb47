"""The batched transcriber against the ``moshi`` package's own single-stream STT inference.

The reference is what Kyutai's STT inference does with one file: a fresh ``LMGen`` (greedy) and
Mimi streaming one row, the model's silence prefix, the audio, then the model's delay of silence;
its text is read from the steps that consumed the audio and the trailing silence.  A session's
transcript must be exactly that text, token for token, whoever shares the batch and whenever it
joins or leaves.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

from duplexrt.config import ConfigError, TranscriberConfig  # noqa: E402
from duplexrt.transcribe.model import SttModel, load_model  # noqa: E402
from duplexrt.backends.moshi.text import piece_table  # noqa: E402
from duplexrt.transcribe.pieces import frames_for  # noqa: E402
from duplexrt.transcribe.tiny import TINY_STT_CONFIG, save_tiny_stt  # noqa: E402
from duplexrt.transcribe.transcriber import Transcriber  # noqa: E402

FRAME = 1920


def tiny_model(seed: int = 0) -> SttModel:
    return load_model(TranscriberConfig(enabled=True, tiny=True, seed=seed))


def voice(seed: int, frames: int) -> np.ndarray:
    """``frames`` frames of varied sound (tones, noise, silence): different codes every frame."""
    rng = np.random.default_rng(seed)
    t = np.arange(FRAME) / 24000
    out = np.zeros((frames, FRAME), dtype=np.float32)
    for i in range(frames):
        loud = rng.uniform(0.01, 0.8)
        tone = loud * np.sin(2 * np.pi * rng.uniform(80, 4000) * t) if i % 3 else 0.0
        noise = rng.standard_normal(FRAME) * loud if i % 4 == 0 else 0.0
        out[i] = tone + noise
    return out


class Reference:
    """The package's own single-stream inference on its own copy of the model (same seed)."""

    def __init__(self, seed: int = 0) -> None:
        from moshi.models import LMGen

        self.model = tiny_model(seed)
        lm = self.model.lm
        self.gen = LMGen(lm, use_sampling=False, temp=0.0, temp_text=0.0)
        self.table = piece_table(self.model.tokenizer, lm.text_linear.out_features,
                                 (lm.text_padding_token_id, lm.end_of_text_padding_id))

    def tokens(self, audio: np.ndarray, *, flush: bool = True) -> list[int]:
        """Text tokens of the steps that consume ``audio`` (and the delay's silence after it)."""
        mimi, gen, model = self.model.mimi, self.gen, self.model
        silence = torch.zeros(1, 1, FRAME)
        out = []
        with torch.no_grad(), mimi.streaming(1), gen.streaming(1):
            for _ in range(model.prefix_frames):
                gen.step(mimi.encode(silence))
            frames = [torch.from_numpy(np.ascontiguousarray(f))[None, None] for f in audio]
            frames += [silence] * (model.delay_frames if flush else 0)
            for frame in frames:
                out.append(int(gen.step(mimi.encode(frame))[0, 0, 0]))
        return out

    def text(self, audio: np.ndarray, *, flush: bool = True) -> list[str]:
        return [piece for piece in (self.table[t] for t in self.tokens(audio, flush=flush)) if piece]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.fixture(scope="module")
def transcriber() -> Transcriber:
    transcriber = Transcriber(tiny_model(), 4)
    transcriber.load()
    yield transcriber
    transcriber.close()


class Call:
    """A caller on a slot: joins at ``start`` (a step number), sends ``audio``, then its
    end-of-input mark (a silent frame) unless ``ends`` is False (it just leaves)."""

    def __init__(self, slot: int, start: int, audio: np.ndarray, ends: bool = True) -> None:
        self.slot, self.start, self.audio, self.ends = slot, start, audio, ends
        self.pieces: list = []

    def frame(self, step: int) -> np.ndarray | None:
        k = step - self.start
        if 0 <= k < len(self.audio):
            return self.audio[k]
        if k == len(self.audio) and self.ends:
            return np.zeros(FRAME, dtype=np.float32)
        return None

    @property
    def last_step(self) -> int:
        return self.start + len(self.audio) + (0 if self.ends else -1)

    @property
    def texts(self) -> list[str]:
        return [p.text for p in self.pieces if p.text]


def run(transcriber: Transcriber, calls: list[Call]) -> None:
    """Step the calls as the scheduler would: opens before a call's first frame, the mark's
    ``end_input`` before the step that carries it, closes after its last step."""
    for step in range(max(c.last_step for c in calls) + 1):
        for call in calls:
            if step == call.start:
                transcriber.open_slot(call.slot)
        active = sorted((c for c in calls if c.frame(step) is not None), key=lambda c: c.slot)
        for call in active:
            if step - call.start == len(call.audio):
                transcriber.end_input(call.slot)
        if active:
            rows = np.array([c.slot for c in active], dtype=np.int64)
            pieces = transcriber.step(rows, np.stack([c.frame(step) for c in active]))
            for call, row_pieces in zip(active, pieces):
                call.pieces.extend(row_pieces)
        for call in calls:
            if step == call.last_step:
                transcriber.close_slot(call.slot)


def test_transcripts_equal_the_packages_inference_for_calls_joining_and_leaving(transcriber, reference):
    # Three calls overlap on a batch of four; a fourth reuses the slot the first left.
    calls = [Call(1, 0, voice(1, 12)), Call(0, 4, voice(2, 10)), Call(3, 7, voice(3, 9), ends=False),
             Call(1, 14, voice(4, 8))]
    run(transcriber, calls)
    for call in calls:
        expected = reference.text(call.audio, flush=call.ends)
        assert call.texts == expected
        assert len(expected) >= 4  # the test means something: the model writes text


def test_the_text_depends_on_the_audio(reference):
    assert reference.tokens(voice(1, 10)) != reference.tokens(voice(2, 10))


def test_nan_silence_and_full_scale_input_leave_other_rows_and_the_next_call_alone(transcriber, reference):
    broken = voice(5, 8)
    broken[2:4] = np.nan
    clipped = np.clip(voice(6, 8) * 50, -1.0, 1.0).astype(np.float32)  # full scale, square-ish
    quiet = np.zeros((8, FRAME), dtype=np.float32)
    neighbour = voice(7, 20)
    calls = [Call(0, 0, broken), Call(2, 0, clipped), Call(3, 0, quiet), Call(1, 0, neighbour),
             Call(0, 11, voice(8, 8)), Call(2, 11, voice(9, 8))]
    run(transcriber, calls)
    for call in calls:
        assert call.texts == reference.text(call.audio)


def test_a_reused_row_is_a_fresh_one_whatever_its_caches_held(transcriber, reference):
    # What a package reset leaves behind (K/V rings, the token cache), poisoned on purpose:
    # the join restores it, or the NaN would reach the next call through softmax(...) @ V.
    from duplexrt.backends.moshi.rows import RowWiper

    run(transcriber, [Call(2, 0, voice(15, 4))])
    fresh = RowWiper([transcriber.model.mimi, transcriber._lm_gen], transcriber.slots)
    assert len(fresh.buffers) >= 3
    for tensor, dim, _fill in fresh.buffers:
        if tensor.is_floating_point():
            tensor.select(dim, 2).fill_(float("nan"))
    call = Call(2, 0, voice(16, 8))
    run(transcriber, [call])
    assert call.texts == reference.text(call.audio)


def test_input_far_past_full_scale_stays_in_its_own_row(transcriber, reference):
    # 80 dB past full scale (float PCM allows it): the row's own text may then differ from a
    # batch of one by a rounding (the kernels round by batch size), but nothing leaks: its
    # neighbour and the next call on its row are exactly the reference.
    huge = voice(6, 8) * 1e4
    calls = [Call(0, 0, huge), Call(1, 0, voice(13, 12)), Call(0, 10, voice(14, 8))]
    run(transcriber, calls)
    assert calls[0].texts  # it still writes text: no NaN took the row down
    for call in calls[1:]:
        assert call.texts == reference.text(call.audio)


def test_a_call_ending_before_the_delay_still_gets_its_last_words(transcriber, reference):
    audio = voice(10, 3)  # shorter than the delay: without the flush the text would be cut
    call = Call(2, 0, audio)
    run(transcriber, [call])
    assert call.texts == reference.text(audio)
    without = reference.text(audio, flush=False)
    assert len(call.texts) > len(without)
    # Whatever the flush brought came in the step of the end-of-input mark, marked as such.
    flushed = [p for p in call.pieces if p.flushed]
    assert [p.text for p in flushed if p.text] == call.texts[len(without):]
    assert {p.frame for p in flushed} == {len(audio)}
    assert all(not p.flushed for p in call.pieces if p not in flushed)


def test_a_flush_that_writes_nothing_still_says_it_is_done(transcriber):
    # Silence: the tiny model may or may not write text; either way the flush ends with a
    # flushed piece, so a route can complete the caller's item at once.
    call = Call(3, 0, np.zeros((2, FRAME), dtype=np.float32))
    run(transcriber, [call])
    assert call.pieces and call.pieces[-1].flushed and call.pieces[-1].frame == 2


def test_pieces_are_placed_on_the_callers_timeline(transcriber):
    call = Call(0, 0, voice(11, 20))
    run(transcriber, [call])
    delay_ms = TINY_STT_CONFIG["audio_delay_seconds"] * 1e3
    for piece in call.pieces:
        assert piece.audio_ms == max(0.0, round(piece.frame * 80.0 - delay_ms, 3))
        assert piece.audio_frame == int(piece.audio_ms // 80.0)
        assert piece.audio_frame <= piece.frame


def test_join_and_flush_cost_masked_steps_not_one_step_per_call(reference):
    transcriber = Transcriber(tiny_model(), 3)
    transcriber.load()
    try:
        model = transcriber.model
        calls = [Call(slot, 0, voice(20 + slot, 4)) for slot in range(3)]
        run(transcriber, calls)
        # One join (all three together) and one flush (all three end together), each masked
        # to its rows: steps = frames + mark, extra = prefix + the delay's rest, once.
        assert transcriber.steps == 5
        assert transcriber.extra_steps == model.prefix_frames + model.delay_frames - 1
    finally:
        transcriber.close()


def test_a_saved_stt_tiny_loads_through_the_packages_loader(tmp_path, reference):
    directory = save_tiny_stt(tmp_path / "stt", seed=0)
    model = load_model(TranscriberConfig(enabled=True, checkpoint=str(directory)))
    assert (model.delay_seconds, model.prefix_seconds) == (TINY_STT_CONFIG["audio_delay_seconds"],
                                                           TINY_STT_CONFIG["audio_silence_prefix_seconds"])
    transcriber = Transcriber(model, 1)
    transcriber.load()
    try:
        call = Call(0, 0, voice(12, 6))
        run(transcriber, [call])
        assert call.texts == reference.text(call.audio)
    finally:
        transcriber.close()


def test_delay_frames_round_up_as_kyutais_inference_pads():
    assert frames_for(0.5, 12.5) == 7  # 6.25 frames of delay: 7 frames of silence after the audio
    assert frames_for(2.5, 12.5) == math.ceil(2.5 * 12.5)
    assert frames_for(0.16, 12.5) == 2
    assert frames_for(0.0, 12.5) == 0


def test_transcriber_config_refuses_what_cannot_run():
    with pytest.raises(ConfigError, match="needs a model"):
        TranscriberConfig(enabled=True)
    with pytest.raises(ConfigError, match="both name a model"):
        TranscriberConfig(enabled=True, tiny=True, checkpoint="kyutai/stt-1b-en_fr")
    with pytest.raises(ConfigError, match="delay_seconds"):
        TranscriberConfig(delay_seconds=-1)
    assert not TranscriberConfig().enabled


def test_a_warmed_up_transcriber_gives_the_same_transcripts(reference):
    transcriber = Transcriber(tiny_model(), 2)
    transcriber.load(warmup_steps=3)
    try:
        assert transcriber.warmup_cost > 0 and transcriber.steps == 0
        calls = [Call(0, 0, voice(17, 6)), Call(1, 2, voice(18, 5))]
        run(transcriber, calls)
        for call in calls:
            assert call.texts == reference.text(call.audio)
    finally:
        transcriber.close()


def test_a_slot_s_state_is_measured_from_the_model_s_own_streaming_state():
    small, large = Transcriber(tiny_model(), 1), Transcriber(tiny_model(), 4)
    for transcriber in (small, large):
        transcriber.load()
    try:
        # The tiny LM's K/V ring: 2 layers x keys and values x 4 heads x 64 positions x 16 x 4 B.
        assert small.slot_bytes >= 2 * 2 * 4 * 64 * 16 * 4
        # Per slot, whatever the batch (a few shared tensors, the initial tokens, spread over it).
        assert abs(small.slot_bytes - large.slot_bytes) <= small.slot_bytes // 100
    finally:
        small.close()
        large.close()
