"""The caller's transcript on the Realtime protocol, sans IO: pieces to user items (ids, order,
``completed`` after the last ``delta``), every event checked against the ``openai`` SDK's own
models (``realtime_schema``), GA and beta."""

from __future__ import annotations

import json

import attrs
import pytest

from duplexrt.protocols.events import EndTurn, Reply
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.protocols.realtime_transcripts import MAX_HELD_PIECES
from duplexrt.transcribe.pieces import TranscriptPiece
from realtime_helpers import PCM_FRAME_BYTES, b64, both_namings
from realtime_schema import every_server_event_is_checked  # noqa: F401  (autouse)

DELAY_MS = 500.0
DELTA = "conversation.item.input_audio_transcription.delta"
COMPLETED = "conversation.item.input_audio_transcription.completed"


@attrs.define
class Progress:
    frames_in: int = 0
    frames_out: int = 0

    @property
    def frames_answered(self) -> int:
        return self.frames_out


def make(*, beta: bool = False, duplex: bool = False, offered: bool = True,
         asks: object = {"model": "gpt-4o-mini-transcribe"}) -> tuple[RealtimeTranslator, Progress, list[dict]]:
    protocol = RealtimeTranslator(beta=beta, duplex=duplex)
    progress = Progress()
    protocol.attach(progress)
    if offered:
        protocol.offer_transcripts("stt-tiny", DELAY_MS)
    protocol.start()
    session = {"input_audio_transcription": asks, "turn_detection": None} if beta else \
        {"type": "realtime", "audio": {"input": {"transcription": asks, "turn_detection": None}}}
    event = protocol.parse(json.dumps({"type": "session.update", "session": session}))
    return protocol, progress, [json.loads(m) for m in event.messages]


def piece(text: str, frame: int, *, flushed: bool = False, floor: float = 0.0) -> TranscriptPiece:
    """As the transcriber places it: its step's frame less the delay, not before ``floor`` (the
    frame after the last flush's mark)."""
    audio_ms = max(0.0, frame * 80.0 - DELAY_MS, floor)
    return TranscriptPiece(text, frame, int(audio_ms // 80), audio_ms, flushed)


def append(protocol: RealtimeTranslator, progress: Progress, frames: int) -> None:
    protocol.parse(json.dumps({"type": "input_audio_buffer.append", "audio": b64(bytes(PCM_FRAME_BYTES * frames))}))
    progress.frames_in += frames


def events(messages) -> list[dict]:
    return [json.loads(m) for m in messages]


def of(kind: str, messages: list[dict]) -> list[dict]:
    return [m for m in messages if m["type"] == kind]


@both_namings
def test_transcription_is_granted_and_shown_where_the_server_has_a_transcriber(beta):
    _, _, (updated,) = make(beta=beta)
    session = updated["session"]
    shown = session["input_audio_transcription"] if beta else session["audio"]["input"]["transcription"]
    assert shown == {"model": "stt-tiny"}


def test_without_a_transcriber_it_is_still_refused():
    _, _, (updated, error) = make(offered=False)
    assert error["error"]["code"] == "unsupported_setting"
    assert "transcription" not in updated["session"]["audio"]["input"]


def test_null_turns_it_off_and_nothing_is_sent():
    protocol, progress, _ = make()
    protocol.parse(json.dumps({"type": "session.update", "session": {"audio": {"input": {"transcription": None}}}}))
    append(protocol, progress, 5)
    assert protocol.input_text([piece(" hi", 9)]) == []


@both_namings
def test_a_commit_in_turn_mode_completes_its_item_at_the_flush_after_its_last_delta(beta):
    protocol, progress, _ = make(beta=beta)
    append(protocol, progress, 10)
    # Pieces before the commit wait for the item's id (no server VAD: the commit names it).
    assert protocol.input_text([piece(" he", 7)]) == []
    commit = protocol.parse(json.dumps({"type": "input_audio_buffer.commit"}))
    assert isinstance(commit, EndTurn)
    said = events(commit.messages)
    item = of("input_audio_buffer.committed", said)[0]["item_id"]
    assert [(e["item_id"], e["delta"]) for e in of(DELTA, said)] == [(item, " he")]
    said = events(protocol.input_text([piece("llo", 9)]))
    assert [(e["item_id"], e["delta"]) for e in said] == [(item, "llo")]
    # The session pads nothing (whole frames) and feeds the end-of-input mark at frame 10: the
    # flush's text, then the item is complete.
    progress.frames_in += 1
    flushed = events(protocol.input_text([piece(" you", 10, flushed=True), piece("", 10, flushed=True)]))
    assert [e["type"] for e in flushed] == [DELTA, COMPLETED]
    completed = flushed[-1]
    assert completed["item_id"] == item and completed["transcript"] == "hello you"
    assert completed["content_index"] == 0 and completed["usage"]["type"] == "duration"
    # A late piece of that item's audio is dropped, never a delta after completed.
    assert protocol.input_text([piece(" late", 9)]) == []
    # conversation.item.retrieve shows the transcript.
    retrieved = events(protocol.parse(json.dumps({"type": "conversation.item.retrieve", "item_id": item})).messages)
    assert retrieved[0]["item"]["content"][0]["transcript"] == "hello you"


def test_commits_that_run_ahead_of_the_steps_each_get_their_own_flush():
    protocol, progress, _ = make()
    append(protocol, progress, 4)
    first = of("input_audio_buffer.committed",
               events(protocol.parse('{"type": "input_audio_buffer.commit"}').messages))
    progress.frames_in += 1  # the mark, fed before the next append is read
    append(protocol, progress, 3)
    second = of("input_audio_buffer.committed",
                events(protocol.parse('{"type": "input_audio_buffer.commit"}').messages))
    items = [first[0]["item_id"], second[0]["item_id"]]
    # Only now do the first turn's pieces and flush come back from the model.
    said = events(protocol.input_text([piece(" one", 3)]))
    said += events(protocol.input_text([piece(" two", 4, flushed=True)]))
    said += events(protocol.input_text([piece(" three", 7, floor=400.0)]))
    said += events(protocol.input_text([piece(" four", 8, flushed=True, floor=400.0)]))
    assert [(e["type"], e["item_id"]) for e in said] == [
        (DELTA, items[0]), (DELTA, items[0]), (COMPLETED, items[0]),
        (DELTA, items[1]), (DELTA, items[1]), (COMPLETED, items[1])]
    assert [e["transcript"] for e in of(COMPLETED, said)] == ["one two", "three four"]


def test_without_a_flush_an_item_completes_once_the_output_passes_it_by_the_delay():
    protocol, progress, _ = make(duplex=True)
    append(protocol, progress, 5)
    commit = protocol.parse(json.dumps({"type": "input_audio_buffer.commit"}))
    assert isinstance(commit, Reply) and not isinstance(commit, EndTurn)  # duplex: no flush
    item = of("input_audio_buffer.committed", events(commit.messages))[0]["item_id"]
    append(protocol, progress, 10)
    said = events(protocol.input_text([piece(" a", 9)]))  # 220 ms: the item's audio (0-400 ms)
    assert [(e["type"], e["item_id"]) for e in said] == [(DELTA, item)]
    # The output reaches 400 + 500 ms at frame 12 (11.25 rounded up): then the item is done.
    progress.frames_out = 11
    assert of(COMPLETED, events(protocol.audio_out(bytes(PCM_FRAME_BYTES), 0))) == []
    done = of(COMPLETED, events(protocol.audio_out(bytes(PCM_FRAME_BYTES), 1)))
    assert [e["item_id"] for e in done] == [item] and done[0]["transcript"] == "a"
    # The next piece (audio at 500 ms) belongs to the open audio after the commit.
    assert protocol.input_text([piece(" b", 13)]) == []  # held: its item has no id yet


def test_held_pieces_are_bounded():
    protocol, progress, _ = make()
    append(protocol, progress, 1)
    for i in range(MAX_HELD_PIECES + 50):
        protocol.input_text([piece("x", 100 + i)])
    transcripts = protocol._transcripts
    assert transcripts is not None and len(transcripts._held) == MAX_HELD_PIECES


def test_a_clear_drops_the_open_audios_text():
    protocol, progress, _ = make()
    append(protocol, progress, 10)
    protocol.input_text([piece(" gone", 8)])
    protocol.parse(json.dumps({"type": "input_audio_buffer.clear"}))
    append(protocol, progress, 10)
    said = events(protocol.input_text([piece(" late", 12)]))  # 460 ms: cleared audio
    commit = events(protocol.parse('{"type": "input_audio_buffer.commit"}').messages)
    assert of(DELTA, said + commit) == []


@pytest.mark.parametrize("beta", [False, True], ids=["ga", "beta"])
def test_server_vad_names_the_item_early_so_deltas_flow_before_the_commit(beta):
    protocol, progress, _ = make(beta=beta)
    transcripts = protocol._transcripts
    assert transcripts is not None
    # What the translator does on the VAD's speech start (a real VAD needs real speech).
    said = events(transcripts.speech_started("item_speech"))
    said += events(protocol.input_text([piece(" yes", 8)]))
    assert [(e["type"], e["item_id"], e["delta"]) for e in said] == [(DELTA, "item_speech", " yes")]


def test_a_caller_who_never_pauses_holds_a_bounded_transcript():
    from duplexrt.protocols.realtime_transcripts import MAX_ITEM_CHARS

    protocol, progress, _ = make()
    transcripts = protocol._transcripts
    assert transcripts is not None
    transcripts.speech_started("item_long")
    sent = 0
    for i in range(MAX_ITEM_CHARS // 4 + 100):
        sent += len(protocol.input_text([piece("abcd", 7 + i)]))
    assert sent == MAX_ITEM_CHARS // 4 + 100  # every delta goes out
    assert len(str(transcripts._open_text)) == MAX_ITEM_CHARS  # the transcript kept stops growing


def _deep_size(transcripts) -> int:
    """What a session's caller transcript holds: its containers, items, texts and strings."""
    import sys

    size = sys.getsizeof(transcripts._held) + sum(sys.getsizeof(text) for text in transcripts._held)
    texts = [transcripts._open_text] + [item.text for item in transcripts._pending]
    size += sum(sys.getsizeof(item) for item in transcripts._pending) + sys.getsizeof(transcripts._pending)
    for text in texts:
        size += sys.getsizeof(text) + sys.getsizeof(text.parts) + sum(sys.getsizeof(p) for p in text.parts)
    return size


def test_a_sessions_transcript_stays_within_the_per_session_memory_table():
    from duplexrt.protocols.realtime_transcripts import (MAX_HELD_PIECES, MAX_ITEM_CHARS, MAX_PENDING_ITEMS,
                                                         MAX_TEXT_PARTS)
    from duplexrt.server.budget import transcript_bytes
    from duplexrt.transcribe.pieces import MAX_PIECE_CHARS

    protocol, _, _ = make()
    transcripts = protocol._transcripts
    assert transcripts is not None
    wide = "\U0001F600" * MAX_PIECE_CHARS  # the widest string a piece can be
    at = 0.0
    for k in range(MAX_PENDING_ITEMS + 3):  # more items than wait: the oldest complete at once
        transcripts.speech_started(f"item_{k}")
        for _ in range(MAX_ITEM_CHARS // MAX_PIECE_CHARS + 5):
            transcripts.pieces([TranscriptPiece(wide, 0, 0, at + 1.0)], 0.0)
        at += 100.0
        transcripts.committed(f"item_{k}", at)
    for _ in range(MAX_HELD_PIECES + 5):  # the open audio, no id yet
        transcripts.pieces([TranscriptPiece(wide, 0, 0, at + 1.0)], 0.0)
    assert len(transcripts._pending) == MAX_PENDING_ITEMS and len(transcripts._held) == MAX_HELD_PIECES
    bound = transcript_bytes(MAX_HELD_PIECES, MAX_PENDING_ITEMS, MAX_ITEM_CHARS, MAX_TEXT_PARTS, MAX_PIECE_CHARS)
    assert bound * 0.5 < _deep_size(transcripts) <= bound
