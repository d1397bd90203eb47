"""FAKE: a test double for a model that takes a persona (PersonaPlex), for the persona tests.

``PersonaEcho`` is the real echo model (its output is the echo's, bit for bit) with the persona
half of ``backends/base.py`` added, the way a test can watch it:

* ``check_persona`` records every request exactly as it came (``requests``), refuses a voice
  that looks like a path, a voice not in ``VOICES`` (naming them; ``NAME.pt`` is ``NAME``, as
  the moshi backend takes it) and a prompt over ``MAX_TEXT`` characters, and fills in the defaults; the "tokens" are the prompt's code points.  Nothing
  else about the strings is judged: empty, control characters, any Unicode pass.
* ``set_persona`` records each call as ``(slot, persona, frames the slot had been stepped since it
  opened)``, so a test sees that the persona came before the first frame; it raises PersonaError
  for a voice in ``refuse_voices`` and RuntimeError for one in ``break_voices`` (a persona that
  passed the check and still fails on the model), and waits on ``gate`` while it is clear
  (``entered`` is set, through the trio token, once it waits).
* ``step`` records the slots it stepped without a persona set since they opened (``unprompted``:
  must stay empty) and every slot it stepped (``stepped_slots``).

Build it inside the trio run (it keeps the run's token to report ``entered``).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import trio

from conftest import GATE_TIMEOUT, backend_info
from duplexrt.backends.base import Persona, PersonaError, PersonaRequest, SlotSession
from duplexrt.backends.echo import EchoBackend
from duplexrt.config import Config

VOICES = ("NATF0", "NATF2", "NATM1", "VARF3")
DEFAULT_VOICE = "NATF0"
DEFAULT_TEXT = "You are a wise and friendly teacher."
MAX_TEXT = 4000


class PersonaEcho(EchoBackend):
    takes_persona = True
    persona_voices = VOICES

    def __init__(self, config: Config, *, refuse_voices: tuple[str, ...] = (),
                 break_voices: tuple[str, ...] = ()) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        slots = config.runtime.slots
        self.refuse_voices = set(refuse_voices)
        self.break_voices = set(break_voices)
        self.requests: list[PersonaRequest] = []
        self.set_calls: list[tuple[int, Persona, int]] = []
        self.unprompted: list[int] = []
        self.stepped_slots: set[int] = set()
        self._stepped = [0] * slots
        self._prompted = [False] * slots
        self.gate = threading.Event()
        self.gate.set()
        self.entered = trio.Event()
        self._token = trio.lowlevel.current_trio_token()

    # -- the persona interface ----------------------------------------------------------------------

    def check_persona(self, request: PersonaRequest) -> Persona:
        self.requests.append(request)
        voice = DEFAULT_VOICE if request.voice is None else request.voice
        if "/" in voice or "\\" in voice or voice.startswith("."):
            raise PersonaError(f"a voice is a name, not a path: {voice[:40]!r}; the voices are {', '.join(VOICES)}")
        if voice.removesuffix(".pt") not in VOICES:  # NVIDIA's client names the file: NATF2.pt
            raise PersonaError(f"unknown voice {voice[:40]!r}; the voices are {', '.join(VOICES)}")
        voice = voice.removesuffix(".pt")
        text = DEFAULT_TEXT if request.text is None else request.text
        if len(text) > MAX_TEXT:
            raise PersonaError(f"the prompt is {len(text)} tokens, over this model's {MAX_TEXT}")
        return Persona(voice, text, tuple(map(ord, text)))

    def set_persona(self, slot: int, persona: Persona) -> None:
        if not self.gate.is_set():
            self._token.run_sync_soon(self.entered.set)
            if not self.gate.wait(GATE_TIMEOUT):
                raise RuntimeError("test gate never opened")
        self.set_calls.append((slot, persona, self._stepped[slot]))
        if persona.voice in self.refuse_voices:
            raise PersonaError(f"voice {persona.voice} cannot be loaded right now")
        if persona.voice in self.break_voices:
            raise RuntimeError("CUDA error: out of memory at /srv/secret/prefill.py:12")
        self._prompted[slot] = True

    def persona_info(self) -> dict[str, Any] | None:
        return {"voices": list(VOICES), "default_voice": DEFAULT_VOICE, "default_instructions": DEFAULT_TEXT,
                "max_prompt_tokens": MAX_TEXT, "prompt_cache": {"hits": 0, "misses": 0, "entries": 0,
                                                                "bytes": 0, "max_bytes": 0, "prefills": 0}}

    # -- the echo, watched -------------------------------------------------------------------------------

    def open_slot(self, slot: int, session: SlotSession) -> None:
        super().open_slot(slot, session)
        self._stepped[slot] = 0
        self._prompted[slot] = False

    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> None:
        for row in rows.tolist():
            if not self._prompted[row]:
                self.unprompted.append(row)
            self._stepped[row] += 1
            self.stepped_slots.add(row)
        return super().step(rows, inputs, outputs)

    def personas(self) -> list[Persona]:
        """The personas set, in order."""
        return [persona for _, persona, _ in self.set_calls]
