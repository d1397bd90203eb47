"""``audio.max_message_seconds``: one message may carry only so much audio, on every route and format.

A message over the bound is refused from its size before it is decoded (PCM, G.711, realtime
base64) or as soon as decoding passes the bound (Ogg Opus); the session goes on (or, for an Ogg
stream cut short, ends with 1009) and every other session's audio stays exact.  Messages of more
than a second of PCM are decoded on a worker thread, counted; smaller ones stay inline.
"""

from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import trio

from conftest import (
    FRAME,
    MODEL_RATE,
    PATIENCE,
    make_config,
    model_frames,
    noise,
    run_sessions,
    spec,
    synthetic_wire,
    wire_messages,
)
from duplexrt.audio import AudioTooLongError, make_decoder, make_encoder
from duplexrt.audio.formats import INLINE_DECODE_SECONDS
from duplexrt.core.handoffs import HandoffKind
from duplexrt.runtime import open_runtime
from duplexrt.protocols import b64audio
from duplexrt.protocols.events import AudioIn
from duplexrt.protocols.moshi import MoshiTranslator
from duplexrt.protocols.realtime import RealtimeTranslator
from duplexrt.reasons import CloseCode
from duplexrt.wire.transport import TransportClosed, memory_transport_pair

FORMATS = ["pcm_f32le", "pcm_s16le", "g711_ulaw", "g711_alaw"]


def opus_stream(seconds: float, seed: int = 0) -> bytes:
    wire = spec("opus")
    encoder = make_encoder(wire, MODEL_RATE)
    return encoder.encode(noise(int(seconds * MODEL_RATE), seed)) + encoder.flush()


class CountingReader:
    """The real sphn reader, counting the bytes it is given."""

    def __init__(self, reader) -> None:
        self.reader = reader
        self.fed = 0

    def append_bytes(self, data: bytes):
        self.fed += len(data)
        return self.reader.append_bytes(data)


# -- decoders ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rate", [8000, 16000, MODEL_RATE])
def test_pcm_decoders_refuse_a_message_over_the_bound_from_its_size(fmt: str, rate: int) -> None:
    wire = spec(fmt, rate)
    bound = wire.format.bytes_per_sample * rate * 2  # 2 s
    signal = noise(2 * rate + 1, seed=1)
    exact, over = wire_messages(signal[:-1], wire, [2 * rate])[0], wire_messages(signal, wire, [2 * rate + 1])[0]
    assert len(exact) == bound and len(over) == bound + wire.format.bytes_per_sample
    decoder = make_decoder(wire, MODEL_RATE, max_seconds=2.0)
    first = decoder.decode(exact[:1000])
    with pytest.raises(AudioTooLongError, match=rf"{len(over)} bytes holds 2\.00 s .* at most 2 s per message "
                                                r"\(audio\.max_message_seconds\)") as caught:
        decoder.decode(over)
    assert not caught.value.stream_lost
    rest = decoder.decode(exact[1000:])  # nothing of the refused message reached the resampler
    fresh = make_decoder(wire, MODEL_RATE, max_seconds=2.0).decode(exact)
    assert np.array_equal(np.concatenate([first, rest]), fresh)
    assert decoder.max_bytes == bound
    assert decoder.inline_bytes == int(INLINE_DECODE_SECONDS * rate) * wire.format.bytes_per_sample


def test_an_opus_message_over_the_bound_is_stopped_early_and_ends_the_stream() -> None:
    stream = opus_stream(6.0)
    decoder = make_decoder(spec("opus"), MODEL_RATE, max_seconds=1.0)
    counting = CountingReader(decoder._reader)
    decoder._reader = counting
    with pytest.raises(AudioTooLongError, match=r"more than 1 s of audio .*cannot go on") as caught:
        decoder.decode(stream)
    assert caught.value.stream_lost
    assert counting.fed < len(stream) / 3  # about a sixth of the stream was read, not all of it
    with pytest.raises(Exception, match="already failed"):
        decoder.decode(stream[:100])


def test_an_opus_message_only_its_last_piece_takes_over_the_bound_is_dropped_and_the_stream_goes_on() -> None:
    stream = opus_stream(1.0)
    head, body = stream[:200], stream[200:]
    pieces = [body[i:i + 300] for i in range(0, len(body), 300)]
    reference = make_decoder(spec("opus"), MODEL_RATE)
    expected = [reference.decode(head), *(reference.decode(p) for p in pieces)]
    most = max(part.size for part in expected[1:])
    assert 0 < sum(part.size == most for part in expected[1:]) < len(pieces)
    # Each piece is one read (under 512 bytes): the bound can only be passed by its last part.
    decoder = make_decoder(spec("opus"), MODEL_RATE, max_seconds=(most - 1) / MODEL_RATE)
    decoder.decode(head)
    for piece, part in zip(pieces, expected[1:], strict=True):
        if part.size == most:
            with pytest.raises(AudioTooLongError, match="it was dropped") as caught:
                decoder.decode(piece)
            assert not caught.value.stream_lost
        else:  # the stream went on as if nothing had happened
            assert np.array_equal(decoder.decode(piece), part)


# -- raw sessions -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["pcm_f32le", "pcm_s16le", "g711_ulaw"])
async def test_a_raw_message_over_the_bound_is_refused_and_the_session_goes_on(fmt: str) -> None:
    config = make_config("runtime.slots=4", "backend.name=synthetic", "audio.max_message_seconds=3")
    wire = spec(fmt)
    rate = wire.sample_rate
    small = [wire_messages(noise(n, seed=n), wire, [n])[0] for n in (rate // 10, rate // 20, 777)]
    two_seconds = wire_messages(noise(2 * rate, seed=5), wire, [2 * rate])[0]
    four_seconds = wire_messages(noise(4 * rate, seed=6), wire, [4 * rate])[0]
    session = [small[0], four_seconds, small[1], two_seconds, small[2]]
    healthy = wire_messages(noise(3 * FRAME, seed=7), wire, [1000, 1000, 3 * FRAME - 2000])
    async with open_runtime(config) as runtime:
        run, other = await run_sessions(runtime, [(session, wire, 1), (healthy, wire, 2)])
        stats = runtime.handoffs.statistics()

    [error] = run.client.errors
    assert error["code"] == "audio_too_long" and "4.00 s" in error["message"]
    kept = [small[0], small[1], two_seconds, small[2]]
    frames = model_frames(kept, wire)
    assert run.end.reason == "stop" and run.end.frames_in == len(frames)
    assert bytes(run.client.audio) == synthetic_wire(frames, 1, wire)
    assert other.client.errors == []
    assert bytes(other.client.audio) == synthetic_wire(model_frames(healthy, wire), 2, wire)
    # The two-second message went to a worker thread; nothing else did (the refused one neither).
    assert stats[HandoffKind.LARGE_DECODE_OFFLOAD] == 1
    assert stats.offloads == 1


# -- realtime ---------------------------------------------------------------------------------------


def test_realtime_refuses_an_append_over_the_bound_before_decoding_its_base64(monkeypatch) -> None:
    protocol = RealtimeTranslator(max_message_seconds=1.0)
    one_second = bytes(2 * 24000)
    accepted = protocol.parse(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(one_second).decode()}))
    assert isinstance(accepted, AudioIn) and accepted.payload == one_second

    def no_decoding(*args, **kwargs):
        raise AssertionError("the base64 was decoded")

    monkeypatch.setattr(b64audio, "decode_strict", no_decoding)
    for audio in (base64.b64encode(one_second + bytes(4)).decode(), base64.encodebytes(bytes(96000)).decode()):
        error = protocol.parse(json.dumps({"type": "input_audio_buffer.append", "event_id": "e7", "audio": audio}))
        assert error.code == "audio_too_long" and error.event_id == "e7" and not error.fatal
        assert "at most 1 s per input_audio_buffer.append" in error.message
    # G.711 at 8 kHz carries a second in a third of the bytes: the bound follows the format.
    protocol.parse(json.dumps({"type": "session.update", "session": {"input_audio_format": "g711_ulaw"}}))
    error = protocol.parse(json.dumps({"type": "input_audio_buffer.append",
                                       "audio": base64.b64encode(bytes(8003)).decode()}))
    assert error.code == "audio_too_long" and "1.00 s of audio/pcmu at 8000 Hz" in error.message


async def test_a_realtime_append_over_the_bound_gets_an_error_and_the_session_goes_on() -> None:
    config = make_config("runtime.slots=2", "backend.options.delay_frames=0", "audio.max_message_seconds=1")
    pcm = spec("pcm_s16le", MODEL_RATE)
    sent = wire_messages(noise(3 * FRAME, seed=11), pcm, [3 * FRAME])[0]
    too_long = bytes(2 * MODEL_RATE + 2)
    client, server = memory_transport_pair()
    events: list[dict] = []
    ends = []

    async def serve() -> None:
        ends.append(await runtime.serve(server, RealtimeTranslator(duplex=True, max_message_seconds=1.0)))

    async def append(audio: bytes, event_id: str) -> None:
        await client.send(json.dumps({"type": "input_audio_buffer.append", "event_id": event_id,
                                      "audio": base64.b64encode(audio).decode()}))

    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve)
                await append(sent[:5000], "a1")
                await append(too_long, "a2")
                await append(sent[5000:], "a3")
                heard = b""
                while len(heard) < len(sent):
                    event = json.loads(await client.receive())
                    events.append(event)
                    if event["type"] == "response.output_audio.delta":
                        heard += base64.b64decode(event["delta"])
                await client.close()
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert [(e["code"], e["event_id"]) for e in errors] == [("audio_too_long", "a2")]
    assert heard == sent  # pcm16 at the model rate through the echo model: exact
    assert ends[0].frames_in == 3


# -- moshi (/api/chat) ------------------------------------------------------------------------------


async def test_a_moshi_opus_message_over_the_bound_ends_that_session_with_1009_and_no_other() -> None:
    config = make_config("runtime.slots=4", "backend.name=synthetic", "audio.max_message_seconds=1")
    s16 = spec("pcm_s16le")
    healthy = wire_messages(noise(12 * FRAME, seed=21), s16, [3000] * 7 + [12 * FRAME - 21000])
    stream = opus_stream(5.0, seed=22)
    client, server = memory_transport_pair()
    received: list[bytes] = []
    closed: list[TransportClosed] = []
    ends = []

    async def moshi_session() -> None:
        async def serve() -> None:
            ends.append(await runtime.serve(server, MoshiTranslator()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await client.send(b"\x01" + stream)
            while True:
                try:
                    received.append(await client.receive())
                except TransportClosed as exc:
                    closed.append(exc)
                    return

    async with open_runtime(config) as runtime:
        with trio.fail_after(PATIENCE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(moshi_session)
                [other] = await run_sessions(runtime, [(healthy, s16, 5)])

    errors = [m[1:].decode() for m in received if m[0] == 5]
    assert len(errors) == 1 and "more than 1 s of audio" in errors[0]
    assert ends[0].reason == "error"
    assert closed[0].code == CloseCode.MESSAGE_TOO_BIG == 1009
    assert other.end.reason == "stop" and other.client.errors == []
    assert bytes(other.client.audio) == synthetic_wire(model_frames(healthy, s16), 5, s16)


def test_the_bound_is_a_checked_config_key_with_a_default() -> None:
    assert make_config().audio.max_message_seconds == 10.0
    with pytest.raises(ValueError, match=r"audio\.max_message_seconds must be a number from 0\.01 to 3600"):
        make_config("audio.max_message_seconds=0")
