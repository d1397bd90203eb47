"""Appends read without json scanning their base64 (``Base64Audio.read_append``): the same events
as the general path for every shape a client can send, and the general path for the rest.

Each message is parsed twice, by a fresh translator with the fast read and by one without it
(``read_append`` answering None, so ``json.loads`` reads everything): the two must agree, event
for event.  The messages include the shapes the SDKs write, and shapes built to fool a reader that
looks for ``"audio":"`` in the text: the key inside another string, an escaped quote, a nested
object, a duplicate key, bad base64, half a sample, too much audio.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest

from duplexrt.protocols import b64audio, events
from duplexrt.protocols.b64audio import Base64Audio
from duplexrt.protocols.events import AudioIn
from duplexrt.protocols.live import LiveTranslator
from duplexrt.protocols.realtime import RealtimeTranslator

PCM = np.arange(-1920, 1920, 2, dtype="<i2").tobytes()  # 80 ms at 24 kHz
AUDIO = base64.b64encode(PCM).decode("ascii")
APPEND = "input_audio_buffer.append"


def shapes(kind: str) -> list[str]:
    """Messages of every shape, most of them ending in an "audio" member."""
    audio, half = AUDIO, base64.b64encode(PCM[:-1]).decode("ascii")
    return [
        json.dumps({"type": kind, "audio": audio}),  # the openai SDK's shape
        json.dumps({"type": kind, "audio": audio}, separators=(",", ":")),
        json.dumps({"event_id": "evt_1", "type": kind, "audio": audio}, separators=(",", ":")),  # pipecat
        json.dumps({"type": kind, "event_id": "e\\\"2", "audio": audio}),
        json.dumps({"type": kind, "audio": audio, "event_id": "last"}),  # audio not last: general path
        '{"type": "%s", "audio" : "%s"}' % (kind, audio),
        ' {"type":"%s","audio":"%s"}' % (kind, audio),
        '{"type":"%s","audio":"%s"}' % (kind, audio[:-4] + "\\u0041AAA"),  # an escape: general path
        '{"type":"%s","audio":"%s"}' % (kind, audio[:100] + "\\n" + audio[100:]),  # MIME style
        '{"type":"%s","audio":"%s"}' % (kind, audio[:100] + "\n" + audio[100:]),  # raw newline: not JSON
        '{"type":"%s","audio":"%s"}' % (kind, half),  # half a sample
        '{"type":"%s","audio":"%s*"}' % (kind, audio),  # not base64
        '{"type":"%s","audio":""}' % kind,
        '{"type":"%s","audio":"%s"}}' % (kind, audio),
        '{"type":"%s","audio":"%s"' % (kind, audio),
        '{"type":"%s","\\"audio":"%s"}' % (kind, audio),  # the key is '"audio'
        '{"type":"%s","audio":"","\\"audio":"%s"}' % (kind, audio),
        '{"type":"%s","x":"\\"audio\\":\\"%s"}' % (kind, audio),  # inside another string
        '{"type":"%s","x":"\\\\","audio":"%s"}' % (kind, audio),  # an escaped backslash before it
        '{"type":"%s","x":{"audio":"%s"}}' % (kind, audio),  # nested
        '{"x":{"y":"z"},"type":"%s","audio":"%s"}' % (kind, audio),
        '{"type":"%s","type":"session.update","audio":"%s"}' % (kind, audio),  # the last type counts
        '{"type":"%s","audio":"AAAA","audio":"%s"}' % (kind, audio),  # the last audio counts
        '{"type":"nope","audio":"%s"}' % audio,
        '{"type":7,"audio":"%s"}' % audio,
        '["type","audio":"%s"}' % audio,
        '{"audio":"%s"}' % audio,
        '"audio":"%s"}' % audio,
        '{"type":"%s","audio":"%s"}' % (kind, audio + "=="),
        '{"type":"%s","audio":"%s"}' % (kind, base64.b64encode(PCM * 40).decode("ascii")),  # over the bound
    ]


def outcome(event) -> tuple:
    if isinstance(event, AudioIn):
        return ("audio", bytes(event.payload), [json.loads(m) for m in event.messages])
    return (type(event).__name__, event)


def realtime() -> RealtimeTranslator:
    protocol = RealtimeTranslator(max_message_seconds=1.0, server_vad=True)
    protocol.start()
    return protocol


def live() -> LiveTranslator:
    protocol = LiveTranslator(max_message_seconds=1.0)
    protocol.parse(json.dumps({"type": "session.start", "session": {"model": "m"}}))
    return protocol


@pytest.mark.parametrize(("make", "kind"), [(realtime, APPEND), (live, "session.input_audio.append")])
def test_every_shape_gets_the_event_the_general_path_gives(make, kind, monkeypatch):
    fast = [outcome(make().parse(message)) for message in shapes(kind)]
    monkeypatch.setattr(Base64Audio, "read_append", lambda self, message: None)
    general = [outcome(make().parse(message)) for message in shapes(kind)]
    for message, ours, theirs in zip(shapes(kind), fast, general, strict=True):
        assert ours == theirs, message[:120]
    assert fast[0][:2] == ("audio", PCM)  # and the usual append is audio


@pytest.mark.parametrize(("make", "kind"), [(realtime, APPEND), (live, "session.input_audio.append")])
def test_the_usual_appends_are_not_scanned_as_json(make, kind, monkeypatch):
    """The SDKs' shapes go through ``json.loads`` only for their few bytes before the audio, and
    only the first time those bytes are seen."""
    parsed: list[int] = []
    loads = json.loads

    def measured(text, *args, **kwargs):
        parsed.append(len(text))
        return loads(text, *args, **kwargs)

    protocol = make()
    monkeypatch.setattr(b64audio, "_APPEND_HEADS", set())
    monkeypatch.setattr(events.json, "loads", measured)
    for message in shapes(kind)[:4]:
        event = protocol.parse(message)
        assert isinstance(event, AudioIn) and event.payload == PCM
    assert len(parsed) == 4 and max(parsed) < 100, parsed
    for message in shapes(kind)[:4]:  # the same text before the audio: parsed once
        assert protocol.parse(message).payload == PCM
    assert len(parsed) == 4


def test_live_appends_before_session_start_are_refused_either_way():
    protocol = LiveTranslator()
    event = protocol.parse(json.dumps({"type": "session.input_audio.append", "audio": AUDIO}))
    assert event.code == "session_not_started"


@pytest.mark.parametrize(("make", "kind"), [(realtime, APPEND), (live, "session.input_audio.append")])
def test_huge_heads_before_the_audio_are_not_kept(make, kind):
    """The text before the audio is remembered only while it is short (the SDKs' few bytes): a
    client that sends appends with a large, ever-different member before ``"audio"`` must not
    leave its texts alive in the process after its session is gone (defect 7 of issue 32)."""
    import gc
    import tracemalloc

    protocol = make()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for n in range(40):
            message = '{"type":"%s","pad":"%s%d","audio":"%s"}' % (kind, "x" * 200_000, n, AUDIO)
            event = protocol.parse(message)
            assert isinstance(event, AudioIn) and event.payload == PCM
            del message, event
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert kept < 1 << 20, f"{kept} bytes still held after 40 appends with 200 kB heads"
