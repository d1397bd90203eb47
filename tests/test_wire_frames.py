"""The RFC 6455 frame parser and framing helpers (duplexrt.wire.frames), without sockets.

Frames are built here by hand from the RFC's layout (and cross-checked against wsproto where a
library's framing is the reference), so a parser bug cannot hide behind a matching serializer bug.
"""

from __future__ import annotations

import itertools
import os
import struct

import numpy as np
import pytest
from wsproto.frame_protocol import FrameProtocol, Opcode as WsOpcode

from duplexrt.wire import frames as wsframes
from duplexrt.wire.frames import (BUFFER_SIZE, Close, FrameError, FrameParser, Opcode, Ping, Pong, close_payload,
                               frame, frame_header, masked_frame, masked_frame_parts, MaskKeys, unmask)

MASK = b"\x11\x22\x33\x44"
C_UNMASK = wsframes._apply_mask


@pytest.fixture(params=["c", "numpy"])
def unmasker(request, monkeypatch):
    """Both ways to (un)mask: websockets' C ``apply_mask``, and the numpy path used without it."""
    if request.param == "c":
        if C_UNMASK is None:
            pytest.skip("websockets is installed without its C extension (websockets.speedups)")
    else:
        monkeypatch.setattr(wsframes, "_apply_mask", None)
    return request.param


def raw(opcode: int, payload: bytes, *, fin: bool = True, mask: bytes | None = MASK, rsv: int = 0,
        size: int | None = None) -> bytes:
    """One frame laid out by hand: FIN, RSV, opcode; MASK bit and length; mask key; payload."""
    size = len(payload) if size is None else size
    first = (0x80 if fin else 0) | rsv << 4 | opcode
    masked = 0x80 if mask is not None else 0
    if size < 126:
        head = bytes((first, masked | size))
    elif size < 65536:
        head = bytes((first, masked | 126)) + struct.pack("!H", size)
    else:
        head = bytes((first, masked | 127)) + struct.pack("!Q", size)
    if mask is None:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def events(parser: FrameParser, data: bytes) -> list:
    parser.feed(data)
    out = []
    while (event := parser.next()) is not None:
        out.append(event)
    return out


def server_parser(max_message: int = 1 << 20) -> FrameParser:
    return FrameParser(masked=True, max_message=max_message)


@pytest.mark.parametrize("size", [0, 1, 3, 4, 5, 63, 64, 65, 125, 126, 127, 65535, 65536, 70001])
def test_masked_binary_messages_of_every_length_class_come_back_whole(size):
    payload = os.urandom(size)
    assert events(server_parser(), raw(Opcode.BINARY, payload)) == [payload]


def read_into(parser: FrameParser, data: bytes, sizes) -> list:
    """``data`` as a socket would hand it over: each read at most the next of ``sizes`` bytes,
    written into the parser's own ``room`` (never more than it offers)."""
    out = []
    sizes = iter(sizes)
    while data:
        room = parser.room()
        count = min(len(room), len(data), next(sizes))
        room[:count] = data[:count]
        parser.received(count)
        data = data[count:]
        while (event := parser.next()) is not None:
            out.append(event)
    return out


def test_reads_into_the_parsers_buffer_parse_every_size_at_every_alignment():
    # Payloads at every offset modulo 4 from the buffer's start (a 1- to 3-byte message before
    # them), of lengths with and without a tail past their last 32-bit word, read in pieces
    # that cut headers, mask keys and payloads anywhere.
    payloads = [os.urandom(size) for size in (1, 2, 3, 7680, 64, 65, 66, 67, 3841, 125, 126, 127, 7681, 40000)]
    data = b"".join(raw(Opcode.BINARY, p) for p in payloads)
    for reads in ([len(data)], [1], [7], [4096], [7689, 13, 5000], [BUFFER_SIZE]):
        parser = server_parser()
        assert read_into(parser, data, itertools.cycle(reads)) == payloads
        assert parser.buffered == 0


def test_a_large_message_grows_the_buffer_as_it_arrives_and_the_buffer_shrinks_after_it():
    payload = os.urandom(300_000)
    data = raw(Opcode.BINARY, payload)
    parser = server_parser()
    assert len(parser.room()) == BUFFER_SIZE
    parser.feed(data[:14])  # the header alone reserves nothing past the usual buffer
    assert len(parser.room()) <= BUFFER_SIZE
    assert read_into(parser, data[14:], itertools.repeat(BUFFER_SIZE)) == [payload]
    # Offered room never ran more than twice past what had arrived; afterwards, the usual size.
    assert len(parser.room()) == BUFFER_SIZE
    assert read_into(parser, raw(Opcode.TEXT, b"next"), [100]) == ["next"]


def test_a_large_message_never_gets_room_more_than_double_what_arrived():
    data = raw(Opcode.BINARY, os.urandom(200_000))
    parser = server_parser()
    arrived = 0
    while arrived < len(data):
        room = parser.room()
        assert len(room) + parser.buffered <= max(BUFFER_SIZE, 4 * (parser.buffered + 1))
        count = min(len(room), len(data) - arrived)
        room[:count] = data[arrived:arrived + count]
        parser.received(count)
        arrived += count
        parser.next()


def test_a_reader_behind_gets_the_room_it_asks_for_and_the_buffer_shrinks_once_it_catches_up():
    messages = [os.urandom(15360) for _ in range(8)]
    data = b"".join(raw(Opcode.BINARY, m) for m in messages)
    parser = server_parser()
    room = parser.room(1 << 16)  # a backlog: several messages in one read
    assert len(room) >= 1 << 16
    room[:1 << 16] = data[:1 << 16]
    parser.received(1 << 16)
    out = []
    while (event := parser.next()) is not None:
        out.append(event)
    assert out == messages[:len(out)] and len(out) == 4
    assert read_into(parser, data[1 << 16:], itertools.repeat(1 << 16)) == messages[4:]
    assert len(parser.room()) == BUFFER_SIZE


def test_unmask_matches_a_byte_at_a_time_xor_for_odd_lengths(unmasker):
    for size in (0, 1, 2, 3, 7, 63, 64, 65, 66, 67, 1001, 3840):
        data = os.urandom(size)
        expected = bytes(b ^ MASK[i % 4] for i, b in enumerate(data))
        assert unmask(data, MASK) == expected
        assert unmask(memoryview(bytearray(data)), MASK) == expected
        assert unmask(np.frombuffer(data, np.uint8), MASK) == expected  # any buffer


def test_text_is_decoded_and_several_frames_in_one_read_all_come_out():
    data = raw(Opcode.TEXT, "héllo".encode()) + raw(Opcode.BINARY, b"\x00\x01") + raw(Opcode.TEXT, b"")
    assert events(server_parser(), data) == ["héllo", b"\x00\x01", ""]


def test_bytes_split_at_every_offset_still_parse():
    data = raw(Opcode.BINARY, os.urandom(300)) + raw(Opcode.PING, b"p") + raw(Opcode.TEXT, b"x" * 200)
    whole = events(server_parser(), data)
    for cut in range(1, len(data)):
        parser = server_parser()
        assert events(parser, data[:cut]) + events(parser, data[cut:]) == whole
    byte_by_byte = server_parser()
    assert [e for i in range(len(data)) for e in events(byte_by_byte, data[i:i + 1])] == whole


def test_fragmented_message_with_control_frames_between_its_fragments():
    data = (raw(Opcode.TEXT, "frag".encode(), fin=False) + raw(Opcode.PING, b"1")
            + raw(Opcode.CONTINUATION, "mé".encode(), fin=False) + raw(Opcode.PONG, b"2")
            + raw(Opcode.CONTINUATION, b"nt"))
    out = events(server_parser(), data)
    assert out == [Ping(b"1"), Pong(b"2"), "fragmént"]
    assert type(out[0]) is Ping and type(out[1]) is Pong


def test_a_utf8_character_split_across_fragments_is_fine():
    text = "é".encode()
    data = raw(Opcode.TEXT, text[:1], fin=False) + raw(Opcode.CONTINUATION, text[1:])
    assert events(server_parser(), data) == ["é"]


def test_close_frames_carry_code_and_reason_or_1005_when_empty():
    [close] = events(server_parser(), raw(Opcode.CLOSE, struct.pack("!H", 4000) + "bye ü".encode()))
    assert isinstance(close, Close) and (close.code, close.reason) == (4000, "bye ü")
    [empty] = events(server_parser(), raw(Opcode.CLOSE, b""))
    assert (empty.code, empty.reason) == (1005, "")


@pytest.mark.parametrize("data, code", [
    (raw(Opcode.BINARY, b"x", rsv=1), 1002),                        # RSV1: no extension negotiated
    (raw(Opcode.BINARY, b"x", rsv=4), 1002),
    (raw(3, b"x"), 1002),                                            # reserved data opcode
    (raw(0xB, b"x"), 1002),                                          # reserved control opcode
    (raw(Opcode.BINARY, b"x", mask=None), 1002),                     # a client must mask
    (raw(Opcode.CONTINUATION, b"x"), 1002),                          # nothing to continue
    (raw(Opcode.TEXT, b"a", fin=False) + raw(Opcode.TEXT, b"b"), 1002),  # new message mid-message
    (raw(Opcode.PING, b"x" * 126), 1002),                            # control frame too long
    (raw(Opcode.PING, b"x", fin=False), 1002),                       # fragmented control frame
    (raw(Opcode.CLOSE, b"\x03"), 1002),                              # one-byte close payload
    (raw(Opcode.CLOSE, struct.pack("!H", 1005)), 1002),              # reserved close code
    (raw(Opcode.CLOSE, struct.pack("!H", 999)), 1002),
    (raw(Opcode.TEXT, b"\xff\xfe"), 1007),                           # invalid UTF-8
    (raw(Opcode.TEXT, b"\xc3", fin=False) + raw(Opcode.CONTINUATION, b"\x28"), 1007),
    (raw(Opcode.CLOSE, struct.pack("!H", 1000) + b"\xff"), 1007),   # invalid UTF-8 reason
])
def test_what_a_peer_must_not_send_is_refused_with_its_close_code(data, code):
    with pytest.raises(FrameError) as error:
        events(server_parser(), data)
    assert error.value.code == code


def test_an_oversized_message_is_refused_from_its_header_alone():
    parser = server_parser(max_message=1000)
    # Only the header of a 1 MiB frame: refused before any of its payload is buffered.
    with pytest.raises(FrameError) as error:
        events(parser, raw(Opcode.BINARY, b"", size=1 << 20)[:10])
    assert error.value.code == 1009


def test_fragments_that_add_up_past_the_limit_are_refused():
    parser = server_parser(max_message=1000)
    assert events(parser, raw(Opcode.BINARY, b"x" * 600, fin=False)) == []
    with pytest.raises(FrameError) as error:
        events(parser, raw(Opcode.CONTINUATION, b"x" * 600))
    assert error.value.code == 1009
    assert events(server_parser(max_message=1000), raw(Opcode.BINARY, b"x" * 1000)) == [b"x" * 1000]


def test_empty_continuations_past_the_fragment_cap_are_refused_and_a_message_at_the_cap_is_whole():
    # Empty continuations add nothing to the size, yet each one was kept until the message
    # ended: a peer could grow the server's memory without bound inside the size limit.
    parser = server_parser(max_message=1000)
    empty = raw(Opcode.CONTINUATION, b"", fin=False)
    assert events(parser, raw(Opcode.BINARY, b"", fin=False) + empty * (wsframes.MAX_FRAGMENTS - 1)) == []
    with pytest.raises(FrameError) as error:
        events(parser, empty)
    assert error.value.code == 1009 and "fragments" in error.value.reason
    at_cap = raw(Opcode.TEXT, b"a", fin=False) + raw(Opcode.CONTINUATION, b"b", fin=False) * (
        wsframes.MAX_FRAGMENTS - 2) + raw(Opcode.CONTINUATION, b"c")
    assert events(server_parser(), at_cap) == ["a" + "b" * (wsframes.MAX_FRAGMENTS - 2) + "c"]


def test_the_fragment_cap_is_a_parser_setting_and_a_control_frame_between_fragments_is_no_fragment():
    parser = FrameParser(masked=True, max_message=1 << 20, max_fragments=3)
    data = (raw(Opcode.BINARY, b"1", fin=False) + raw(Opcode.PING, b"p") + raw(Opcode.CONTINUATION, b"2", fin=False)
            + raw(Opcode.PING, b"q") + raw(Opcode.CONTINUATION, b"3"))
    assert events(parser, data) == [Ping(b"p"), Ping(b"q"), b"123"]
    with pytest.raises(FrameError) as error:
        events(parser, raw(Opcode.BINARY, b"1", fin=False) + raw(Opcode.CONTINUATION, b"2", fin=False) * 3)
    assert error.value.code == 1009


def test_a_client_parser_refuses_masked_frames_and_reads_plain_ones():
    client = FrameParser(masked=False, max_message=1 << 20)
    assert events(client, raw(Opcode.BINARY, b"abc", mask=None)) == [b"abc"]
    with pytest.raises(FrameError) as error:
        events(FrameParser(masked=False, max_message=1 << 20), raw(Opcode.BINARY, b"abc"))
    assert error.value.code == 1002


@pytest.mark.parametrize("size", [0, 125, 126, 65535, 65536])
def test_frames_we_write_are_what_wsproto_reads(size):
    payload = os.urandom(size)
    for masked, reader_is_client in ((False, True), (True, False)):
        reader = FrameProtocol(client=reader_is_client, extensions=[])
        reader.receive_bytes(frame(Opcode.BINARY, payload, masked=masked))
        [received] = list(reader.received_frames())
        assert received.opcode is WsOpcode.BINARY and received.payload == payload and received.frame_finished
    assert frame_header(Opcode.TEXT, size) + payload == frame(Opcode.TEXT, payload)


def test_our_masked_frames_round_trip_through_our_parser(unmasker):
    payload = os.urandom(5000)
    assert events(server_parser(), frame(Opcode.BINARY, payload, masked=True)) == [payload]


@pytest.mark.parametrize("size", [0, 1, 3, 63, 64, 65, 126, 3839, 7680, 15361, 70001])
def test_the_parser_unmasks_payloads_at_every_alignment(unmasker, size):
    """Headers of 2, 4 and 10 bytes put the payload at every offset from a word boundary; the
    first frame's length shifts the second's start too."""
    payload = os.urandom(size)
    for lead in (b"", b"x", b"abc"):
        data = raw(Opcode.BINARY, lead) + raw(Opcode.BINARY, payload)
        assert events(server_parser(), data) == [lead, payload]


def test_close_payload_cuts_a_long_reason_on_a_character_boundary():
    payload = close_payload(1000, "é" * 100)
    assert len(payload) <= 125
    assert struct.unpack("!H", payload[:2])[0] == 1000
    payload[2:].decode()  # still valid UTF-8
    assert close_payload(1005) == b""


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 125, 126, 1000, 7679, 7680, 7683, 65535, 65536, 70001])
def test_a_masked_frame_is_its_header_and_payload_masked_in_one_buffer(unmasker, size):
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    expected = raw(Opcode.BINARY, payload)
    for data in (payload, bytearray(payload), memoryview(payload)):
        assert bytes(masked_frame(Opcode.BINARY, data, MASK)) == expected
        header, masked = masked_frame_parts(Opcode.BINARY, data, MASK)
        assert bytes(header) + masked == expected
        if unmasker == "c":  # header and payload apart, for one writev
            assert header == frame_header(Opcode.BINARY, size, MASK)
    samples = np.frombuffer(payload[:size - size % 4], np.float32)
    for floats in (memoryview(samples), samples):  # a view of floats, cut to bytes; any buffer
        header, masked = masked_frame_parts(Opcode.BINARY, floats, MASK)
        assert bytes(header) + masked == raw(Opcode.BINARY, samples.tobytes())
    parser = FrameParser(masked=True, max_message=1 << 20)
    parser.feed(bytes(masked_frame(Opcode.BINARY, payload, MASK)))
    assert parser.next() == payload


def test_mask_keys_are_drawn_from_the_system_s_random_source_a_batch_at_a_time(monkeypatch):
    draws: list[int] = []
    real = os.urandom

    def counting(n: int) -> bytes:
        draws.append(n)
        return real(n)

    monkeypatch.setattr("duplexrt.wire.frames.os.urandom", counting)
    keys = MaskKeys(batch=64)
    taken = [keys.next() for _ in range(150)]
    assert all(len(key) == 4 for key in taken)
    assert draws == [256, 256, 256]  # 64 keys a draw: one syscall per 64 frames, not one each
    assert len(set(taken)) > 140  # random keys: a repeat among 150 is possible, many are not
