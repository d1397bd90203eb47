"""Personas for PersonaPlex: who the model is (a text role prompt) and how it sounds (a voice
prompt), set per call before the conversation starts.

**What a prompt is.**  The reference steps, one frame per step, before the caller's first
frame: the voice prompt (saved per-frame input embeddings replayed through the temporal
transformer, then the saved token cache put in place), 0.5 s of filler, one frame per token of
the role prompt, 0.5 s of filler.  In every one of those frames all the model's inputs are
given (the model's own stream: the voice's codes, then silence; the caller's stream: a tone;
the text stream: the prompt's tokens or padding), so nothing is sampled and the state after the
prompt depends only on the model, the voice and the text.  ``PromptTape`` writes those frames
as the reference lays them out (each codebook at its delay; the first frame only opens the
stream), and what the temporal transformer reads is then a fixed sequence of columns: the
LLM-style prefill (``prefill``) runs them at once, and equal personas share the result
(``prompt_cache``).

**Where the reference and the package differ by one call.**  NVIDIA's ``LMGen`` runs the
transformer one call after the codes it reads were written (its first call only opens the
stream); the ``moshi`` package's runs it in the same call.  Position by position the token
streams are the same; only the seam differs.  The reference's first conversation call still
reads the prompt's last column and samples the first text and audio tokens from it; here that
read is part of the prefill (the *seam*), sampled from the session's own stream, and the
caller's first frame goes where the reference puts it.  The caller then hears the model one
frame sooner than from NVIDIA's server, with the same tokens.

**Voices** are the reference's ``.pt`` files: ``embeddings`` (one input embedding per voice
frame after the first) and ``cache`` (the token ring after them, four columns indexed by
position modulo 4).  Only names are taken from callers: ``NATF2`` or ``NATF2.pt``, looked up in
the configured folder; a name with a path in it is refused, never opened.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs
import numpy as np

from duplexrt.backends.base import Persona, PersonaError, PersonaRequest
from duplexrt.backends.moshi.personaplex import FILLER_SECONDS, PROMPT_TEXT_PAD, wrap_in_system_tags

#: The reference's voice files keep a token ring of this many positions.
REFERENCE_RING = 4
#: A voice's name: letters, digits, ``-`` and ``_`` (what the packaged voices use), at most 64.
_VOICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")
#: Unicode categories refused in a role prompt: control characters (but tab and newline),
#: unassigned code points, surrogates, private use.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cn", "Cs", "Co"})


@attrs.frozen
class Voice:
    """A voice prompt: the transformer's input embeddings for its frames (``(E, dim)``) and the
    token columns the voice leaves at positions ``E`` and ``E + 1`` (``(K, 2)``, ``-2`` where
    nothing was written)."""

    name: str
    embeddings: Any
    tail: Any

    @property
    def frames(self) -> int:
        return int(self.embeddings.shape[0])


def voice_from_saved(name: str, saved: dict[str, Any]) -> Voice:
    """A voice from the reference's saved dict (``embeddings``: ``(E, 1, 1, dim)``, ``cache``:
    ``(1, K, 4)``)."""
    embeddings = saved["embeddings"]
    cache = saved["cache"]
    if embeddings.dim() != 4 or embeddings.shape[1:3] != (1, 1) or cache.dim() != 3 or cache.shape[0] != 1:
        raise ValueError(f"voice {name}: not a PersonaPlex voice prompt (embeddings {tuple(embeddings.shape)}, "
                         f"cache {tuple(cache.shape)})")
    frames = int(embeddings.shape[0])
    ring = cache.shape[2]
    tail = cache[0][:, [frames % ring, (frames + 1) % ring]].clone()
    return Voice(name, embeddings[:, 0, 0, :].clone(), tail)


def voice_to_saved(voice: Voice, ungenerated: int = -2) -> dict[str, Any]:
    """The reference's saved dict for ``voice`` (what ``voice_from_saved`` reads back)."""
    import torch

    frames = voice.frames
    cache = torch.full((1, voice.tail.shape[0], REFERENCE_RING), ungenerated, dtype=torch.long)
    cache[0, :, frames % REFERENCE_RING] = voice.tail[:, 0]
    cache[0, :, (frames + 1) % REFERENCE_RING] = voice.tail[:, 1]
    return {"embeddings": voice.embeddings[:, None, None, :].detach().cpu(), "cache": cache}


class PromptTape:
    """Token columns by absolute position, written as the reference's prompt steps write them:
    a frame given at ``offset`` puts codebook ``k`` at ``offset + delays[k]``, and a stream's
    first positions (``offset <= delays[k]``) hold the initial token instead.  Positions never
    written read ``ungenerated``."""

    def __init__(self, delays: Sequence[int], initial: Sequence[int], ungenerated: int = -2) -> None:
        self.delays = list(delays)
        self.initial = list(initial)
        self.ungenerated = ungenerated
        self._columns: dict[int, list[int]] = {}

    def column(self, position: int) -> list[int]:
        return list(self._columns.get(position, [self.ungenerated] * len(self.delays)))

    def put(self, position: int, column: Sequence[int]) -> None:
        """A whole column, as found (a voice's saved tail)."""
        self._columns[position] = list(column)

    def write(self, offset: int, tokens: Sequence[int]) -> None:
        """One prompt frame's tokens (one per codebook: text, the model's audio, the caller's) at
        ``offset``."""
        for k, (token, delay) in enumerate(zip(tokens, self.delays)):
            self._columns.setdefault(offset + delay, [self.ungenerated] * len(self.delays))[k] = int(token)
        for k, delay in enumerate(self.delays):
            if offset <= delay:
                self._columns.setdefault(offset, [self.ungenerated] * len(self.delays))[k] = self.initial[k]
        if offset == 0:  # the stream's opening column is all initial tokens
            self._columns[0] = list(self.initial)

    def columns(self, start: int, stop: int) -> np.ndarray:
        """``(K, stop - start)`` int64: the columns of positions ``start`` to ``stop - 1``."""
        return np.array([self.column(p) for p in range(start, stop)], dtype=np.int64).T.reshape(len(self.delays), -1)


@attrs.frozen
class PromptFrames:
    """What the temporal transformer reads for one persona: ``voice.embeddings`` at positions
    ``0 .. E-1``, then the token ``columns`` (``(K, n)``) at ``E .. E+n-1``; the last of them is
    the seam (sampled from, see the module docstring).  ``after`` is the token column at the
    position after the seam, where the conversation's first frame lands (``-2`` where the seam's
    sampling or the caller's audio will write)."""

    voice: Voice
    columns: np.ndarray
    after: np.ndarray

    @property
    def positions(self) -> int:
        """Positions of the K/V ring the prompt fills (the seam included)."""
        return self.voice.frames + int(self.columns.shape[1])


def filler_frames(frame_rate: float) -> int:
    return int(FILLER_SECONDS * frame_rate)


def prompt_frames(voice: Voice, tokens: Sequence[int], *, delays: Sequence[int], initial: Sequence[int],
                  silence: Sequence[int], tone: Sequence[int], filler: int, ungenerated: int = -2) -> PromptFrames:
    """The columns after ``voice`` for a role prompt of ``tokens``: ``filler`` frames of filler,
    one frame per token, ``filler`` frames of filler (the reference's order), the model's stream
    silent and the caller's a tone throughout."""
    tape = PromptTape(delays, initial, ungenerated)
    first = voice.frames
    tape.put(first, voice.tail[:, 0].tolist())
    tape.put(first + 1, voice.tail[:, 1].tolist())
    texts = [PROMPT_TEXT_PAD] * filler + list(tokens) + [PROMPT_TEXT_PAD] * filler
    for i, text in enumerate(texts):
        tape.write(first + 1 + i, [text, *silence, *tone])
    seam = first + len(texts)  # the last column written whole: the conversation's first read
    return PromptFrames(voice, tape.columns(first, seam + 1), np.array(tape.column(seam + 1), dtype=np.int64))


def voice_frames_columns(codes: np.ndarray, *, delays: Sequence[int], initial: Sequence[int], tone: Sequence[int],
                         ungenerated: int = -2) -> tuple[np.ndarray, np.ndarray]:
    """The reference's procedure for making a voice, as columns: each frame of the voice sample's
    codes (``(8, N)``) is the model's own stream, the text padding, the caller's stream the tone;
    the first frame only opens the stream.  Returns the ``N - 1`` columns the transformer reads
    (``(K, N-1)``: their embeddings are the voice) and the tail (``(K, 2)``)."""
    tape = PromptTape(delays, initial, ungenerated)
    frames = codes.shape[1]
    for offset in range(frames):
        tape.write(offset, [PROMPT_TEXT_PAD, *codes[:, offset].tolist(), *tone])
    read = tape.columns(0, frames - 1)
    tail = np.stack([np.array(tape.column(frames - 1)), np.array(tape.column(frames))], axis=1)
    return read, tail


class VoiceLibrary:
    """The voices callers may name: files ``NAME.pt`` in a folder, and voices made in memory
    (the tiny model's).  Names are listed at load; a voice is read when first used (on the
    scheduler thread) and kept."""

    def __init__(self, folder: Path | None, made: dict[str, Callable[[], Voice]] | None = None) -> None:
        self.folder = folder
        self._makers: dict[str, Callable[[], Voice]] = dict(made or {})
        self._files: dict[str, Path] = {}
        if folder is not None:
            for path in sorted(folder.glob("*.pt")):
                if path.is_file() and _VOICE_NAME.match(path.stem):
                    self._files[path.stem] = path
        self._loaded: dict[str, Voice] = {}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(set(self._files) | set(self._makers)))

    def canonical(self, requested: str) -> str:
        """The voice a caller named (``NATF2`` or ``NATF2.pt``), or PersonaError: a path, an
        unknown name (the error lists the voices there are)."""
        name = requested.strip()
        if "/" in name or "\\" in name or name.startswith(".") or "\x00" in name:
            raise PersonaError(f"voice {requested!r}: give a voice's name, not a path; the voices are "
                               f"{', '.join(self.names)}")
        name = name.removesuffix(".pt")
        if not _VOICE_NAME.match(name) or name not in self._files and name not in self._makers:
            raise PersonaError(f"no voice {requested!r}; the voices are {', '.join(self.names) or 'none'}")
        return name

    def get(self, name: str, device: Any, dtype: Any) -> Voice:
        voice = self._loaded.get(name)
        if voice is None:
            if name in self._makers:
                voice = self._makers[name]()
            else:
                import torch

                saved = torch.load(self._files[name], map_location="cpu", weights_only=True)
                voice = voice_from_saved(name, saved)
            voice = Voice(name, voice.embeddings.to(device=device, dtype=dtype), voice.tail.cpu())
            self._loaded[name] = voice
        return voice


def check_text(text: str) -> str:
    """A role prompt, or PersonaError for characters no prompt has a use for (control characters
    other than tab and newline, unassigned code points, surrogates, private use)."""
    for index, char in enumerate(text):
        if char in "\t\n\r":
            continue
        if unicodedata.category(char) in _REFUSED_CATEGORIES:
            raise PersonaError(f"instructions: character U+{ord(char):04X} at {index} is not text "
                               f"({unicodedata.category(char)}); send plain text")
    return text


@attrs.frozen
class PersonaRules:
    """What a caller may ask for and what they get when they ask for nothing."""

    voices: VoiceLibrary
    default_voice: str
    default_text: str
    max_tokens: int
    encode: Callable[[str], list[int]]

    def check(self, request: PersonaRequest) -> Persona:
        voice = self.default_voice if request.voice is None or not request.voice.strip() else \
            self.voices.canonical(request.voice)
        text = request.text if request.text is not None and request.text.strip() else self.default_text
        tokens = tuple(self.encode(wrap_in_system_tags(check_text(text))))
        if len(tokens) > self.max_tokens:
            raise PersonaError(f"instructions are {len(tokens)} tokens with the system tags; this server "
                               f"takes at most {self.max_tokens} (backend.options.max_prompt_tokens)")
        return Persona(voice=voice, text=text, tokens=tokens)


def names_listed(names: Iterable[str]) -> str:
    return ", ".join(names)
