"""A transcript piece: the text one row's step produced, placed on the caller's timeline.

Kyutai's STT models write a text token a fixed delay after the audio it transcribes (the model
is trained on text shifted that far behind the audio), so the step that consumes the caller's
frame ``f`` writes text about the audio at ``f * frame_ms - delay_ms``.  A piece carries both: the
step's own frame (when the text became known) and the place in the audio it belongs to (what a
client shows as a word's time), on the same frame count as the session's input.
"""

from __future__ import annotations

import math

import attrs


@attrs.frozen
class TranscriptPiece:
    """Text from one step of one row."""

    #: The text, as the tokenizer spells it (a word starts with a space).
    text: str
    #: The caller's frame whose step wrote it (0: the session's first frame).
    frame: int
    #: The caller's frame it belongs to: ``frame`` less the model's delay (``audio_ms`` in whole
    #: frames, rounded down), never below 0.
    audio_frame: int
    #: The same place in milliseconds from the session's first sample: ``frame * frame_ms -
    #: delay_ms``, never below 0.
    audio_ms: float
    #: Written while flushing the caller's input (its end-of-input mark and the delay's silence
    #: after it): with these, all the text of the audio before the mark is out.  A flush that
    #: writes nothing still yields one such piece, with no text, to say so.
    flushed: bool = False


#: A token's text is cut to this many characters (sentencepiece's own pieces are at most 16 by
#: default): what a piece can cost is bounded whatever the tokenizer (``server/budget.py``).
MAX_PIECE_CHARS = 64


def frames_for(seconds: float, frame_rate: float) -> int:
    """Whole frames covering ``seconds`` (rounded up, as Kyutai's own inference pads)."""
    return math.ceil(seconds * frame_rate - 1e-9)
