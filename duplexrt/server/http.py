"""Just enough HTTP/1.1 to read a request head and answer plain requests, via h11."""

from __future__ import annotations

from collections.abc import Callable
from http.client import responses
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

from duplexrt.server.head_limits import MAX_HEAD_BYTES, HeadScan
from duplexrt.wire.handshake import header_line



@attrs.frozen
class RequestHead:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    http_version: str = "1.1"
    #: What the client sent right behind the head, as h11 split it (a WebSocket's first frames).
    rest: bytes = b""

    @property
    def wants_websocket(self) -> bool:
        """An upgrade to WebSocket: HTTP/1.1 (RFC 6455 4.2.1) and the token in Upgrade."""
        tokens = {token.strip().lower() for token in self.headers.get("upgrade", "").split(",")}
        return self.http_version == "1.1" and "websocket" in tokens

    def header(self, name: str, default: str = "") -> str:
        return self.headers.get(name.lower(), default)


class BadRequest(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


async def read_request_head(stream: trio.abc.ReceiveStream,
                            on_data: Callable[[int], None] | None = None) -> tuple[RequestHead, bytes]:
    """Read until a whole request head has arrived.  Returns it and every byte read, so the
    connection can be handed on unchanged.  Raises BadRequest for anything malformed.
    ``on_data(n)``: told of each read of ``n`` bytes as it comes (the server's pending heads)."""
    parser = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    received = bytearray()
    limits = HeadScan()
    while True:
        try:
            event = parser.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            raise BadRequest(status, "request head too large" if status == 431 else
                             f"malformed HTTP request: {exc}") from None
        if isinstance(event, h11.Request):
            return _head_of(event, parser.trailing_data[0]), bytes(received)
        if event is h11.NEED_DATA:
            data = await stream.receive_some(16384)
            if not data:
                raise BadRequest(400, "connection closed before a whole request head arrived")
            received += data
            if on_data is not None:
                on_data(len(data))
            if (refused := limits.check(received)) is not None:  # before h11 parses it
                raise BadRequest(431, refused)
            parser.receive_data(bytes(data))
            continue
        raise BadRequest(400, "expected an HTTP request")


def _head_of(request: h11.Request, rest: bytes) -> RequestHead:
    target = request.target.decode("latin-1")
    parts = urlsplit(target)
    query = {key: values[-1] for key, values in parse_qs(parts.query, keep_blank_values=True).items()}
    headers: dict[str, str] = {}
    for name, value in request.headers:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return RequestHead(request.method.decode("ascii"), parts.path or "/", query, headers,
                       request.http_version.decode("ascii"), rest)


def response_bytes(status: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                   extra_headers: list[tuple[str, str]] | None = None) -> bytes:
    """A complete HTTP/1.1 response that closes the connection.  Written here rather than by
    h11, whose writer answers only a request it has parsed itself; every header is checked as
    h11 would, so a value can never break the head."""
    headers = [("content-type", content_type), ("content-length", str(len(body))), ("connection", "close"),
               *(extra_headers or [])]
    lines = [f"HTTP/1.1 {status} {responses.get(status, '')}".rstrip()]
    for name, value in headers:
        lines.append(header_line(name, value))
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body
