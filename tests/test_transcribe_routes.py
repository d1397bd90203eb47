"""Caller transcripts on the routes, over real sockets on loopback: what a client receives is
the package's own inference's text, in the route's events, before the session's end."""

from __future__ import annotations

import numpy as np
import pytest
import trio

pytest.importorskip("torch")
pytest.importorskip("moshi")

from conftest import PATIENCE  # noqa: E402
from test_protocol_live import _converse, _server, check_sequence  # noqa: E402
from test_transcribe import FRAME, Reference, voice  # noqa: E402

TINY = ("transcriber.enabled=true", "transcriber.tiny=true")


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


def pcm16(frames: np.ndarray) -> tuple[bytes, np.ndarray]:
    """``frames`` as the pcm16 a client sends, and the float frames the model then steps."""
    wire = (np.clip(frames.reshape(-1), -1.0, 32767 / 32768) * 32768).round().astype("<i2")
    return wire.tobytes(), (wire.astype(np.float32) / 32768).reshape(-1, FRAME)


async def test_the_live_route_streams_the_callers_words_before_it_closes(nursery, reference):
    server = await _server(nursery, None, "backend.options.delay_frames=0", "runtime.slots=2",
                           "runtime.late_input=wait", *TINY)
    audio, frames = pcm16(voice(40, 10))
    with trio.fail_after(PATIENCE * 3):
        events = await _converse(f"ws://127.0.0.1:{server.ports[0]}/v1/live/sessions", audio)
    check_sequence(events)
    deltas = [e for e in events if e["type"] == "session.input_transcript.delta"]
    expected = reference.text(frames)
    assert [e["delta"] for e in deltas] == expected and expected
    # The caller's last words come before session.closed (the flush after session.close).
    assert events.index(deltas[-1]) < len(events) - 1
    delay_ms = 500
    assert [e["start_ms"] for e in deltas] == sorted(e["start_ms"] for e in deltas)
    assert all(e["end_ms"] - e["start_ms"] == 80 for e in deltas)
    assert all(e["start_ms"] <= 10 * 80 - delay_ms + 80 for e in deltas)
    # The mark that flushes it is one frame of the model's, not of the caller's.
    assert events[-1]["usage"]["frames_in"] == 10 and events[-1]["usage"]["frames_out"] == 11
