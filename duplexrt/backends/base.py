"""The slot-based interface between the scheduler thread and a model.

A backend holds one fixed batch of ``slots`` rows for the life of the process.  Sessions come and
go by opening and closing rows; a step runs only the rows that have a frame this time.  The
scheduler thread is the only caller of every method here, so a backend needs no locking.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np

from duplexrt.config import ConfigError


@attrs.frozen
class PersonaRequest:
    """Who a caller asked the model to be, as the caller sent it (not yet checked): a role
    prompt and a voice name.  None keeps the deployment's default for that half."""

    text: str | None = None
    voice: str | None = None


@attrs.frozen
class Persona:
    """A checked persona, ready for a model that takes one (``Backend.check_persona``): what the
    caller sees of it (the voice's name, the prompt as given) and what the model is fed (the
    prompt's tokens, system tags included).  Equal personas give the same prompt state, which
    is what lets a backend compute it once and share it."""

    voice: str
    text: str
    tokens: tuple[int, ...]

    def describe(self) -> dict[str, object]:
        return {"voice": self.voice, "instructions": self.text, "prompt_tokens": len(self.tokens)}


class PersonaError(ValueError):
    """A persona the model cannot take, with a message a caller can act on (the voices there
    are, the token cap...).  Sessions answer it with a protocol error; the call goes on."""


@attrs.frozen
class SlotSession:
    """What a backend learns about the session that takes a slot: sent once, at open."""

    #: A stable number for the session, used by deterministic backends as a seed.
    session_id: int


#: ``BackendInfo.slots`` before load when the backend is to choose (``runtime.slots = "auto"``).
CHOSEN_AT_LOAD = 0


@attrs.frozen
class SlotChoice:
    """How many slots a backend holds, and why: shown in ``/readyz``, ``/stats`` and the start
    line, so an operator sees what ``runtime.slots = "auto"`` (or a refusal's arithmetic) found."""

    slots: int
    #: ``"configured"``: ``runtime.slots`` as given; ``"auto"``: chosen at load.
    source: str
    #: One sentence: why this many.
    reason: str
    #: The figures behind it (JSON-ready): state per slot, free memory, step times measured...
    details: Mapping[str, Any] = attrs.field(factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"slots": self.slots, "source": self.source, "reason": self.reason, **self.details}


@attrs.frozen
class BackendInfo:
    """Facts the runtime needs before any session opens."""

    name: str
    sample_rate: int
    frame_size: int
    #: Batch rows.  ``CHOSEN_AT_LOAD`` (0) asks a backend that can (``Backend.chooses_slots``)
    #: to choose in ``load``, after which it holds the count chosen.
    slots: int
    #: ``"cpu"`` or a torch device string; batch buffers are pinned when it is a GPU.
    device: str = "cpu"
    #: The model's own context limit in frames per session, if it has one: a session reaching it
    #: ends with finish reason ``length``.
    max_session_frames: int | None = None
    #: Steps a model wants after a caller's last frame to finish its output (a translation model
    #: lags its input by seconds): the session feeds them when the caller's input ends, the first
    #: marked by ``Backend.end_input``, the rest silence.  0: the output ends with the input.
    flush_frames: int = 0
    #: ``runtime.capacity_margin``: the share of a frame period a step must leave free, for a
    #: backend that chooses its own slot count by timing its step.
    capacity_margin: float = 0.05
    #: ``runtime.max_session_seconds`` (0: none): the longest call the server takes, for a
    #: backend whose per-row state is sized by the longest call it must hold (moshi's K/V ring).
    max_session_seconds: float = 0.0

    @property
    def frame_ms(self) -> float:
        return self.frame_size / self.sample_rate * 1e3


class Backend(abc.ABC):
    """A model stepped in batches over fixed slots.  Every method runs on the scheduler thread."""

    #: After each step, a backend with stages (encode, LM, decode...) leaves here how long each
    #: took, as ``(name, nanoseconds)`` pairs; the scheduler reports them per stage.
    last_stages: tuple[tuple[str, int], ...] = ()
    #: Step costs measured in ``load`` (the warm-up), as ``(rows, seconds)``: what the runtime's
    #: capacity estimate starts from before any session has been stepped.
    warmup_costs: tuple[tuple[int, float], ...] = ()
    #: The rows the last step paid for, where the backend steps more rows than it was given (a
    #: bucket covering its calls); None: the rows given.  The capacity estimate's unit.
    stepped_rows: int | None = None
    #: Bytes each slot needs on the backend's device beside the backend's own state (a transcriber's
    #: row there): a backend that sizes its slots by the device's memory counts them.
    extra_slot_bytes = 0
    #: Whether ``load`` can choose the slot count (``runtime.slots = "auto"``).
    chooses_slots = False
    #: How the slot count was arrived at (set by ``load`` where the backend has more to say than
    #: "configured"; the scheduler fills in the plain case).
    slot_choice: SlotChoice | None = None

    def paid_rows(self, sessions: int) -> int:
        """The rows a step of ``sessions`` sessions pays for: the capacity estimate prices a
        session count at this many rows.  The sessions themselves, unless the backend steps
        more (a bucket covering them: see the moshi backend's ``buckets``)."""
        return sessions

    def __init__(self, info: BackendInfo) -> None:
        if info.slots == CHOSEN_AT_LOAD and not self.chooses_slots:
            raise ConfigError(f'runtime.slots = "auto" is for a backend that measures its own memory and '
                              f"step (moshi); {info.name} rows cost next to nothing: give a number "
                              "(the default is 128)")
        self.info = info

    def load(self) -> None:
        """Load weights and warm up, so that no session's first frame pays for it."""

    @abc.abstractmethod
    def open_slot(self, slot: int, session: SlotSession) -> None:
        """Reset ``slot`` for a new session.  Other slots must not notice."""

    @abc.abstractmethod
    def close_slot(self, slot: int) -> None:
        """Forget ``slot``'s session."""

    @abc.abstractmethod
    def step(self, rows: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> Sequence[str] | None:
        """Run one frame for each slot in ``rows`` (ascending), reading ``inputs[i]`` and writing
        ``outputs[i]`` (both ``(len(rows), frame_size)`` float32 views of preallocated buffers).

        Returns the text each row produced this step (``""`` for none), or None for a model
        that never speaks text.
        """

    #: Whether ``check_persona`` / ``set_persona`` do anything (PersonaPlex).  A backend that takes
    #: no persona refuses one in ``check_persona`` with a PersonaError saying so.
    takes_persona = False
    #: The voices a caller may name (set by ``load`` where the model takes a persona).
    persona_voices: tuple[str, ...] = ()

    def check_persona(self, request: PersonaRequest) -> Persona:
        """``request`` checked and completed with the defaults, or PersonaError.  Runs on the
        trio thread (not the scheduler's): it reads only what ``load`` fixed."""
        raise PersonaError(f"the {self.info.name} model takes no persona (instructions or voice)")

    def persona_info(self) -> dict[str, Any] | None:
        """What ``/readyz``, ``/stats``, the start line and the talk page say of the persona a
        caller may set: None for a model that takes none; else ``voices``, ``default_voice``,
        ``default_instructions``, ``max_prompt_tokens`` and ``prompt_cache`` (``hits``,
        ``misses``, ``entries``, ``bytes``, ``max_bytes``, ``prefills``).  Read from the trio
        thread: plain values, a snapshot."""
        return None

    def set_persona(self, slot: int, persona: Persona) -> None:
        """``slot``'s session is ``persona``: applied before the slot's first frame is stepped
        (its prompt is the start of the row's conversation).  Called at most once per session,
        after ``open_slot`` and before the slot's first ``step``."""
        raise PersonaError(f"the {self.info.name} model takes no persona")

    def end_input(self, slot: int) -> None:
        """``slot``'s frame in the next ``step`` is the first after its caller's input ended.

        Called only for a backend with ``info.flush_frames``; a model that marks the end of its
        input stream (Hibiki's end-of-stream codes) feeds the mark in place of that frame.
        """

    def close(self) -> None:
        """Release the model; the process goes on."""


def take_options(backend: str, options: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Options merged over defaults, refusing keys the backend does not know."""
    unknown = set(options) - set(defaults)
    if unknown:
        raise ConfigError(
            f"{', '.join(f'backend.options.{k}' for k in sorted(unknown))}: {backend} has no such "
            f"option; it accepts {', '.join(sorted(defaults)) or 'none'}"
        )
    merged = dict(defaults)
    merged.update(options)
    return merged


def number_option(backend: str, options: Mapping[str, Any], key: str, low: float, high: float,
                  *, integer: bool = False) -> float:
    """``options[key]`` checked against ``[low, high]``; the error names the key and the range."""
    value = options[key]
    kinds = int if integer else int | float
    if isinstance(value, bool) or not isinstance(value, kinds) or not low <= value <= high:
        what = "an integer" if integer else "a number"
        raise ConfigError(
            f"backend.options.{key} for {backend} must be {what} from {low:g} to {high:g}, got {value!r}"
        )
    return value
