"""What a sampled text token says: each token id's piece of text, decoded once at load.

The step hands the protocols text per row per frame, so the lookup must cost an index, not a
tokenizer call: the table is built once from the tokenizer and the width the model samples.
Padding, end-of-padding, control and unknown ids say nothing (``""``); so do ids past the
tokenizer's pieces, which a random model may sample.  SentencePiece marks a word's start with
U+2581, which becomes the space a reader expects.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


def piece_table(tokenizer: Any, sampled: int, silent: Iterable[int]) -> list[str]:
    """Token id -> its text, for every id in ``range(sampled)``; ``silent`` ids say nothing."""
    vocab = tokenizer.vocab_size()
    quiet = set(silent)
    table = []
    for token in range(sampled):
        if token >= vocab or token in quiet or tokenizer.is_control(token) or tokenizer.is_unknown(token):
            table.append("")
        else:
            table.append(tokenizer.id_to_piece(token).replace("\u2581", " "))
    return table
