"""Property-based tests of the parsers a peer feeds (issue 32): the WebSocket frame parser, the
HTTP request-head reader and each route's translator, fed arbitrary bytes and mutated valid
input.  What they must hold:

* only the documented errors come out: ``FrameError`` from the frame parser, ``BadRequest`` from
  the head reader, and from a translator's ``parse`` no exception at all (bad input is an event:
  a ``ProtocolError``, or ignored);
* memory stays bounded: the frame parser holds no more than what it was fed (plus its buffer),
  and the head reader never reads past its limit before it refuses;
* a valid stream split at every byte boundary parses to the same events, or the same head.

Hypothesis runs derandomized (the same examples on every run, so CI is deterministic), with
modest example counts, without a database, and with no deadline (shared CI machines).
"""

from __future__ import annotations

import json
import struct
import tracemalloc

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# The frame parser and its events: one line to repoint when the module moves.
from duplexrt.wire.frames import BUFFER_SIZE, Close, FrameError, FrameParser, Ping, Pong

from duplexrt.config import load_config
from duplexrt.protocols.events import ProtocolError
from duplexrt.server.head_limits import MAX_HEAD_BYTES
from duplexrt.server.http import BadRequest, RequestHead, read_request_head
from duplexrt.server.routes import ROUTES

FUZZ = settings(derandomize=True, database=None, deadline=None, max_examples=150,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FEW = settings(FUZZ, max_examples=40)


def chunks_of(data: bytes, cuts: list[int]) -> list[bytes]:
    """``data`` cut at the given offsets (any order, any repeats)."""
    points = sorted({0, len(data), *(cut % (len(data) + 1) for cut in cuts)})
    return [data[a:b] for a, b in zip(points, points[1:])]


def mutated(data: bytes, edits: list[tuple[int, int]]) -> bytes:
    """``data`` with bytes replaced (value 0-255), deleted (256) or a byte inserted (257+)."""
    out = bytearray(data)
    for where, what in edits:
        if not out:
            break
        where %= len(out)
        if what < 256:
            out[where] = what
        elif what == 256:
            del out[where]
        else:
            out.insert(where, what - 257)
    return bytes(out)


EDITS = st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 257 + 255)), min_size=1, max_size=8)
CUTS = st.lists(st.integers(0, 1 << 20), max_size=12)


# -- the frame parser -------------------------------------------------------------------------


def client_frame(opcode: int, payload: bytes, *, fin: bool = True, mask: bytes = b"\x01\x02\x03\x04") -> bytes:
    """One frame as a client sends it (masked), written here from RFC 6455, not the library."""
    first = (0x80 if fin else 0) | opcode
    size = len(payload)
    if size < 126:
        header = bytes((first, 0x80 | size))
    elif size < 1 << 16:
        header = struct.pack("!BBH", first, 0x80 | 126, size)
    else:
        header = struct.pack("!BBQ", first, 0x80 | 127, size)
    return header + mask + bytes(b ^ mask[i & 3] for i, b in enumerate(payload))


def normal(event: object) -> tuple:
    if isinstance(event, Ping):
        return ("ping", bytes(event))
    if isinstance(event, Pong):
        return ("pong", bytes(event))
    if isinstance(event, Close):
        return ("close", event.code, event.reason)
    if isinstance(event, str):
        return ("text", event)
    assert isinstance(event, bytes), type(event)
    return ("binary", event)


def parse_all(chunks: list[bytes], max_message: int = 1 << 20) -> tuple[list[tuple], FrameError | None]:
    """Every event the chunks give, in order, and the FrameError that ended them (if any);
    anything else a parser raises fails the test."""
    parser = FrameParser(masked=True, max_message=max_message)
    events: list[tuple] = []
    fed = 0
    try:
        for chunk in chunks:
            parser.feed(chunk)
            fed += len(chunk)
            while (event := parser.next()) is not None:
                events.append(normal(event))
            assert parser.buffered <= fed
    except FrameError as error:
        assert error.code in (1002, 1007, 1009), error.code
        return events, error
    return events, None


@st.composite
def valid_streams(draw) -> tuple[bytes, list[tuple]]:
    """Client frames of whole and fragmented messages with control frames between fragments,
    and the events they must parse to."""
    wire = bytearray()
    expected: list[tuple] = []
    for _ in range(draw(st.integers(1, 5))):
        kind = draw(st.sampled_from(["text", "binary", "ping", "pong"]))
        if kind in ("ping", "pong"):
            payload = draw(st.binary(max_size=125))
            wire += client_frame(0x9 if kind == "ping" else 0xA, payload)
            expected.append((kind, payload))
            continue
        if kind == "text":
            text = draw(st.text(max_size=300))
            payload = text.encode()
        else:
            payload = draw(st.binary(max_size=70_000 if draw(st.integers(0, 9)) == 0 else 300))
        cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
        pieces = [payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)])]
        for n, piece in enumerate(pieces):
            opcode = (0x1 if kind == "text" else 0x2) if n == 0 else 0x0
            wire += client_frame(opcode, piece, fin=n == len(pieces) - 1)
            if n < len(pieces) - 1 and draw(st.booleans()):  # a ping between two fragments
                wire += client_frame(0x9, b"between")
                expected.append(("ping", b"between"))
        expected.append(("text", payload.decode()) if kind == "text" else ("binary", payload))
    if draw(st.booleans()):
        reason = draw(st.text(max_size=20))
        wire += client_frame(0x8, struct.pack("!H", 1000) + reason.encode())
        expected.append(("close", 1000, reason))
    return bytes(wire), expected


@FUZZ
@given(valid_streams(), CUTS)
def test_a_valid_stream_parses_to_its_events_however_it_is_cut(stream, cuts):
    wire, expected = stream
    assert parse_all([wire]) == (expected, None)
    assert parse_all(chunks_of(wire, cuts)) == (expected, None)


@FEW
@given(valid_streams())
def test_a_valid_stream_split_at_every_byte_boundary_parses_the_same(stream):
    wire, expected = stream
    if len(wire) > 2000:
        wire, expected = wire[:0], []
    for cut in range(len(wire) + 1):
        assert parse_all([wire[:cut], wire[cut:]]) == (expected, None), cut
    assert parse_all([wire[n:n + 1] for n in range(len(wire))]) == (expected, None)  # byte by byte


@FUZZ
@given(st.binary(max_size=4096), CUTS)
def test_arbitrary_bytes_give_events_or_a_frame_error(data, cuts):
    parse_all(chunks_of(data, cuts))


@FUZZ
@given(valid_streams(), EDITS, CUTS)
def test_a_mutated_stream_gives_events_or_a_frame_error(stream, edits, cuts):
    parse_all(chunks_of(mutated(stream[0], edits), cuts))


@FEW
@given(st.integers(64 * 40 + 1, (1 << 20) - 1), st.integers(1, 64), st.integers(1, 40))
def test_a_frame_announced_large_holds_only_the_bytes_that_came(size, step, reads):
    """A header announcing a large frame reserves no more than the bytes sent so far (twice over
    at most), however the rest trickles in."""
    header = struct.pack("!BBQ", 0x82, 0x80 | 127, size) + b"\x00\x00\x00\x00"
    parser = FrameParser(masked=True, max_message=1 << 20)
    tracemalloc.start()
    try:
        parser.feed(header)
        assert parser.next() is None
        for _ in range(reads):
            parser.feed(b"\x00" * step)
            assert parser.next() is None  # the frame is never whole: more is announced than sent
        held = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert held <= 4 * (len(header) + step * reads) + 4 * BUFFER_SIZE + 65536, held


# -- the request-head reader ------------------------------------------------------------------


class Trickle(trio.abc.ReceiveStream):
    """Bytes in the given pieces, one per read at most (a read asks for up to 16 KiB), then EOF;
    it counts the bytes handed out."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = [memoryview(p) for p in pieces if p]
        self.handed = 0

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self._pieces:
            return b""
        piece = self._pieces[0]
        size = min(len(piece), max_bytes or len(piece))
        out, rest = bytes(piece[:size]), piece[size:]
        if len(rest):
            self._pieces[0] = rest
        else:
            self._pieces.pop(0)
        self.handed += len(out)
        return out

    async def aclose(self) -> None:
        pass


def read_head(pieces: list[bytes]) -> tuple[RequestHead | BadRequest, int]:
    """The head the pieces give, or the BadRequest that refused them, and the bytes read."""
    stream = Trickle(pieces)

    async def read() -> RequestHead | BadRequest:
        try:
            head, received = await read_request_head(stream)
        except BadRequest as refused:
            assert refused.status in (400, 408, 413, 414, 431, 501, 505), refused.status
            return refused
        assert received == b"".join(pieces)[:len(received)]
        return head

    outcome = trio.run(read)
    # Never more than the limit and one read (16 KiB) past it: nothing is buffered beyond that.
    assert stream.handed <= MAX_HEAD_BYTES + 16384
    return outcome, stream.handed


TOKENS = st.text(st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789-"), min_size=1, max_size=12)
VALUES = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40).map(str.strip)


@st.composite
def valid_heads(draw) -> bytes:
    path = "/" + draw(TOKENS)
    fields = draw(st.lists(st.tuples(TOKENS, VALUES), max_size=12))
    lines = [f"GET {path} HTTP/1.1", "Host: example", *(f"x-{name}: {value}" for name, value in fields)]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def same_head(a: RequestHead | BadRequest, b: RequestHead | BadRequest) -> bool:
    if isinstance(a, BadRequest) or isinstance(b, BadRequest):
        return isinstance(a, BadRequest) and isinstance(b, BadRequest) and a.status == b.status
    return a == b


@FEW
@given(valid_heads())
def test_a_valid_head_split_at_every_byte_boundary_reads_the_same(head):
    whole, _ = read_head([head])
    assert isinstance(whole, RequestHead)
    for cut in range(1, len(head)):
        assert read_head([head[:cut], head[cut:]])[0] == whole, cut


@FUZZ
@given(valid_heads(), CUTS, st.binary(max_size=64))
def test_a_valid_head_reads_the_same_however_it_is_cut_and_whatever_follows(head, cuts, after):
    whole, _ = read_head([head])
    read, handed = read_head(chunks_of(head + after, cuts))
    # The same head, and behind it exactly the bytes read after it (what a WebSocket starts with).
    assert read == attrs.evolve(whole, rest=(head + after)[len(head):handed])


@FUZZ
@given(st.binary(max_size=2048), CUTS)
def test_arbitrary_bytes_give_a_head_or_a_bad_request(data, cuts):
    read_head(chunks_of(data, cuts))


@FUZZ
@given(valid_heads(), EDITS, CUTS)
def test_a_mutated_head_gives_a_head_or_a_bad_request(head, edits, cuts):
    data = mutated(head, edits)
    assert same_head(read_head(chunks_of(data, cuts))[0], read_head([data])[0])


@FEW
@given(st.integers(1, 4000), st.sampled_from([b"x", b"x-y: z\r\n", b"\r\n"]))
def test_a_head_that_never_ends_is_refused_at_the_limit(size, filler):
    refused, handed = read_head([b"GET / HTTP/1.1\r\n", filler * (MAX_HEAD_BYTES // len(filler) + size)])
    assert isinstance(refused, BadRequest)


# -- the translators --------------------------------------------------------------------------

CONFIG = load_config(None, [])
PCM = bytes(range(256)) * 15  # 3840 bytes: 80 ms of pcm16 at 24 kHz
AUDIO = __import__("base64").b64encode(PCM).decode()

#: Valid client messages of each route, to mutate.
VALID: dict[str, list[str | bytes]] = {
    "/v1/duplex": [PCM, '{"type": "ping"}', '{"type": "input.end"}'],
    "/v1/realtime": [
        json.dumps({"type": "session.update", "session": {"instructions": "hi", "turn_detection": None}}),
        json.dumps({"type": "input_audio_buffer.append", "audio": AUDIO}),
        json.dumps({"type": "input_audio_buffer.commit"}),
        json.dumps({"type": "response.create", "response": {"modalities": ["audio", "text"]}}),
        json.dumps({"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                                                                  "content": [{"type": "input_text", "text": "x"}]}}),
        json.dumps({"type": "response.cancel"}),
    ],
    "/v1/realtime/duplex": [json.dumps({"type": "input_audio_buffer.append", "audio": AUDIO}),
                            json.dumps({"type": "input_audio_buffer.clear"})],
    "/api/chat": [b"\x01" + PCM[:200], b"\x03\x00", b"\x06", b"\x00"],
    "/v1/live/sessions": [
        json.dumps({"type": "session.start", "session": {"model": "m"}}),
        json.dumps({"type": "session.input_audio.append", "audio": AUDIO}),
        json.dumps({"type": "session.input_audio.end"}),
    ],
    "/twilio/media": [
        json.dumps({"event": "start", "sequenceNumber": "1", "start": {
            "streamSid": "MZ1", "callSid": "CA1", "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000,
                                                                   "channels": 1}}, "streamSid": "MZ1"}),
        json.dumps({"event": "media", "sequenceNumber": "2", "media": {"track": "inbound", "payload": AUDIO},
                    "streamSid": "MZ1"}),
        json.dumps({"event": "mark", "sequenceNumber": "3", "mark": {"name": "duplexrt-1"}}),
        json.dumps({"event": "stop", "sequenceNumber": "4", "stop": {"callSid": "CA1"}}),
    ],
}
assert set(VALID) == set(ROUTES), "every route's translator is fuzzed"


def translator(path: str):
    made = ROUTES[path].translator(RequestHead("GET", path, {}, {"host": "x"}), CONFIG)
    made.start()
    return made


def parse_every(path: str, messages: list[str | bytes]) -> None:
    """Each message through a fresh translator of the route, as a session feeds it: an event
    back for each, never an exception."""
    made = translator(path)
    for message in messages:
        event = made.parse(message)
        if isinstance(event, ProtocolError):
            assert event.code and event.message


def as_message(data: bytes, text: bool) -> str | bytes:
    return data.decode("utf-8", "replace") if text else data


@pytest.mark.parametrize("path", sorted(VALID))
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_a_translator_turns_mutated_messages_into_events(path, data):
    messages = []
    for _ in range(data.draw(st.integers(1, 4))):
        valid = data.draw(st.sampled_from(VALID[path]))
        raw = valid.encode() if isinstance(valid, str) else valid
        messages.append(as_message(mutated(raw, data.draw(EDITS)), isinstance(valid, str)))
    parse_every(path, [VALID[path][0], *messages])


@pytest.mark.parametrize("path", sorted(VALID))
@settings(FUZZ, max_examples=60)
@given(messages=st.lists(st.one_of(st.binary(max_size=300), st.text(max_size=300),
                                   st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                                                lambda inner: st.lists(inner, max_size=3)
                                                | st.dictionaries(st.sampled_from(["type", "audio", "session",
                                                                                   "item", "event_id", "x"]),
                                                                  inner, max_size=4),
                                                max_leaves=12).map(json.dumps)),
                         min_size=1, max_size=5))
def test_a_translator_turns_arbitrary_messages_into_events(path, messages):
    parse_every(path, [VALID[path][0], *messages])


@pytest.mark.parametrize("path", sorted(VALID))
def test_a_translator_answers_deep_nesting_with_an_event(path):
    for deep in ("[" * 100_000, "{\"type\":" * 50_000 + "1" + "}" * 50_000, "[" * 100_000 + "]" * 100_000):
        parse_every(path, [VALID[path][0], deep, deep.encode()])

