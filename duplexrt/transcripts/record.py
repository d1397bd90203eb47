"""One call's transcript, assembled by its session as the call runs.

Everything here is called on the trio thread by the session alone (``Session.step_output`` for
the model's text, ``Session.transcript`` for the caller's pieces), so it needs no lock and makes
no thread crossing.  A call with no text costs one truth test per frame.

What one call may hold is bounded (``max_chars``: the characters of both sides together, and so
the pieces, each at least one character): past it, the rest of the call's text is dropped and the
record says ``"truncated": true``.  Times are whole milliseconds in an ``array`` rather than one
float object per piece, so the bound in memory is the text's own plus a few bytes a piece
(``server/budget.py``, ``call_transcript_bytes``).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from duplexrt.transcribe.pieces import MAX_PIECE_CHARS, TranscriptPiece


def _iso(seconds: float) -> str:
    """A wall-clock time as ISO 8601 in UTC, to the millisecond."""
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class CallTranscript:
    """Both sides of one call: the caller's pieces (``audio_ms``: where in the caller's audio each
    belongs) and the model's (``ms``: its output frame's start), in the order they came."""

    __slots__ = ("call_id", "fetchable", "session_id", "route", "frame_ms", "started", "ended", "reason", "error",
                 "_caller_text", "_caller_ms", "_model_text", "_model_ms", "_chars_left", "truncated")

    def __init__(self, call_id: str, route: str, frame_ms: float, max_chars: int,
                 started: float | None = None, *, fetchable: bool = True) -> None:
        self.call_id = call_id
        #: The client was told ``call_id`` (its route announces one): only then is the record
        #: worth a place in the store; the others go to the sink alone.
        self.fetchable = fetchable
        #: The runtime's number for the session (its log lines), set once its slot is open.
        self.session_id: int | None = None
        self.route = route
        self.frame_ms = frame_ms
        #: Wall-clock seconds (``time.time``) at the start and the end.
        self.started = time.time() if started is None else started
        self.ended: float | None = None
        self.reason = ""
        self.error: str | None = None
        self._caller_text: list[str] = []
        self._caller_ms = array("I")
        self._model_text: list[str] = []
        self._model_ms = array("I")
        self._chars_left = max_chars
        #: Text was dropped past ``max_chars``.
        self.truncated = False

    def _take(self, text: str) -> str | None:
        """``text`` as kept (cut to a piece's most), or None once the call's characters are spent."""
        text = text[:MAX_PIECE_CHARS]
        left = self._chars_left - len(text)
        if left < 0:
            self.truncated = True
            self._chars_left = 0
            return None
        self._chars_left = left
        return text

    def model(self, text: str, frame: int) -> None:
        """The model's text of its output frame ``frame`` (0: the call's first)."""
        kept = self._take(text)
        if kept is not None:
            self._model_text.append(kept)
            self._model_ms.append(int(frame * self.frame_ms))

    def caller(self, pieces: Sequence[TranscriptPiece]) -> None:
        """A transcriber's pieces for one step (those with no text say nothing and are skipped)."""
        for piece in pieces:
            if piece.text:
                kept = self._take(piece.text)
                if kept is None:
                    return
                self._caller_text.append(kept)
                self._caller_ms.append(int(piece.audio_ms))

    def finish(self, reason: str, error: str | None, ended: float | None = None) -> None:
        """The call is over: how, and when."""
        self.ended = time.time() if ended is None else ended
        self.reason = reason
        self.error = error

    def as_dict(self) -> dict[str, Any]:
        """The record as served and written: one JSON object."""
        ended = self.ended if self.ended is not None else time.time()
        return {
            "id": self.call_id,
            "session": self.session_id,
            "route": self.route,
            "started": _iso(self.started),
            "ended": _iso(ended),
            "duration_s": round(max(0.0, ended - self.started), 3),
            "reason": self.reason,
            "error": self.error,
            "frame_ms": self.frame_ms,
            "caller": [{"text": t, "audio_ms": ms} for t, ms in zip(self._caller_text, self._caller_ms, strict=True)],
            "model": [{"text": t, "ms": ms} for t, ms in zip(self._model_text, self._model_ms, strict=True)],
            "caller_text": "".join(self._caller_text),
            "model_text": "".join(self._model_text),
            "truncated": self.truncated,
        }
