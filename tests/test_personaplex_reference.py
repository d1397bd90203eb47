"""Our PersonaPlex against NVIDIA's own code, on the same tiny weights.

Runs where a checkout of NVIDIA/personaplex is given (``DUPLEXRT_PERSONAPLEX_SRC``: the
repository's root, holding ``moshi/moshi/``); it is not on any package index, so elsewhere the
tests skip, saying so.  The reference package is imported under another name
(``personaplex_reference``) beside the ``moshi`` package we use, its 16-step LM built from
``personaplex.nvidia_state`` of our tiny model (NVIDIA's checkpoint layout), and its filler
constants set to what the tiny Mimi encodes (NVIDIA's are the real Mimi's codes).

Compared, greedy: the voice our procedure makes and the reference's ``save_voice_prompt_embeddings``
(embeddings and token cache); and a whole call: the reference's ``step_system_prompts`` then its
``step`` on the caller's codes, against our prompt (in both prefill modes) then the package's
``LMGen.step`` on the same codes.  The reference's first conversation call returns the prompt's
last frame (the seam, see ``persona``); every later one must equal ours one call earlier.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("moshi")
os.environ.setdefault("NO_TORCH_COMPILE", "1")

from duplexrt.backends.base import PersonaRequest  # noqa: E402
from duplexrt.backends.moshi import personaplex, sampling  # noqa: E402
from duplexrt.backends.moshi.persona import voice_to_saved  # noqa: E402
from duplexrt.backends.moshi.prompter import Prompter, make_voice  # noqa: E402
from duplexrt.backends.moshi.settings import MoshiSettings  # noqa: E402

SOURCE = os.environ.get("DUPLEXRT_PERSONAPLEX_SRC", "")
pytestmark = pytest.mark.skipif(
    not SOURCE or not (Path(SOURCE) / "moshi" / "moshi" / "models" / "lm.py").is_file(),
    reason="no checkout of NVIDIA/personaplex: set DUPLEXRT_PERSONAPLEX_SRC to one (it is on no package index)")

PROMPT = "You are a pirate called Lou who sells boats."


@pytest.fixture(scope="module")
def reference():
    root = Path(SOURCE) / "moshi" / "moshi"
    spec = importlib.util.spec_from_file_location("personaplex_reference", root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules["personaplex_reference"] = package
    spec.loader.exec_module(package)
    return sys.modules["personaplex_reference.models.lm"]


@pytest.fixture(scope="module")
def model(reference):
    sampling.install()
    mimi, lm, tokenizer = personaplex.build_tiny_personaplex(0)
    kwargs = personaplex.tiny_lm_config()
    kwargs["dep_q"] = 16
    ref_lm = reference.LMModel(**kwargs)
    missing, unexpected = ref_lm.load_state_dict(personaplex.nvidia_state(lm), strict=False)
    assert not missing and not unexpected
    ref_lm.eval()
    silence, tone = personaplex.filler_codes(mimi)
    reference.SILENCE_TOKENS = np.array(silence)
    reference.SINE_TOKENS = np.array(tone)
    # The reference normalises a voice sample to -24 LUFS with pyloudnorm; our tiny voices are made
    # from synthetic samples as they are, so the reference takes them as they are too.
    reference.normalize_audio = lambda wav, sr, lufs: wav[0] if wav.ndim == 2 else wav
    return mimi, lm, tokenizer, ref_lm, tone


def _reference_gen(reference, ref_lm, **kwargs):
    return reference.LMGen(ref_lm, device="cpu", use_sampling=False, audio_silence_frame_cnt=6,
                           sample_rate=24000, frame_rate=12.5, **kwargs)


def test_a_voice_is_made_as_the_reference_makes_it(reference, model, tmp_path):
    import sphn

    mimi, lm, _tokenizer, ref_lm, tone = model
    wav = personaplex.tiny_voice_wav("NATM1")
    sphn.write_wav(str(tmp_path / "NATM1.wav"), wav[None], 24000)
    gen = _reference_gen(reference, ref_lm, save_voice_prompt_embeddings=True)
    with torch.no_grad(), gen.streaming(1), mimi.streaming(1):
        gen.load_voice_prompt(str(tmp_path / "NATM1.wav"))
        gen._step_voice_prompt(mimi)
    saved = torch.load(tmp_path / "NATM1.pt")
    ours = voice_to_saved(make_voice("NATM1", wav, mimi=mimi, lm=lm, tone=tone))
    assert ours["embeddings"].shape == saved["embeddings"].shape
    assert torch.equal(ours["embeddings"], saved["embeddings"])
    frames = ours["embeddings"].shape[0]
    # The columns a prompt goes on from: the last one read whole, and the next one's delayed
    # codebooks (its others still hold what the reference's ring had four positions before).
    assert torch.equal(ours["cache"][0, :, frames % 4], saved["cache"][0, :, frames % 4])
    written = ours["cache"][0, :, (frames + 1) % 4] != -2
    assert written.sum() == len(lm.delays) - lm.delays.count(0)
    assert torch.equal(ours["cache"][0, written, (frames + 1) % 4], saved["cache"][0, written, (frames + 1) % 4])


@pytest.mark.parametrize("mode", ["frames", "batch"])
def test_a_call_gives_the_reference_tokens(reference, model, tmp_path, mode):
    mimi, lm, tokenizer, ref_lm, tone = model
    settings = MoshiSettings.from_options({"tiny": True, "persona": True, "greedy": True, "prefill": mode})
    prompter = Prompter.from_model(settings, mimi=mimi, lm=lm, tokenizer=tokenizer, voices_folder=None, tiny=True)
    persona = prompter.check(PersonaRequest(text=PROMPT, voice="NATF2"))
    voice = prompter.rules.voices.get("NATF2", torch.device("cpu"), lm.dtype)
    torch.save(voice_to_saved(voice), tmp_path / "NATF2.pt")
    rng = np.random.default_rng(7)
    frames = 24
    codes = torch.from_numpy(rng.integers(0, lm.card, size=(frames, 1, 8, 1)))

    gen = _reference_gen(reference, ref_lm)
    expected = []
    with torch.no_grad(), gen.streaming(1):
        gen.load_voice_prompt_embeddings(str(tmp_path / "NATF2.pt"))
        gen.text_prompt_tokens = list(persona.tokens)
        gen.step_system_prompts(mimi)
        for i in range(frames):
            # Text and the model's 8 codebooks (the other 8 are the caller's, given back).
            expected.append(gen.step(input_tokens=codes[i])[:, :1 + lm.dep_q])

    from moshi.models import LMGen

    ours = LMGen(lm, use_sampling=False, support_out_of_sync=True)
    widths = sampling.call_widths(lm.text_linear.out_features, lm.card, lm.dep_q, ours.top_k_text, ours.top_k)
    got = []
    with torch.no_grad(), ours.streaming(1):
        prompter.prompt(ours, 0, persona, 0, widths)
        for i in range(frames):
            got.append(ours.step(codes[i]))
    # The reference's first call gives the prompt's last frame: text padding, the silence codes.
    assert expected[0][0, 0, 0].item() == personaplex.PROMPT_TEXT_PAD
    mismatches = [i for i in range(frames - 1) if not torch.equal(got[i], expected[i + 1])]
    assert not mismatches, (f"{len(mismatches)} of {frames - 1} frames differ, first at {mismatches[0]}: "
                            f"ours {got[mismatches[0]].flatten().tolist()} reference "
                            f"{expected[mismatches[0] + 1].flatten().tolist()}")
