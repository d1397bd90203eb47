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
class SlotSession:
    """What a backend learns about the session that takes a slot: sent once, at open."""

    #: A stable number for the session, used by deterministic backends as a seed.
    session_id: int


@attrs.frozen
class BackendInfo:
    """Facts the runtime needs before any session opens."""

    name: str
    sample_rate: int
    frame_size: int
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


class Backend(abc.ABC):
    """A model stepped in batches over fixed slots.  Every method runs on the scheduler thread."""

    #: After each step, a backend with stages (encode, LM, decode...) leaves here how long each
    #: took, as ``(name, nanoseconds)`` pairs; the scheduler reports them per stage.
    last_stages: tuple[tuple[str, int], ...] = ()
    #: Step costs measured in ``load`` (the warm-up), as ``(rows, seconds)``: what the runtime's
    #: capacity estimate starts from before any session has been stepped.
    warmup_costs: tuple[tuple[int, float], ...] = ()

    def __init__(self, info: BackendInfo) -> None:
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
