"""PersonaPlex in the ``moshi`` backend, on the tiny model (``personaplex-tiny``'s shape).

A persona's prompt is run in a lane beside the batch and its state copied into the row
(``prefill``); equal personas share one state (``prompt_cache``).  Checked here, bit for bit
where the claim is exactness: a call whose row came from the cache is the same call prompted in
place, and the same call alone on a fresh backend; the batch prefill against the frame-by-frame
one (the largest difference, reported); one caller's persona never reaching another; the
checks a caller's request goes through; the cache's byte bound; NVIDIA's checkpoint layout.
The comparison with NVIDIA's own code is ``test_personaplex_reference``.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("NO_TORCH_COMPILE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")

from duplexrt.backends.base import BackendInfo, Persona, PersonaError, PersonaRequest, SlotSession  # noqa: E402
from duplexrt.backends.moshi import MoshiBackend, personaplex, prefill  # noqa: E402
from duplexrt.backends.moshi.persona import voice_to_saved  # noqa: E402
from duplexrt.config import ConfigError  # noqa: E402

FRAME = 1920
PIRATE = "You are Lou, a pirate who sells second-hand boats in a small harbour town."
NURSE = "You are a calm night nurse who answers questions about sleep."


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _backend(slots: int = 4, **options) -> MoshiBackend:
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots),
                           {"tiny": True, "persona": True, "warmup_steps": 1, "seed": 3, **options})
    backend.load()
    return backend


@pytest.fixture(scope="module")
def backend() -> MoshiBackend:
    return _backend()


def _signal(seed: int, frames: int) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)


def _call(backend: MoshiBackend, persona: Persona | None, signal: np.ndarray, *, row: int = 0,
          session_id: int = 11, others: dict[int, tuple[Persona, np.ndarray]] | None = None):
    """One call on ``row`` (with ``others`` on their rows beside it), every row stepped each
    frame: the call's audio and text."""
    others = others or {}
    backend.open_slot(row, SlotSession(session_id))
    for other_row, (other_persona, _signal_) in others.items():
        backend.open_slot(other_row, SlotSession(1000 + other_row))
        backend.set_persona(other_row, other_persona)
    if persona is not None:
        backend.set_persona(row, persona)
    order = np.array(sorted([row, *others]), dtype=np.int64)
    audio, text = [], []
    for i, frame in enumerate(signal):
        feed = {row: frame, **{r: s[i] for r, (_p, s) in others.items()}}
        inputs = np.stack([feed[int(r)] for r in order])
        outputs = np.full_like(inputs, np.nan)
        said = backend.step(order, inputs, outputs)
        at = int(np.flatnonzero(order == row)[0])
        audio.append(outputs[at].copy())
        text.append(said[at])
    for r in order.tolist():
        backend.close_slot(r)
    return np.stack(audio), text


def test_a_cached_prompt_gives_the_call_a_fresh_prefill_gives(backend):
    persona = backend.check_persona(PersonaRequest(text=PIRATE, voice="NATM1"))
    signal = _signal(1, 12)
    misses = backend.persona_info()["prompt_cache"]["misses"]
    first = _call(backend, persona, signal)  # prefilled in place, and kept
    info = backend.persona_info()["prompt_cache"]
    assert info["misses"] == misses + 1
    second = _call(backend, persona, signal)  # copied from the cache
    assert backend.persona_info()["prompt_cache"]["hits"] == info["hits"] + 1
    assert np.array_equal(first[0], second[0]) and first[1] == second[1]
    alone = _call(_backend(), persona, signal)  # the same call alone on a fresh backend
    assert np.array_equal(first[0], alone[0]) and first[1] == alone[1]
    assert np.isfinite(first[0]).all() and np.abs(first[0]).max() > 0


def test_the_persona_changes_the_call_and_stays_with_its_caller(backend):
    signal = _signal(2, 12)
    pirate = backend.check_persona(PersonaRequest(text=PIRATE, voice="NATF2"))
    nurse = backend.check_persona(PersonaRequest(text=NURSE, voice="VARM3"))
    as_pirate = _call(backend, pirate, signal)
    as_nurse = _call(backend, nurse, signal)
    assert not np.array_equal(as_pirate[0], as_nurse[0])
    # Beside a nurse on the next row, the pirate's call is the pirate's call: the same words, and
    # the audio within the rounding a bucket of two rows gives (about one float32 ulp) ...
    beside = _call(backend, pirate, signal, others={1: (nurse, _signal(3, 12))})
    assert as_pirate[1] == beside[1] and np.abs(as_pirate[0] - beside[0]).max() <= 1e-5


def test_with_the_fixed_batch_a_persona_call_beside_another_is_bit_for_bit_its_own():
    fixed = _backend(batch="fixed")
    try:
        signal = _signal(2, 12)
        pirate = fixed.check_persona(PersonaRequest(text=PIRATE, voice="NATF2"))
        nurse = fixed.check_persona(PersonaRequest(text=NURSE, voice="VARM3"))
        alone = _call(fixed, pirate, signal)
        beside = _call(fixed, pirate, signal, others={1: (nurse, _signal(3, 12))})
        assert np.array_equal(alone[0], beside[0]) and alone[1] == beside[1]
    finally:
        fixed.close()


def test_the_batch_prefill_stays_within_rounding_of_the_frame_by_frame_one(backend):
    prompter = backend._prompter
    persona = backend.check_persona(PersonaRequest(text=PIRATE + " " + NURSE, voice="VARF4"))
    frames = prompter.frames(persona)
    batch = prefill.run(backend._lm, frames, "batch")
    stepped = prefill.run(backend._lm, frames, "frames")
    assert batch.positions == stepped.positions == frames.positions
    logits = (batch.seam_text_logits - stepped.seam_text_logits).abs().max().item()
    kv = max((batch.fields[k] - stepped.fields[k]).abs().max().item() for k in batch.fields
             if k.endswith("kv_cache.cache"))
    print(f"batch vs frames prefill: largest difference {logits:.3g} in the seam's logits, {kv:.3g} in K/V")
    assert logits < 1e-4 and kv < 1e-4
    for key in batch.fields:
        if not key.endswith("kv_cache.cache"):
            assert torch.equal(batch.fields[key], stepped.fields[key]), key


def test_a_request_is_checked_before_anything_runs(backend):
    voices = backend.persona_info()["voices"]
    assert "NATF2" in voices and len(voices) == 18
    default = backend.check_persona(PersonaRequest())
    assert default.voice == "NATF2" and default.text == backend.persona_info()["default_instructions"]
    assert backend.check_persona(PersonaRequest(voice="VARM2.pt")).voice == "VARM2"
    # An empty or blank prompt takes the default prompt (clients send "" for "nothing").
    assert backend.check_persona(PersonaRequest(text="   ")).tokens == default.tokens
    with pytest.raises(PersonaError, match="no voice 'NOBODY'.*NATF0, NATF1"):
        backend.check_persona(PersonaRequest(voice="NOBODY"))
    for path in ("../NATF2.pt", "/etc/passwd", "voices/NATF2", "..", "NATF2\x00"):
        with pytest.raises(PersonaError, match="not a path|no voice"):
            backend.check_persona(PersonaRequest(voice=path))
    with pytest.raises(PersonaError, match="at most 384"):
        backend.check_persona(PersonaRequest(text="ka lo mi ne " * 200))
    with pytest.raises(PersonaError, match="U\\+0000"):
        backend.check_persona(PersonaRequest(text="hello\x00world"))
    # Unusual but real text goes through: right-to-left, emoji, combining marks.
    for text in ("مرحبا، أنت قرصان", "🏴‍☠️ ahoy", "Zoë ne\u0301e", "\u202eevil override"):
        persona = backend.check_persona(PersonaRequest(text=text))
        assert persona.text == text and persona.tokens


def test_a_model_without_persona_refuses_one():
    plain = MoshiBackend(BackendInfo("moshi", 24000, FRAME, 1), {"tiny": True})
    assert not plain.takes_persona and plain.persona_info() is None
    with pytest.raises(PersonaError, match="takes no persona"):
        plain.check_persona(PersonaRequest(text="hi"))
    with pytest.raises(ConfigError, match="persona = true"):
        MoshiBackend(BackendInfo("moshi", 24000, FRAME, 1), {"tiny": True, "voice": "NATF2"})
    with pytest.raises(ConfigError, match="prefill"):
        MoshiBackend(BackendInfo("moshi", 24000, FRAME, 1), {"tiny": True, "persona": True, "prefill": "fast"})


def _numbered(i: int) -> str:
    """A different prompt for each ``i`` (in words the tiny tokenizer tells apart: it has no digits)."""
    return f"{PIRATE} " + " ".join(["ka", "lo", "mi", "ne", "ru"][int(d)] for d in np.base_repr(i, 5))


def test_the_cache_keeps_to_its_bytes_and_evicts_the_oldest():
    small = _backend(slots=1, prompt_cache_mb=0.25)
    bound = small.persona_info()["prompt_cache"]["max_bytes"]
    for i in range(12):
        persona = small.check_persona(PersonaRequest(text=_numbered(i), voice="NATF0"))
        small.open_slot(0, SlotSession(i))
        small.set_persona(0, persona)
        small.close_slot(0)
        stats = small.persona_info()["prompt_cache"]
        assert stats["bytes"] <= bound
    assert stats["evictions"] > 0 and stats["entries"] < 12
    # The first prompt was evicted: asking for it again is a miss, not a stale hit.
    misses = stats["misses"]
    small.open_slot(0, SlotSession(99))
    small.set_persona(0, small.check_persona(PersonaRequest(text=_numbered(0), voice="NATF0")))
    assert small.persona_info()["prompt_cache"]["misses"] == misses + 1


def test_voices_from_a_folder(tmp_path, backend):
    voice = backend._prompter.rules.voices.get("VARF1", torch.device("cpu"), torch.float32)
    torch.save(voice_to_saved(voice), tmp_path / "Harbour-Master.pt")
    (tmp_path / "notes.txt").write_text("not a voice")
    served = _backend(slots=1, voices=str(tmp_path), voice="Harbour-Master")
    assert served.persona_info()["voices"] == ["Harbour-Master"]
    persona = served.check_persona(PersonaRequest(voice="Harbour-Master.pt"))
    signal = _signal(4, 6)
    from_folder = _call(served, persona, signal)
    made = _call(_backend(slots=1), Persona("VARF1", persona.text, persona.tokens), signal)
    assert np.array_equal(from_folder[0], made[0])
    with pytest.raises(ConfigError, match="no voice 'NATF2'"):
        _backend(slots=1, voices=str(tmp_path), voice="NATF2")


def test_nvidia_checkpoint_layout_loads_as_the_served_model(tmp_path):
    mimi, lm, _tokenizer = personaplex.build_tiny_personaplex(5)
    from duplexrt.backends.moshi.tiny import train_tokenizer

    personaplex.save_nvidia_layout(tmp_path, lm, mimi, train_tokenizer(5))
    loaded = personaplex.load_lm(tmp_path / personaplex.LM_NAME, device="cpu", dtype=torch.float32,
                                 lm_kwargs=personaplex.tiny_lm_config())
    assert loaded.dep_q == 8
    theirs = loaded.state_dict()
    assert set(theirs) == set(lm.state_dict())
    assert all(torch.equal(value, theirs[key]) for key, value in lm.state_dict().items())


def test_the_ring_leaves_room_for_a_call_after_the_longest_prompt():
    with pytest.raises(ConfigError, match="no room for a call after the longest persona prompt"):
        _backend(slots=1, max_prompt_tokens=600)
    backend = _backend(slots=1, beyond_context="end")
    longest = backend._prompter.max_positions
    assert backend.info.max_session_frames == personaplex.TINY_CONTEXT - longest
