"""The LM's K/V ring: how many positions each row keeps, and what a call longer than it gets.

Every row of the fixed batch keeps, for each layer of the LM's temporal transformer, a ring of K
and V with one position per 80 ms frame.  The package sizes it from each attention's ``context``
(the model's own: 3000 positions, 240 s, for Moshi 7B) when the streaming state is allocated, and
on a GPU every step's attention reads the whole ring, written or not (on a CPU only what the calls
have filled: ``attention``).  So the ring sets both the memory a slot holds
(``memory.slot_bytes`` reads the same ``context``) and, on a GPU, most of the per-row cost of a
step.  A server whose calls are capped at T seconds needs only T x 12.5 positions: a shorter ring
holds more slots, and each reads less per step.

``backend.options.context_seconds`` chooses the ring (unset: the model's own context, or
``runtime.max_session_seconds`` where that is shorter), applied to the temporal transformer with
the package's ``set_attention_context`` before any state is allocated.  ``backend.options.beyond_context`` says what a call gets once it has filled it:

* ``"end"`` (the default): the call ends with finish reason ``length`` when it reaches the ring's
  end (``BackendInfo.max_session_frames``; with ``runtime.max_session_seconds`` the shorter of
  the two applies).  Every frame of the call is heard by the model.
* ``"slide"``: the call goes on, and the model forgets what is older than the ring (the ring
  overwrites its oldest position), as Kyutai's own servers do at the full context.

A call within the ring is stepped exactly as with the full context: the positions the ring lacks
were never written, and the attention masks unwritten positions out.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from duplexrt.config import ConfigError

#: What a call gets past the ring's end (see the module docstring).
BEYOND_CONTEXT = ("end", "slide")


@attrs.frozen
class Ring:
    """The K/V ring each row of the LM keeps."""

    #: Positions (frames) the ring holds.
    positions: int
    #: The model's own context, in positions: the most the ring may hold.
    model_positions: int
    #: Frames per second (12.5 for Mimi).
    frame_rate: float
    #: ``"end"`` or ``"slide"``: what a call gets past ``positions`` frames.
    beyond_context: str
    #: What set ``positions``: ``"model"`` (its own context), ``"context_seconds"`` or
    #: ``"max_session_seconds"`` (no call lasts longer, so no row needs more).
    source: str = "model"

    @property
    def seconds(self) -> float:
        return self.positions / self.frame_rate

    @property
    def model_seconds(self) -> float:
        return self.model_positions / self.frame_rate

    @property
    def max_session_frames(self) -> int | None:
        """The frame limit a call has because of the ring (None: it slides on)."""
        return self.positions if self.beyond_context == "end" else None

    def as_dict(self) -> dict[str, Any]:
        return {"positions": self.positions, "seconds": round(self.seconds, 3),
                "model_positions": self.model_positions, "model_seconds": round(self.model_seconds, 3),
                "beyond_context": self.beyond_context, "source": self.source}

    def describe(self) -> str:
        """One clause for the start line and the log."""
        own = "the model's own context" if self.positions == self.model_positions else \
            f"of the model's {self.model_positions} ({self.model_seconds:g} s)"
        if self.source == "max_session_seconds":
            own += ", as runtime.max_session_seconds caps calls"
        after = "a call ends with 'length' at its end" if self.beyond_context == "end" else \
            "a longer call forgets what is older"
        return f"a K/V ring of {self.positions} positions a row ({self.seconds:g} s, {own}): {after}"


def model_context(lm: Any) -> int:
    """The context of ``lm``'s temporal transformer as built (every self-attention's ``context``),
    in positions: read before anything changes it."""
    from moshi.modules.transformer import StreamingMultiheadAttention

    contexts = {module.context for module in lm.transformer.modules()
                if isinstance(module, StreamingMultiheadAttention) and not module.cross_attention}
    if len(contexts) != 1 or None in contexts:
        raise ConfigError(f"this model's temporal transformer has attention contexts {sorted(map(str, contexts))}: "
                          "the moshi backend needs one finite context to size each row's K/V ring")
    (context,) = contexts
    assert context is not None  # refused just above; the set test does not narrow for mypy
    return int(context)


def check_beyond_context(value: Any) -> str:
    """``backend.options.beyond_context``, or a ``ConfigError`` naming the choices."""
    if not isinstance(value, str) or value not in BEYOND_CONTEXT:
        raise ConfigError(f"backend.options.beyond_context for moshi must be one of "
                          f"{', '.join(repr(v) for v in BEYOND_CONTEXT)}, got {value!r}")
    return value


def _frames(seconds: float, frame_rate: float) -> int:
    # Whole frames, as runtime.max_session_seconds counts them: a ring of T s holds a call of T s.
    return math.floor(seconds * frame_rate + 1e-9)


def choose(context_seconds: float | None, beyond_context: str, model_positions: int, frame_rate: float,
           *, max_session_seconds: float = 0.0) -> Ring:
    """The ring for ``context_seconds``, refused with a ``ConfigError`` that names the range when
    it holds no frame or more than the model's context.  Unset, it is the model's own context, or
    less where ``max_session_seconds`` (``runtime.max_session_seconds``) ends every call sooner:
    positions no call reaches would be memory, and per-step reads, for nothing."""
    check_beyond_context(beyond_context)
    model_seconds = model_positions / frame_rate
    if context_seconds is None:
        capped = _frames(max_session_seconds, frame_rate) if max_session_seconds > 0 else 0
        if 1 <= capped < model_positions:
            return Ring(capped, model_positions, frame_rate, beyond_context, "max_session_seconds")
        positions = model_positions
        source = "model"
    else:
        source = "context_seconds"
        positions = _frames(context_seconds, frame_rate)
        if positions < 1:
            raise ConfigError(f"backend.options.context_seconds = {context_seconds:g} holds no frame: the ring "
                              f"needs at least one ({1 / frame_rate:g} s), at most the model's context "
                              f"({model_seconds:g} s)")
        if positions > model_positions:
            raise ConfigError(f"backend.options.context_seconds = {context_seconds:g} is beyond this model's "
                              f"context ({model_positions} positions, {model_seconds:g} s): the model never "
                              f"attends further; give at most {model_seconds:g}, or leave it unset")
    return Ring(positions, model_positions, frame_rate, beyond_context, source)


def apply(lm: Any, ring: Ring) -> None:
    """Size ``lm``'s temporal transformer's K/V rings to ``ring`` (the depformer's, which lives one
    step, and Mimi's are untouched).  Only a state allocated afterwards follows it."""
    from moshi.modules.transformer import set_attention_context

    set_attention_context(lm.transformer, ring.positions)


__all__ = ["Ring", "BEYOND_CONTEXT", "check_beyond_context", "model_context", "choose", "apply"]
