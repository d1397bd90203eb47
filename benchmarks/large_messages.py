"""What one oversized message costs the trio thread, with and without `audio.max_message_seconds`.

Two messages a hostile or careless client can send: a realtime `input_audio_buffer.append` of
about 16 MiB in `g711_ulaw` (parse, then decode when accepted), and 1 MiB of Ogg Opus silence on
a route that speaks Opus (decode).  Each is handled once without a bound (what the code did
before the bound existed) and once with the default bound of 10 s; the thread's CPU time and what
the message would have become are printed.  Run: `.venv/bin/python benchmarks/large_messages.py`.
"""

from __future__ import annotations

import base64
import json
import time

import numpy as np

from duplexrt.audio import AudioSpec, AudioTooLongError, make_decoder, make_encoder
from duplexrt.protocols.realtime import RealtimeProtocol

BOUNDS = (None, 10.0)


def realtime_append() -> None:
    raw = np.random.default_rng(0).integers(0, 255, 12 * 1024 * 1024 - 1024, dtype=np.uint8).tobytes()
    message = json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(raw).decode()})
    update = json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}})
    for bound in BOUNDS:
        protocol = RealtimeProtocol(max_message_seconds=bound)
        protocol.parse(update)
        decoder = make_decoder(protocol.input_spec, 24000, bound)
        started = time.thread_time()
        event = protocol.parse(message)
        if type(event).__name__ == "AudioIn":
            outcome = f"{decoder.decode(event.payload).nbytes / 1e6:.0f} MB of float32"
        else:
            outcome = f"refused: {event.code}"
        print(f"realtime append, max_message_seconds={bound}: {len(message) / 2**20:.1f} MiB, "
              f"{(time.thread_time() - started) * 1e3:.0f} ms CPU, {outcome}")


def opus_silence() -> None:
    spec = AudioSpec.create("opus", 24000, model_rate=24000)
    encoder = make_encoder(spec, 24000)
    ten_seconds = np.zeros(24000 * 10, np.float32)
    parts: list[bytes] = []
    while sum(map(len, parts)) < (1 << 20):
        parts.append(encoder.encode(ten_seconds))
    stream = (b"".join(parts) + encoder.flush())[: 1 << 20]
    for bound in BOUNDS:
        decoder = make_decoder(spec, 24000, bound)
        started = time.thread_time()
        try:
            outcome = f"{decoder.decode(stream).nbytes / 1e6:.0f} MB of float32"
        except AudioTooLongError as exc:
            outcome = f"refused ({'stream ended' if exc.stream_lost else 'message dropped'})"
        print(f"Ogg Opus silence, max_message_seconds={bound}: {len(stream) / 2**20:.1f} MiB, "
              f"{(time.thread_time() - started) * 1e3:.0f} ms CPU, {outcome}")


if __name__ == "__main__":
    realtime_append()
    opus_silence()
