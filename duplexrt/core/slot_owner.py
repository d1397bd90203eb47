"""The way back from the scheduler thread to a session, as a type.

A frame goes in through a ``SlotLease``; its output comes back to whoever leased the slot, a
whole step at a time, on the trio thread (``Scheduler._deliver``).  Every structure the owner
travels through on the way (the inbox's queues, a ``Batch``, a ``StepOutcome``) names it by this
protocol, so a reader or a type checker can follow a step's output from the scheduler to
``Session.step_output`` without guessing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from duplexrt.transcribe.pieces import TranscriptPiece


class SlotOwner(Protocol):
    """What a session gives the scheduler: callbacks that run on the trio thread and must
    return quickly and never raise (a raise in a ``run_sync_soon`` callback takes trio down; the
    scheduler logs and swallows one anyway)."""

    def step_output(self, output: np.ndarray, text: str | None, submitted_ns: int, stepped_ns: int) -> None:
        """One row of a step: the model's audio for the frame submitted at ``submitted_ns``
        (perf_counter_ns), its text piece if any, and when the step finished."""

    def transcript(self, pieces: Sequence[TranscriptPiece]) -> None:
        """What the caller said, as far as this step's transcriber wrote it (only with a
        transcriber, only for a row that wrote something): delivered before the row's
        ``step_output``."""

    def delivery_done(self) -> None:
        """Every row of the delivery that brought this owner's output has been handed over
        (steps that finished while trio was busy come in one delivery): the moment to act on
        them together.  Called once per delivery, after ``step_output``."""

    def step_failed(self, error: BaseException) -> None:
        """The step this owner's frame was in failed (or its slot could not be opened, or the
        model refused its persona: a ``PersonaError``, whose message the caller may be told)."""

    def persona_set(self) -> None:
        """The model took the persona given through the lease (``Backend.set_persona``
        returned): before any of the slot's frames queued after it is stepped.  Only for an
        owner that gave one."""
