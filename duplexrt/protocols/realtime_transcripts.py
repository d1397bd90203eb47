"""What the caller said, as a Realtime session's user items hear it: a transcriber's pieces
turned into ``conversation.item.input_audio_transcription.delta`` events, and one ``.completed``
per user item once all of its text is out.

A user item is the caller's audio between two commits (the server VAD's, or the client's
``input_audio_buffer.commit``): each piece goes to the item whose audio it belongs to, by its
place on the caller's timeline (``TranscriptPiece.audio_ms``).  An item's id is known when its
speech starts (server VAD) or when it is committed; pieces of audio whose item has no id yet are
held until it has one (at most ``MAX_HELD_PIECES``: a client that never commits holds no more).

The text of a stretch of audio comes the model's delay after it, so an item is complete once the
session's output (stepped with the transcriber) has passed its end by the delay, or at once when
the transcriber has flushed the caller's input after it (a commit in turn mode, the end of the
input: the flush's pieces say so, and where: the frame of the end-of-input mark, right after the
item's audio).  The client's commits run ahead of the model's steps (a client appends and commits
faster than the model steps), so a flush is matched to its item by that frame, not taken to be
about the last commit.  ``completed`` always comes after the item's last ``delta``: a piece that
belongs to an item already completed is dropped.

The events are the ones LiveKit's and pipecat's OpenAI realtime plugins read: ``item_id``,
``content_index`` (0: the item's one audio part), ``delta`` / ``transcript``, an ``event_id``;
``completed`` also carries ``usage`` (the item's audio duration), as OpenAI's does and as the
``openai`` SDK's models (GA and beta) require.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence

from duplexrt.protocols.realtime_server_events import ServerEvents
from duplexrt.transcribe.pieces import TranscriptPiece

__all__ = ["CallerTranscripts", "MAX_HELD_PIECES", "MAX_ITEM_CHARS", "MAX_PENDING_ITEMS", "MAX_TEXT_PARTS"]

#: Pieces kept for audio whose item has no id yet (about 80 s of text at one piece a frame).
MAX_HELD_PIECES = 1000
#: Committed items waiting for the rest of their text; past it the oldest is completed at once.
MAX_PENDING_ITEMS = 16
#: Characters one item's ``completed`` transcript keeps (some minutes of speech): past it the
#: deltas still go out, the transcript stops growing.  A caller who never pauses under server VAD
#: holds no more than this; a session at most ``MAX_PENDING_ITEMS + 1`` such transcripts and the
#: held pieces (a few hundred kB of text in all).
MAX_ITEM_CHARS = 8000
#: An item's text is kept as pieces, joined into one string when there are this many (a
#: one-character piece costs a whole string object: the join keeps the bound in characters).
MAX_TEXT_PARTS = 64


class _Text:
    """An item's transcript so far, kept up to ``MAX_ITEM_CHARS``."""

    __slots__ = ("parts", "chars")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.chars = 0

    def add(self, text: str) -> None:
        if self.chars + len(text) <= MAX_ITEM_CHARS:
            parts = self.parts
            parts.append(text)
            self.chars += len(text)
            if len(parts) >= MAX_TEXT_PARTS:
                parts[:] = ["".join(parts)]

    def __str__(self) -> str:
        return "".join(self.parts).strip()


class _Item:
    __slots__ = ("item_id", "start_ms", "end_ms", "text")

    def __init__(self, item_id: str, start_ms: float, end_ms: float, text: _Text) -> None:
        self.item_id = item_id
        self.start_ms = start_ms
        self.end_ms = end_ms
        self.text = text


class CallerTranscripts:
    """One session's caller transcript, cut into its user items, its events written by ``out``
    (the session's ``ServerEvents``)."""

    def __init__(self, out: ServerEvents, *, delay_ms: float, frame_ms: float,
                 finish: Callable[[str, str], None] | None = None) -> None:
        self._out = out
        self._delay_ms = delay_ms
        self._frame_ms = frame_ms
        #: Told each completed item's id and transcript (the conversation's rendering of it).
        self._finish = finish
        #: Committed items whose text is not all out yet, oldest first.
        self._pending: deque[_Item] = deque()
        #: The audio since the last commit: where it starts, its item's id once known, its text.
        self._open_start = 0.0
        self._open_id: str | None = None
        self._open_text = _Text()
        self._held: deque[str] = deque()
        #: Audio before this point belongs to items already completed (or cleared).
        self._closed_ms = 0.0

    # -- the items, as the translator makes them -----------------------------------------------

    def speech_started(self, item_id: str) -> list[str]:
        """The server VAD heard speech: the open audio will be ``item_id``; what was held goes out."""
        self._open_id = item_id
        return self._release()

    def committed(self, item_id: str, end_ms: float) -> list[str]:
        """The open audio, up to ``end_ms``, became item ``item_id``: it waits for the rest of its
        text; new audio opens the next item."""
        self._open_id = item_id
        messages = self._release()
        item = _Item(item_id, self._open_start, max(end_ms, self._open_start), self._open_text)
        self._pending.append(item)
        self._open_start, self._open_id, self._open_text = item.end_ms, None, _Text()
        while len(self._pending) > MAX_PENDING_ITEMS:
            messages += self._complete(self._pending.popleft())
        return messages

    def cleared(self, at_ms: float) -> None:
        """``input_audio_buffer.clear``: the open audio up to ``at_ms`` is no one's; its text goes."""
        self._held.clear()
        self._open_text = _Text()
        self._open_start = self._closed_ms = max(self._closed_ms, at_ms)

    # -- the transcriber's side ------------------------------------------------------------------

    def pieces(self, pieces: Sequence[TranscriptPiece], answered_ms: float) -> list[str]:
        """A step's pieces: deltas for the items they belong to, then the items now complete."""
        messages: list[str] = []
        flushed_at: float | None = None
        for piece in pieces:
            if piece.flushed:
                flushed_at = piece.frame * self._frame_ms  # where the mark is: the input before it is all out
            if not piece.text:
                continue
            item = self._item_at(piece.audio_ms)
            if piece.flushed:
                # A flush's text is about the audio just before its mark: the item that ends there
                # (a turn-mode commit pads the caller's last frame, then the mark follows).
                item = self._item_ending_at(piece.frame * self._frame_ms) or item
            if item is None:
                if piece.audio_ms >= self._open_start and piece.audio_ms >= self._closed_ms:
                    messages += self._open_piece(piece.text)
                continue  # audio of an item already complete, or cleared
            item.text.add(piece.text)
            messages.append(self._delta(item.item_id, piece.text))
        if flushed_at is not None:
            pending = self._pending
            while pending and pending[0].end_ms <= flushed_at:
                messages += self._complete(pending.popleft())
        return messages + self.progress(answered_ms)

    def progress(self, answered_ms: float) -> list[str]:
        """The session's output has reached ``answered_ms``: items whose audio ended the delay
        before it have all their text."""
        messages: list[str] = []
        pending = self._pending
        while pending and pending[0].end_ms + self._delay_ms <= answered_ms:
            messages += self._complete(pending.popleft())
        return messages

    # -- helpers -------------------------------------------------------------------------------

    def _item_at(self, audio_ms: float) -> _Item | None:
        """The committed item still waiting whose audio holds ``audio_ms``; None for the open
        audio, or for audio of an item already completed."""
        if audio_ms < self._closed_ms:
            return None
        for item in self._pending:
            if audio_ms < item.end_ms:
                return item
        return None

    def _item_ending_at(self, mark_ms: float) -> _Item | None:
        """The waiting item whose audio ends within a frame before ``mark_ms`` (the end-of-input
        mark that flushed it), if any."""
        for item in self._pending:
            if mark_ms - self._frame_ms < item.end_ms <= mark_ms:
                return item
        return None

    def _open_piece(self, text: str) -> list[str]:
        if self._open_id is None:
            self._held.append(text)
            if len(self._held) > MAX_HELD_PIECES:
                self._held.popleft()
            return []
        self._open_text.add(text)
        return [self._delta(self._open_id, text)]

    def _release(self) -> list[str]:
        held, self._held = self._held, deque()
        return [message for text in held for message in self._open_piece(text)]

    def _delta(self, item_id: str, text: str) -> str:
        return self._out.event("conversation.item.input_audio_transcription.delta", item_id=item_id,
                               content_index=0, delta=text)

    def _complete(self, item: _Item) -> list[str]:
        self._closed_ms = max(self._closed_ms, item.end_ms)
        transcript = str(item.text)
        if self._finish is not None:
            self._finish(item.item_id, transcript)
        seconds = round((item.end_ms - item.start_ms) / 1e3, 3)
        return [self._out.event("conversation.item.input_audio_transcription.completed", item_id=item.item_id,
                                content_index=0, transcript=transcript,
                                usage={"type": "duration", "seconds": seconds})]
