"""What one session may hold in memory, by route and format: the figures of the table in
docs/operator.md (Per-session memory).

A session's largest buffers are bounded in **seconds of audio**, never only in wall-clock time, so
that a client that makes the model talk faster than real time (it sends faster and reads
everything) holds no more than one that talks at the pace of speech:

- the resume journal (``duplexrt.wire.resume``): ``runtime.resume_journal_s`` seconds of the
  session's output as sent (``journal_bytes``);
- realtime turn mode's held audio (``protocols/realtime.py``, ``MAX_HELD_SECONDS``) and the JSON
  it becomes when released (``held_json_bytes``);
- the caller's transcript a realtime session keeps for its user items, with a transcriber on
  (``protocols/realtime_transcripts.py``): bounded in pieces and characters
  (``transcript_bytes``);
- the call's transcript record (``transcripts/record.py``, ``[transcripts]``): bounded in
  characters, and so in pieces (``call_transcript_bytes``).

The byte figures are upper bounds worked out from the format, so a test can hold the code to them
and the operator guide can print them.
"""

from __future__ import annotations

from duplexrt.audio import AudioFormat, AudioSpec

#: Opus has no fixed size per sample: its ceiling is 510 kbit/s (RFC 6716), plus the Ogg pages.
OPUS_CEILING_BYTES_PER_S = 64_000
#: Room per model frame for what goes with the audio: a message's framing (a JSON event's
#: fields, a binary kind byte), text pieces, transcripts.
MESSAGE_ALLOWANCE_PER_FRAME = 512


def audio_bytes_per_second(spec: AudioSpec) -> int:
    """The most bytes one second of audio takes in ``spec``, before any base64."""
    if spec.format is AudioFormat.OPUS:
        return OPUS_CEILING_BYTES_PER_S
    width = spec.format.bytes_per_sample
    assert width is not None
    return spec.sample_rate * width


def base64_size(size: int) -> int:
    """Bytes of base64 text for ``size`` bytes."""
    return 4 * ((size + 2) // 3)


def journal_bytes(spec: AudioSpec, seconds: float, frame_seconds: float, *, base64: bool) -> int:
    """The resume journal's cap: ``seconds`` of output in ``spec``, as the route sends it (base64
    in JSON on the realtime and live routes), plus each frame's allowance for the rest."""
    audio = int(audio_bytes_per_second(spec) * seconds)
    frames = int(seconds / frame_seconds) + 1
    return (base64_size(audio) if base64 else audio) + frames * MESSAGE_ALLOWANCE_PER_FRAME


def held_json_bytes(spec: AudioSpec, seconds: float, frame_seconds: float) -> int:
    """Realtime turn mode: the held audio's bytes (``seconds`` of ``spec``) and the JSON deltas it
    becomes on release, together."""
    audio = int(audio_bytes_per_second(spec) * seconds)
    frames = int(seconds / frame_seconds) + 1
    return audio + base64_size(audio) + frames * MESSAGE_ALLOWANCE_PER_FRAME


#: CPython's string object: at most this much beside its characters, and at most 4 bytes a
#: character (a string holding any character past U+FFFF).
STR_OVERHEAD = 80
STR_BYTES_PER_CHAR = 4
#: A pointer to a piece in a list or deque, and an item's own objects (its record, its text's).
POINTER = 8
ITEM_OVERHEAD = 400


def transcript_bytes(held_pieces: int, pending_items: int, item_chars: int, text_parts: int,
                     piece_chars: int) -> int:
    """The most a realtime session's caller transcript holds: ``held_pieces`` pieces waiting
    for an item's id, and the open item's and ``pending_items`` committed items' text, each at
    most ``item_chars`` characters in one joined string plus ``text_parts`` pieces not yet
    joined; a piece at most ``piece_chars`` characters."""
    piece = STR_OVERHEAD + STR_BYTES_PER_CHAR * piece_chars + POINTER
    item = STR_OVERHEAD + STR_BYTES_PER_CHAR * item_chars + text_parts * piece + ITEM_OVERHEAD
    return held_pieces * piece + (pending_items + 1) * item


#: A piece's place in a record's list (a pointer) and its time (4 bytes in an ``array``), with an
#: eighth more for the room a growing list or array keeps.
RECORD_SLOT = (POINTER + 4) * 9 // 8 + 1


def call_transcript_bytes(max_chars: int) -> int:
    """The most one call's transcript record holds while the call runs: ``max_chars``
    characters of both sides together, at worst in as many one-character pieces, each its own
    string with its list slot and its time."""
    return max_chars * (STR_OVERHEAD + RECORD_SLOT) + STR_BYTES_PER_CHAR * max_chars
