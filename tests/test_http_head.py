"""The HTTP request-head reader and response writer (server/http.py) over an in-memory stream."""

from __future__ import annotations

import h11
import pytest
import trio
import trio.testing

from duplexrt.server.http import MAX_HEAD_BYTES, BadRequest, read_request_head, response_bytes
from duplexrt.wire.handshake import accept_response, client_handshake


async def _read(*chunks: bytes, close: bool = False):
    send, receive = trio.testing.memory_stream_one_way_pair()
    for chunk in chunks:
        await send.send_all(chunk)
    if close:
        await send.aclose()
    return await read_request_head(receive)


async def test_a_head_in_pieces_is_read_whole_with_every_byte_kept():
    pieces = [b"GET /v1/duplex?format=pcm_s16le&rate=16000&rate=8000&flag HTTP/1.1\r\n",
              b"Host: x\r\nUpgrade: WebSocket\r\nX-Tag: a\r\n", b"x-tag: b\r\n\r\n"]
    head, received = await _read(*pieces)
    assert head.method == "GET" and head.path == "/v1/duplex"
    assert head.query == {"format": "pcm_s16le", "rate": "8000", "flag": ""}  # the last of a repeat
    assert head.header("X-TAG") == "a, b" and head.header("missing", "d") == "d"
    assert head.wants_websocket
    assert received == b"".join(pieces)  # to hand on to the WebSocket library unchanged


async def test_bytes_after_the_head_stay_in_what_was_received():
    head, received = await _read(b"GET / HTTP/1.1\r\nhost: x\r\n\r\nextra")
    assert head.path == "/" and not head.wants_websocket and received.endswith(b"extra")


@pytest.mark.parametrize(("data", "status", "words"), [
    (b"GET / HTTP/1.1\r\nhost: x\r\n", 400, "closed before"),
    (b"NOT HTTP AT ALL\r\n\r\n", 400, "malformed"),
    (b"GET / HTTP/1.1\r\nhost: x\r\nx: " + b"a" * MAX_HEAD_BYTES, 431, "too large"),
])
async def test_bad_heads_are_a_bad_request_with_a_status(data, status, words):
    with pytest.raises(BadRequest) as refused:
        await _read(data, close=True)
    assert refused.value.status == status and words in refused.value.reason


def test_a_response_is_complete_and_closes_the_connection():
    data = response_bytes(503, b"busy\n", extra_headers=[("retry-after", "1")])
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    response = client.next_event()
    assert response.status_code == 503 and response.reason == b"Service Unavailable"
    headers = dict(response.headers)
    assert headers[b"connection"] == b"close" and headers[b"retry-after"] == b"1"
    assert headers[b"content-length"] == b"5"
    assert client.next_event().data == b"busy\n"
    assert isinstance(client.next_event(), h11.EndOfMessage)


@pytest.mark.parametrize("header", [("retry-after", "1\r\nset-cookie: x=1"), ("bad name", "1"), ("x", "a\nb")])
def test_a_header_that_would_break_the_response_head_is_refused(header):
    with pytest.raises(ValueError, match="HTTP header"):
        response_bytes(503, b"busy\n", extra_headers=[header])


@pytest.mark.parametrize("header", [("Authorization", "Bearer s3cret\n"), ("Authorization", "Bearer a\r\nX-Admin: 1"),
                                    ("bad name", "1")])
async def test_a_client_upgrade_whose_header_would_break_its_head_sends_nothing(header):
    """A key read with its newline (a Kubernetes secret) must not end the request head early or
    smuggle a header in: the upgrade is refused before a byte is written, without echoing the
    value (it may be a secret)."""
    sent = trio.testing.MemorySendStream()
    with pytest.raises(ValueError, match="HTTP header") as refused, trio.fail_after(1):  # no answer comes
        await client_handshake(trio.StapledStream(sent, trio.testing.MemoryReceiveStream()),
                               "ws://127.0.0.1:9/v1/duplex", extra_headers=[header])
    assert "s3cret" not in str(refused.value)
    with pytest.raises(trio.WouldBlock):  # nothing was written
        sent.get_data_nowait()
    with pytest.raises(ValueError, match="HTTP header"):
        accept_response("dGhlIHNhbXBsZSBub25jZQ==", None, extra_headers=[header])


def test_a_status_without_a_standard_phrase_still_makes_a_valid_response():
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(response_bytes(599, b""))
    response = client.next_event()
    assert response.status_code == 599 and response.reason == b""
