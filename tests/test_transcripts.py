"""Per-call transcripts (issue 41): both sides of a call with their times, kept after it ends to be
fetched by the id its client was told (``GET /v1/transcripts/{id}``), bounded by age, count and
bytes, behind the API key when one is set; and appended to a JSON Lines file per day off the hot
path.  Real sockets on loopback where a route is involved."""

from __future__ import annotations

import json
import logging
import os
import stat

import numpy as np
import pytest
import trio

from conftest import FRAME, PATIENCE, backend_info, duplex_session, http_get
from duplexrt.backends.echo import EchoBackend
from duplexrt.core.handoffs import HandoffKind
from duplexrt.transcribe.pieces import TranscriptPiece
from duplexrt.transcripts.ids import ID_PATTERN
from duplexrt.transcripts.record import CallTranscript
from duplexrt.transcripts.sink import file_name
from duplexrt.transcripts.store import TranscriptStore


class TalkingEcho(EchoBackend):
    """FAKE (a test hook on the real echo model): every row also says ``word`` on every
    ``every``-th step of its own, so a call has model text without a language model."""

    word = "hi"
    every = 3

    def __init__(self, config) -> None:
        super().__init__(backend_info(config, "echo"), config.backend.options)
        self.steps = np.zeros(config.runtime.slots, dtype=np.int64)

    def open_slot(self, slot, session):
        super().open_slot(slot, session)
        self.steps[slot] = 0

    def step(self, rows, inputs, outputs):
        super().step(rows, inputs, outputs)
        self.steps[rows] += 1
        return [f" {self.word}{self.steps[row]}" if self.steps[row] % self.every == 0 else "" for row in rows]


class LongWinded(TalkingEcho):
    """FAKE: 64 characters of text on every step (a hostile model, or a long call, in miniature)."""

    word = "x" * 60
    every = 1


def audio(frames: int, seed: int = 1) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(frames * FRAME) * 0.1).astype(np.float32)


async def call(served, frames: int = 12, seed: int = 1) -> tuple[str, list[dict]]:
    """One /v1/duplex call to its end: the id it was told, and its events."""
    _, events = await duplex_session(served.url("/v1/duplex"), audio(frames, seed))
    created = next(e for e in events if e["type"] == "session.created")
    ended = next(e for e in events if e["type"] == "session.end")
    assert created["id"] == ended["id"] and ID_PATTERN.fullmatch(created["id"])
    return created["id"], events


async def fetch(served, call_id: str, headers: str = "") -> tuple[int, dict, dict]:
    status, fields, body = await served.get(f"/v1/transcripts/{call_id}", headers=headers)
    return status, fields, json.loads(body)


# -- over the routes -------------------------------------------------------------------------


async def test_a_calls_transcript_is_fetched_by_its_id_after_it_ends_with_the_models_text_and_times(start_server):
    served = await start_server(backend=TalkingEcho)
    call_id, events = await call(served, frames=12)
    status, fields, record = await fetch(served, call_id)
    assert status == 200 and fields["cache-control"] == "no-store"
    assert record["id"] == call_id and record["route"] == "/v1/duplex" and record["reason"] == "stop"
    # The model's text, each piece at its output frame's start (every third frame: 2, 5, 8, 11).
    assert record["model"] == [{"text": f" hi{k}", "ms": (k - 1) * 80} for k in (3, 6, 9, 12)]
    assert record["model_text"] == " hi3 hi6 hi9 hi12"
    texts = [e["text"] for e in events if e["type"] == "text"]
    assert "".join(texts) == record["model_text"]
    assert record["caller"] == [] and record["truncated"] is False
    assert record["started"] <= record["ended"] and record["duration_s"] >= 0
    assert isinstance(record["session"], int)


async def test_the_realtime_and_live_routes_ids_are_the_ones_their_sessions_announce(start_server):
    import trio_websocket

    served = await start_server(backend=TalkingEcho)
    for path, start in (("/v1/realtime", None), ("/v1/live/sessions", {"type": "session.start", "session": {"model": "m"}})):
        async with trio_websocket.open_websocket_url(served.url(path)) as ws:
            if start is not None:  # Live: the session is created by the client's session.start
                await ws.send_message(json.dumps(start))
            first = json.loads(await ws.get_message())
            call_id = first.get("session", first).get("id")
            assert call_id and ID_PATTERN.fullmatch(call_id), first
        # The client hung up: the call ends, and its transcript is there to fetch.
        with trio.fail_after(PATIENCE):
            while (answer := await fetch(served, call_id))[0] != 200:
                await trio.sleep(0.01)
        assert answer[2]["route"] == path and answer[2]["reason"] == "client_closed", answer


async def test_an_unknown_id_is_a_404_with_a_reason_and_nothing_is_listed(start_server):
    served = await start_server()
    for path in ("/v1/transcripts/call_000000000000000000000000", "/v1/transcripts", "/v1/transcripts/"):
        status, fields, body = await served.get(path)
        assert status == 404 and fields["content-type"] == "application/json", path
        assert json.loads(body)["reason"]


async def test_with_an_api_key_a_transcript_needs_it(start_server):
    served = await start_server('server.api_key="sesame-sesame-1234"')
    _, events = await duplex_session(served.url("/v1/duplex") + "?api_key=sesame-sesame-1234", audio(4))
    call_id = next(e for e in events if e["type"] == "session.created")["id"]
    for headers in ("", "authorization: Bearer wrong-key-wrong-key\r\n"):
        status, fields, body = await served.get(f"/v1/transcripts/{call_id}", headers=headers)
        assert status == 401 and fields["www-authenticate"] == "Bearer"
        assert call_id.encode() not in body
    # Without the key, an unknown id and a known one look the same: 401 before any lookup.
    status, _, _ = await served.get("/v1/transcripts/call_000000000000000000000000")
    assert status == 401
    status, _, record = await fetch(served, call_id, "authorization: Bearer sesame-sesame-1234\r\n")
    assert status == 200 and record["id"] == call_id


async def test_a_transcript_expires_after_keep_seconds(start_server):
    served = await start_server("transcripts.keep_seconds=30")
    now = [1000.0]
    served.server.runtime.transcripts.store._clock = lambda: now[0]  # an injected clock: no sleeping
    call_id, _ = await call(served, frames=3)
    now[0] += 29.9
    assert (await fetch(served, call_id))[0] == 200
    now[0] += 0.2
    status, _, body = await fetch(served, call_id)
    assert status == 404 and "30 s" in body["reason"]


async def test_the_oldest_calls_go_first_past_max_calls(start_server):
    served = await start_server("transcripts.max_calls=2")
    ids = [(await call(served, frames=2, seed=k))[0] for k in range(3)]
    assert [(await fetch(served, i))[0] for i in ids] == [404, 200, 200]
    assert len(served.server.runtime.transcripts.store) == 2


async def test_a_huge_transcript_is_capped_and_marked_truncated(start_server):
    served = await start_server("transcripts.max_chars_per_call=1000", backend=LongWinded)
    call_id, _ = await call(served, frames=40)  # 40 pieces of 64 characters: 2560
    status, _, record = await fetch(served, call_id)
    assert status == 200 and record["truncated"] is True
    assert 1000 - 64 < len(record["model_text"]) <= 1000 and len(record["model"]) < 40


async def test_keeping_off_records_nothing(start_server):
    served = await start_server("transcripts.keep_seconds=0")
    assert served.server.runtime.transcripts is None
    call_id, _ = await call(served, frames=2)
    status, _, body = await fetch(served, call_id)
    assert status == 404 and body["error"] == "not_kept"


# -- the caller's side, with the tiny speech-to-text model -------------------------------------


async def test_the_callers_words_are_in_the_transcript_with_their_place_in_the_audio(start_server):
    pytest.importorskip("torch")
    pytest.importorskip("moshi")
    from test_transcribe import voice

    served = await start_server("runtime.slots=2", "transcriber.enabled=true", "transcriber.tiny=true",
                                backend=TalkingEcho)
    with trio.fail_after(PATIENCE * 3):
        _, events = await duplex_session(served.url("/v1/duplex"), voice(40, 12).reshape(-1))
    call_id = next(e for e in events if e["type"] == "session.created")["id"]
    heard = [{"text": e["text"], "audio_ms": int(e["audio_ms"])} for e in events if e["type"] == "input_text"]
    status, _, record = await fetch(served, call_id)
    assert status == 200 and heard and record["caller"] == heard
    assert record["caller_text"] == "".join(e["text"] for e in heard)
    assert record["model"] and record["model_text"] == "".join(e["text"] for e in events if e["type"] == "text")


# -- the sink ----------------------------------------------------------------------------------


async def wait_written(sink, lines: int) -> None:
    with trio.fail_after(PATIENCE):
        while sink.written + sink.lost < lines:
            await trio.sleep(0.01)


async def test_the_sink_appends_one_private_line_per_call_to_the_days_file(start_server, tmp_path):
    directory = tmp_path / "transcripts"
    served = await start_server('transcripts.sink="jsonl"', f'transcripts.directory="{directory}"',
                                backend=TalkingEcho)
    ids = [(await call(served, frames=6, seed=k))[0] for k in range(2)]
    transcripts = served.server.runtime.transcripts
    await wait_written(transcripts.sink, 2)
    [path] = directory.iterdir()
    assert path.name.startswith("transcripts-") and path.name.endswith(".jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["id"] for line in lines] == ids
    assert path.name == file_name(trio_time_of(lines[0]["ended"]))
    assert lines[0]["model_text"] == " hi3 hi6"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    # At most one worker-thread crossing per ended call; none per frame.
    handoffs = served.server.runtime.handoffs.statistics()
    assert 1 <= handoffs[HandoffKind.TRANSCRIPT_WRITE] <= 2


def trio_time_of(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


async def test_a_sink_that_cannot_write_harms_no_call_and_logs_once(start_server, tmp_path, caplog):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    served = await start_server('transcripts.sink="jsonl"', f'transcripts.directory="{blocked / "below"}"')
    caplog.set_level(logging.INFO, "duplexrt.transcripts")
    for k in range(3):
        call_id, events = await call(served, frames=3, seed=k)
        end = next(e for e in events if e["type"] == "session.end")
        assert end["reason"] == "stop" and "error" not in end
        assert (await fetch(served, call_id))[0] == 200  # still kept to be fetched
        await wait_written(served.server.runtime.transcripts.sink, k + 1)
    sink = served.server.runtime.transcripts.sink
    assert sink.lost == 3 and sink.written == 0
    errors = [r for r in caplog.records if r.name == "duplexrt.transcripts" and r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "cannot write" in errors[0].getMessage()


async def test_many_calls_ending_at_once_are_all_kept_and_written(start_server, tmp_path):
    served = await start_server("runtime.slots=8", 'transcripts.sink="jsonl"',
                                f'transcripts.directory="{tmp_path}"', backend=TalkingEcho)
    ids: list[str] = []

    async def one(seed: int) -> None:
        ids.append((await call(served, frames=6, seed=seed))[0])

    async with trio.open_nursery() as nursery:
        for seed in range(8):
            nursery.start_soon(one, seed)
    transcripts = served.server.runtime.transcripts
    await wait_written(transcripts.sink, 8)
    written = [json.loads(line)["id"] for path in tmp_path.iterdir() for line in path.read_text().splitlines()]
    assert sorted(written) == sorted(ids) and len(set(ids)) == 8
    assert transcripts.sink.writes <= 8
    assert [(await fetch(served, i))[0] for i in ids] == [200] * 8


# -- the parts ---------------------------------------------------------------------------------


def test_the_store_expires_by_age_and_evicts_the_oldest_by_count_and_bytes():
    now = [0.0]
    store = TranscriptStore(keep_seconds=10, max_calls=3, max_bytes=100, clock=lambda: now[0])
    for k in range(4):
        assert store.keep(f"c{k}", b"x" * 20)
        now[0] += 1
    assert [store.get(f"c{k}") is not None for k in range(4)] == [False, True, True, True]
    assert store.keep("big", b"y" * 50)  # four calls: the oldest goes
    assert store.get("c1") is None and len(store) == 3 and store.bytes == 90
    assert store.keep("big2", b"y" * 50)  # 140 bytes: the oldest go until it fits
    assert store.get("c2") is None and store.get("c3") is None and store.bytes == 100
    assert not store.keep("huge", b"z" * 101) and store.too_big == 1
    now[0] += 10
    assert store.get("big2") is None and len(store) == 0 and store.bytes == 0


def test_a_record_keeps_at_most_its_characters_whatever_comes():
    record = CallTranscript("call_x", "/v1/duplex", 80.0, max_chars=100)
    for frame in range(1000):
        record.model("y" * 500, frame)  # each piece cut to 64 characters
        record.caller([TranscriptPiece("z", frame, frame, frame * 80.0), TranscriptPiece("", frame, frame, 0.0)])
    body = record.as_dict()
    assert body["truncated"] is True
    assert len(body["model_text"]) + len(body["caller_text"]) <= 100
    assert body["model"][0] == {"text": "y" * 64, "ms": 0} and body["caller"][0] == {"text": "z", "audio_ms": 0}


def test_a_record_holds_no_more_memory_than_the_per_session_table_says():
    """The worst case the table's bound is worked out for: the whole budget in one-character
    pieces (each its own string), measured with tracemalloc."""
    import tracemalloc

    from duplexrt.config import TranscriptsConfig
    from duplexrt.server.budget import call_transcript_bytes

    cap = TranscriptsConfig().max_chars_per_call
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        record = CallTranscript("call_x", "/v1/duplex", 80.0, max_chars=cap)
        for frame in range(cap + 10):
            record.model(chr(0x1F600 + frame % 64), frame)  # not a cached one-character string
        used = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert record.truncated and len(record.as_dict()["model"]) == cap
    assert 0 < used <= call_transcript_bytes(cap), used


async def test_a_call_whose_client_was_told_no_id_goes_to_the_sink_only(tmp_path):
    from duplexrt.config import TranscriptsConfig
    from duplexrt.core.handoffs import Handoffs
    from duplexrt.transcripts.keeper import Transcripts

    transcripts = Transcripts(TranscriptsConfig(sink="jsonl", directory=str(tmp_path)), Handoffs())
    for call_id in (None, "call_told"):
        record = transcripts.record(call_id, "/api/chat", 80.0)
        record.finish("stop", None)
        transcripts.keep(record)
    assert len(transcripts.store) == 1 and transcripts.store.get("call_told") is not None
    assert transcripts.sink is not None and transcripts.sink._receive.statistics().current_buffer_used == 2


async def test_the_last_calls_reach_the_file_when_the_runtime_stops(tmp_path):
    """Calls that end just before the runtime stops: their lines are written on the way out."""
    from conftest import make_config, run_session, spec
    from duplexrt.runtime import open_runtime

    config = make_config("backend.options.delay_frames=0", 'transcripts.sink="jsonl"',
                         f'transcripts.directory="{tmp_path}"')
    wire = spec("pcm_f32le")
    async with open_runtime(config, TalkingEcho(config)) as runtime:
        for seed in range(3):
            run = await run_session(runtime, [audio(6, seed).tobytes()], wire)
            assert run.end is not None and str(run.end.reason) == "stop"
    lines = [json.loads(line) for path in tmp_path.iterdir() for line in path.read_text().splitlines()]
    assert len(lines) == 3 and all(line["model_text"] == " hi3 hi6" for line in lines)
    assert all(line["id"].startswith("call_") and line["route"] == "" for line in lines)
