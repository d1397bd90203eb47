"""A caller's persona, from what they asked for to their row's state: the conductor of
``persona`` (what a prompt is, the voices), ``prefill`` (running it in a lane) and
``prompt_cache`` (keeping its state for the next caller with the same persona).

Built once per model (``from_model``): the voices are listed (files) or made (the tiny model's,
by the reference's procedure: Mimi codes of a voice sample, embedded, no transformer needed),
and every voice's length is known, so the longest prompt the server can be asked for is known at
load and the K/V ring's room for the conversation after it too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import numpy as np

from duplexrt.backends.base import Persona, PersonaError, PersonaRequest
from duplexrt.backends.moshi import persona as personas
from duplexrt.backends.moshi import personaplex, prefill
from duplexrt.backends.moshi.internals import initial_tokens
from duplexrt.backends.moshi.prompt_cache import PromptCache
from duplexrt.config import ConfigError


def _encode_frames(mimi: Any, wav: np.ndarray) -> np.ndarray:
    """``(8, N)`` Mimi codes of ``wav``, frame by frame through a fresh streaming state of one
    row, the last frame padded with zeros (the reference's way)."""
    import torch

    frame = int(mimi.sample_rate / mimi.frame_rate)
    count = -(-len(wav) // frame)
    padded = np.zeros(count * frame, dtype=np.float32)
    padded[:len(wav)] = wav
    device = next(mimi.parameters()).device
    codes = []
    with torch.no_grad(), mimi.streaming(1):
        for i in range(count):
            chunk = torch.from_numpy(padded[i * frame:(i + 1) * frame])[None, None].to(device)
            codes.append(mimi.encode(chunk)[0, :, 0].cpu().numpy())
    return np.stack(codes, axis=1)


def make_voice(name: str, wav: np.ndarray, *, mimi: Any, lm: Any, tone: tuple[int, ...]) -> personas.Voice:
    """A voice prompt from a voice sample at Mimi's rate, by the reference's procedure: the
    sample's codes as the model's own stream (text padding, the caller's stream the tone), the
    input embeddings of each column the transformer reads, and the token columns it leaves."""
    import torch

    codes = _encode_frames(mimi, wav)
    read, tail = personas.voice_frames_columns(codes, delays=lm.delays, initial=initial_tokens(lm), tone=tone,
                                               ungenerated=int(lm.ungenerated_token_id))
    device = next(lm.parameters()).device
    with torch.no_grad():
        embeddings = prefill.embed_columns(lm, torch.from_numpy(read)[None].to(device))[0]
    return personas.Voice(name, embeddings, torch.from_numpy(tail))


@attrs.define
class Prompter:
    lm: Any
    rules: personas.PersonaRules
    cache: PromptCache
    mode: str
    silence: tuple[int, ...]
    tone: tuple[int, ...]
    filler: int
    #: The most K/V positions a prompt can fill (longest voice, fillers, ``max_prompt_tokens``, seam).
    max_positions: int
    prefills: int = 0

    @classmethod
    def from_model(cls, settings: Any, *, mimi: Any, lm: Any, tokenizer: Any, voices_folder: Path | None,
                   tiny: bool) -> Prompter:
        if tiny:
            silence, tone = personaplex.filler_codes(mimi)
        else:
            silence, tone = personaplex.SILENCE_CODES, personaplex.TONE_CODES
        made: dict[str, Any] = {}
        if settings.voices:
            voices_folder = Path(settings.voices).expanduser()
        if tiny and voices_folder is None:
            rate = int(mimi.sample_rate)
            for name in personaplex.PACKAGED_VOICES:
                voice = make_voice(name, personaplex.tiny_voice_wav(name, rate), mimi=mimi, lm=lm, tone=tone)
                made[name] = (lambda v=voice: v)
        library = personas.VoiceLibrary(voices_folder, made)
        if not library.names:
            raise ConfigError("backend.options.persona = true, but no voice was found"
                              f"{f' in {voices_folder}' if voices_folder else ''}: give backend.options.voices "
                              "a folder of PersonaPlex voice files (NAME.pt)")
        default_voice = settings.voice or ("NATF2" if "NATF2" in library.names else library.names[0])
        try:
            default_voice = library.canonical(default_voice)
        except PersonaError as exc:
            raise ConfigError(f"backend.options.voice: {exc}") from None
        device = next(lm.parameters()).device
        longest = max(library.get(name, device, lm.dtype).frames for name in library.names)
        filler = personas.filler_frames(float(mimi.frame_rate))
        rules = personas.PersonaRules(library, default_voice, settings.instructions, settings.max_prompt_tokens,
                                      lambda text: list(tokenizer.encode(text)))
        try:
            rules.check(PersonaRequest())
        except PersonaError as exc:
            raise ConfigError(f"backend.options.instructions: {exc}") from None
        return cls(lm, rules, PromptCache(int(settings.prompt_cache_mb * 2**20)), settings.prefill, tuple(silence),
                   tuple(tone), filler, longest + 2 * filler + settings.max_prompt_tokens + 1)

    def check(self, request: PersonaRequest) -> Persona:
        return self.rules.check(request)

    def frames(self, persona: Persona) -> personas.PromptFrames:
        lm = self.lm
        device = next(lm.parameters()).device
        voice = self.rules.voices.get(persona.voice, device, lm.dtype)
        return personas.prompt_frames(voice, persona.tokens, delays=lm.delays, initial=initial_tokens(lm),
                                      silence=self.silence, tone=self.tone, filler=self.filler,
                                      ungenerated=int(lm.ungenerated_token_id))

    def state(self, persona: Persona) -> prefill.PromptState:
        """The persona's prompt state: from the cache, else prefilled (and kept)."""
        key = (persona.voice, persona.tokens)
        state = self.cache.get(key)
        if state is None:
            state = prefill.run(self.lm, self.frames(persona), self.mode)
            self.prefills += 1
            self.cache.put(key, state)
        return state

    def warm(self) -> None:
        """The default persona's state, prefilled at load (the first default caller copies it;
        the lane's kernels are warm).  On a GPU a second prompt of another length is read too:
        the package's compiled kernels specialise on the first shape they see and recompile for
        the second as dynamic, which is then paid here, not by a caller."""
        persona = self.check(PersonaRequest())
        key = (persona.voice, persona.tokens)
        if key not in self.cache:
            self.cache.put(key, prefill.run(self.lm, self.frames(persona), self.mode))
            self.prefills += 1
        if next(self.lm.parameters()).device.type == "cuda" and len(persona.tokens) > 1:
            shorter = Persona(persona.voice, persona.text, persona.tokens[: len(persona.tokens) // 2])
            prefill.run(self.lm, self.frames(shorter), self.mode)

    def prompt(self, lm_gen: Any, row: int, persona: Persona, session_key: int, widths: list[int]) -> None:
        """``row`` (just reset) starts its conversation as ``persona``."""
        state = self.state(persona)
        seam = prefill.sample_seam(self.lm, lm_gen, state, session_key, widths)
        prefill.install(self.lm, lm_gen, row, state, seam)

    def info(self) -> dict[str, Any]:
        rules = self.rules
        return {"voices": list(rules.voices.names), "default_voice": rules.default_voice,
                "default_instructions": rules.default_text, "max_prompt_tokens": rules.max_tokens,
                "prefill": self.mode, "prompt_cache": {**self.cache.statistics.as_dict(), "prefills": self.prefills}}
