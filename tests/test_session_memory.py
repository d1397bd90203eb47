"""What one session may hold, and that it lets go of it when it ends (issue 32, defect 6).

The bounds are those of the README's per-session memory table (``duplexrt/server/budget.py``
works them out); the release is checked with weak references and the cycle collector off: an
ended session's journal, translator and buffers must go by reference counting alone, when the
session ends, not at a later collection.
"""

from __future__ import annotations

import gc
import json
import re
import weakref
from pathlib import Path

import numpy as np
import trio
import trio_websocket

from duplexrt.audio import AudioSpec
from duplexrt.protocols.realtime import MAX_HELD_SECONDS, RealtimeTranslator
from duplexrt.protocols.realtime_transcripts import (MAX_HELD_PIECES, MAX_ITEM_CHARS, MAX_PENDING_ITEMS,
                                                     MAX_TEXT_PARTS)
from duplexrt.config import TranscriptsConfig
from duplexrt.server.budget import call_transcript_bytes, held_json_bytes, journal_bytes, transcript_bytes
from duplexrt.transcribe.pieces import MAX_PIECE_CHARS

#: The table moved with the rest of the operator's reference out of the README (issue 40).
README = Path(__file__).resolve().parent.parent / "docs" / "operator.md"
FRAME = 1920
PATIENCE = 20.0


def _table_figures() -> dict[str, float]:
    """The README's per-session memory table: what each row says, in MB."""
    text = README.read_text()
    section = text.split("\n## Per-session memory\n", 1)[1].split("\n#", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and (found := re.fullmatch(r"([\d.]+) MB", cells[-1])):
            rows[f"{cells[0]} {cells[1]}"] = float(found.group(1))
    return rows


def test_the_readme_table_states_the_bounds_the_code_holds():
    rows = _table_figures()
    mb = 1e6
    f32 = AudioSpec("pcm_f32le", 24000)
    s16 = AudioSpec("pcm_s16le", 24000)
    opus = AudioSpec("opus", 24000)
    expected = {
        "`/v1/duplex` journal, pcm_f32le 24 kHz": journal_bytes(f32, 15, 0.08, base64=False),
        "`/v1/duplex` journal, pcm_s16le 24 kHz": journal_bytes(s16, 15, 0.08, base64=False),
        "`/api/chat` journal, Opus": journal_bytes(opus, 15, 0.08, base64=False),
        "`/v1/realtime`, `/v1/live/sessions` journal, pcm16 24 kHz": journal_bytes(s16, 15, 0.08, base64=True),
        "`/v1/realtime` held turn audio and its JSON, pcm16 24 kHz":
            held_json_bytes(s16, MAX_HELD_SECONDS, 0.08),
        "`/v1/realtime` the caller's transcript for its items (a transcriber on)":
            transcript_bytes(MAX_HELD_PIECES, MAX_PENDING_ITEMS, MAX_ITEM_CHARS, MAX_TEXT_PARTS, MAX_PIECE_CHARS),
        "every route the call's transcript record (`[transcripts]`, on by default)":
            call_transcript_bytes(TranscriptsConfig().max_chars_per_call),
    }
    assert set(rows) == set(expected), rows
    for name, figure in expected.items():
        assert rows[name] == round(figure / mb, 2), (name, figure)


async def test_a_client_faster_than_real_time_that_reads_everything_keeps_the_journal_at_its_cap(start_server):
    """40 s of audio in a few seconds, every echo read: the journal holds its seconds of audio,
    not its seconds of wall-clock time."""
    running = await start_server()
    rng = np.random.default_rng(5)
    frame = (rng.standard_normal(FRAME) * 0.1).astype(np.float32).tobytes()
    cap = journal_bytes(AudioSpec("pcm_f32le", 24000), 15, 0.08, base64=False)
    async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
        await ws.get_message()
        (entry,) = running.server._resumable.values()
        largest = 0
        for _ in range(500):
            await ws.send_message(frame)
            assert await ws.get_message() == frame
            largest = max(largest, entry.transport.journal_bytes)
    assert cap - 2 * len(frame) < largest <= cap


def test_held_turn_audio_stays_within_its_seconds_whatever_its_pace():
    translator = RealtimeTranslator(model_rate=24000)
    translator.start()
    chunk = b"\1\0" * FRAME
    for _ in range(int(MAX_HELD_SECONDS / 0.08) * 3):  # three times the bound, no response active
        translator.audio_out(chunk, 1)
    held = sum(len(payload) for payload, _ in translator._held)
    assert held <= MAX_HELD_SECONDS / 0.08 * len(chunk)
    assert held + 4 * held / 3 <= held_json_bytes(AudioSpec("pcm_s16le", 24000), MAX_HELD_SECONDS, 0.08)


async def test_an_ended_session_frees_its_journal_translator_and_buffers_by_reference_counting(start_server):
    running = await start_server()
    server = running.server
    gc.collect()
    gc.disable()
    try:
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
            await ws.get_message()
            for _ in range(20):
                await ws.send_message(b"\0" * FRAME * 4)
                await ws.get_message()
            (entry,) = server._resumable.values()
            (session,) = server.runtime.sessions
            alive = {name: weakref.ref(thing) for name, thing in [
                ("transport", entry.transport), ("translator", entry.translator), ("session", session),
                ("reader", session.reader), ("writer", session.writer)]}
            del entry, session
            await ws.send_message(json.dumps({"type": "input.end"}))
            while json.loads(await ws.get_message())["type"] != "session.end":
                pass
        with trio.fail_after(PATIENCE):
            while server.admitted or server.runtime.sessions:
                await trio.sleep(0.01)
        # The scheduler thread's last batch (the slot's close) names the session until its next
        # step: one more session's step moves it on.  That is a reference, not a cycle.
        async with trio_websocket.open_websocket_url(running.url("/v1/duplex")) as ws:
            await ws.get_message()
            await ws.send_message(b"\0" * FRAME * 4)
            await ws.get_message()
        left = [name for name, ref in alive.items() if ref() is not None]
        assert left == [], left
    finally:
        gc.enable()
