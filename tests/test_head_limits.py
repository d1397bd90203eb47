"""The request-head limits (server/head_limits.py, issue 32 defect 8): a head with too many
header fields or too many bytes is refused with 431 before h11 parses it, exactly at the limit
whatever the size of the reads, and bytes behind the head (a client's first WebSocket frames)
never count."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from conftest import PATIENCE
from duplexrt.config import load_config
from duplexrt.server import Server
from duplexrt.server.head_limits import MAX_HEAD_BYTES, MAX_HEADER_FIELDS
from duplexrt.server.http import BadRequest, read_request_head

UPGRADE = (b"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
           b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n")  # 5 fields


def _fields(count: int) -> bytes:
    return b"".join(b"x-%d: y\r\n" % n for n in range(count))


class ChunkedStream(trio.abc.ReceiveStream):
    """Bytes that arrive at most ``chunk`` at a time, as a slow network delivers them."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self._data = memoryview(data)
        self._chunk = chunk

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        await trio.lowlevel.checkpoint()
        size = min(self._chunk, max_bytes or self._chunk)
        piece, self._data = bytes(self._data[:size]), self._data[size:]
        return piece

    async def aclose(self) -> None:
        pass


async def _read(data: bytes, chunk: int = 1 << 20):
    return await read_request_head(ChunkedStream(data, chunk))


async def test_a_head_with_as_many_fields_as_allowed_is_read():
    head, _ = await _read(UPGRADE + _fields(MAX_HEADER_FIELDS - 5) + b"\r\n")
    assert len(head.headers) == MAX_HEADER_FIELDS


@pytest.mark.parametrize("chunk", [1 << 20, 16384, 1000])
async def test_one_field_more_is_refused_unparsed(chunk):
    with pytest.raises(BadRequest) as refused:
        await _read(UPGRADE + _fields(MAX_HEADER_FIELDS - 4) + b"\r\n", chunk)
    assert refused.value.status == 431 and "too many header fields" in refused.value.reason
    with pytest.raises(BadRequest) as refused:  # thousands of tiny fields: refused as they come
        await _read(UPGRADE + _fields(6000) + b"\r\n", chunk)
    assert refused.value.status == 431


@pytest.mark.parametrize("chunk", [1 << 20, 16384, 4096])
async def test_the_size_limit_holds_exactly_whatever_the_reads(chunk):
    pad = MAX_HEAD_BYTES - len(UPGRADE) - len(b"x-pad: \r\n")
    at_limit = UPGRADE + b"x-pad: " + b"a" * pad + b"\r\n\r\n"
    assert len(at_limit) == MAX_HEAD_BYTES + 2  # the head is the bytes up to its blank line's CRLF
    head, _ = await _read(at_limit, chunk)
    assert len(head.headers["x-pad"]) == pad
    over = UPGRADE + b"x-pad: " + b"a" * (pad + 1) + b"\r\n\r\n"
    with pytest.raises(BadRequest) as refused:
        await _read(over, chunk)
    assert refused.value.status == 431 and "too large" in refused.value.reason


async def test_frames_behind_the_head_do_not_count():
    frames = b"\n" * (2 * MAX_HEAD_BYTES)  # a first message full of newlines, sent with the head
    head, received = await _read(UPGRADE + b"\r\n" + frames)
    assert head.wants_websocket and received.endswith(b"\n" * 1000)


async def test_a_real_server_answers_431_and_goes_on(nursery):
    server = Server(load_config(None, ["server.port=0", "runtime.slots=2"]))
    await nursery.start(server.run)

    async def ask(data: bytes) -> bytes:
        answer = b""
        with trio.fail_after(PATIENCE):
            stream = await trio.open_tcp_stream("127.0.0.1", server.ports[0])
            async with stream:
                try:
                    await stream.send_all(data)
                    while chunk := await stream.receive_some(65536):
                        answer += chunk
                except trio.BrokenResourceError:  # refused mid-head: the rest was never read
                    pass
        return answer

    refused = await ask(UPGRADE + _fields(MAX_HEADER_FIELDS - 4) + b"\r\n")  # one read: all of it read
    assert refused.startswith(b"HTTP/1.1 431") and b"too many header fields" in refused
    for _ in range(20):  # thousands of fields, over and over
        await ask(UPGRADE + _fields(6200) + b"\r\n")
    assert (await ask(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")).startswith(b"HTTP/1.1 200")
    assert server.refused["bad_handshake"] == 0  # refused as requests, before any session work


def _pieces(data: bytes, seed: int) -> list[bytes]:
    import random

    rng = random.Random(seed)
    pieces, at = [], 0
    while at < len(data):
        size = rng.choice([1, 2, 3, 7, 100, 4000])
        pieces.append(data[at:at + size])
        at += size
    return pieces


@pytest.mark.parametrize("seed", range(6))
def test_the_scan_of_a_head_in_pieces_says_what_the_whole_check_says(seed):
    """Issue 38, item 8: ``HeadScan`` (each byte looked at once) against ``head_limit_error``
    (the whole head every time), piece by piece, for heads at and past each limit, with the
    blank line and the frames behind it cut anywhere."""
    from duplexrt.server.head_limits import HeadScan, head_limit_error

    heads = [UPGRADE + _fields(MAX_HEADER_FIELDS - 5) + b"\r\n" + b"\n\n\n" * 50,
             UPGRADE + _fields(MAX_HEADER_FIELDS - 4) + b"\r\n",
             UPGRADE.replace(b"\r\n", b"\n") + b"\n" + b"\r\n" * 300,
             UPGRADE + b"x-big: " + b"a" * (MAX_HEAD_BYTES - len(UPGRADE) - 11) + b"\r\n\r\nrest",
             UPGRADE + b"x-big: " + b"a" * MAX_HEAD_BYTES + b"\r\n\r\n"]
    for head in heads:
        scan = HeadScan()
        received = bytearray()
        for piece in _pieces(head, seed):
            received += piece
            assert scan.check(received) == head_limit_error(received), len(received)


def test_a_head_sent_a_byte_at_a_time_is_scanned_once():
    """The limits looked at every byte of the head so far on every read: a 58 KiB head sent a
    byte at a time cost 58 K reads x up to 58 KiB (O(n^2)); now each byte is looked at once."""
    from duplexrt.server.head_limits import HeadScan

    head = UPGRADE + b"x-big: " + b"a" * (58 * 1024) + b"\r\n\r\n"
    scan = HeadScan()
    received = bytearray()
    for byte in head:
        received.append(byte)
        assert scan.check(received) is None
    assert scan.examined <= 5 * len(head)  # a few bytes a read (where a blank line may begin), not all


async def test_read_request_head_reports_each_read_as_it_comes():
    reads: list[int] = []
    head, _ = await read_request_head(ChunkedStream(UPGRADE + b"\r\n", 10), reads.append)
    assert sum(reads) == len(UPGRADE) + 2 and set(reads[:-1]) == {10}
