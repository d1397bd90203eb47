"""The WebSocket opening handshake (RFC 6455 section 4), both sides, for the native transport.

The server side answers a request head that ``duplexrt.server.http`` has already read; the client
side writes a request and reads the answer.  No extension is offered or accepted, so a client that
offers permessage-deflate simply gets plain frames (RFC 6455 9.1: an extension not in the answer is
not in use).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from collections.abc import Iterable
from urllib.parse import urlsplit

import trio

_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
#: A response head larger than this is not a WebSocket server's.
_MAX_HEAD = 64 * 1024
#: A header name (RFC 9110 5.1, a token), and what a header value must never hold.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BAD_VALUE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def header_line(name: str, value: str) -> str:
    """``name: value`` for a head this side writes, or ValueError: a value holding CR or LF
    would end the head early or add headers of its own (an API key read with its newline).
    The value is not repeated in the error, since it may be a secret."""
    if not _TOKEN.fullmatch(name):
        raise ValueError(f"not a valid HTTP header name: {name!r}")
    if _BAD_VALUE.search(value):
        raise ValueError(f"the value of HTTP header {name} holds a control character (CR, LF, NUL, ...)")
    return f"{name}: {value}"


class HandshakeRefused(Exception):
    """The peer's request or answer is not a WebSocket handshake we can complete; a server
    answers ``status`` (426 for a version it does not speak, RFC 6455 4.4; else 400)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.status = status


class Rejected(Exception):
    """The server answered the upgrade with a plain HTTP response (``status``, ``body``)."""

    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status
        self.headers = headers
        self.body = body


def accept_key(key: str) -> str:
    return base64.b64encode(hashlib.sha1(key.encode("ascii") + _GUID).digest()).decode("ascii")


def check_request(method: str, headers: dict[str, str]) -> str:
    """The request's ``Sec-WebSocket-Key``, once the request is a valid upgrade; raises
    HandshakeRefused with what is wrong (answered with 400)."""
    if method != "GET":
        raise HandshakeRefused("a WebSocket upgrade must be a GET")
    if "upgrade" not in {token.strip().lower() for token in headers.get("connection", "").split(",")}:
        raise HandshakeRefused("missing Connection: Upgrade")
    if headers.get("sec-websocket-version", "").strip() != "13":
        raise HandshakeRefused("only Sec-WebSocket-Version 13 is supported", 426)
    key = headers.get("sec-websocket-key", "").strip()
    try:
        valid = len(base64.b64decode(key, validate=True)) == 16
    except ValueError:
        valid = False
    if not valid:
        raise HandshakeRefused("missing or malformed Sec-WebSocket-Key")
    return key


def proposed_subprotocols(headers: dict[str, str]) -> list[str]:
    return [p.strip() for p in headers.get("sec-websocket-protocol", "").split(",") if p.strip()]


def accept_response(key: str, subprotocol: str | None, extra_headers: Iterable[tuple[str, str]] = ()) -> bytes:
    lines = ["HTTP/1.1 101 Switching Protocols", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Accept: {accept_key(key)}"]
    if subprotocol:
        lines.append(f"Sec-WebSocket-Protocol: {subprotocol}")
    lines.extend(header_line(name, value) for name, value in extra_headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def after_head(received: bytes) -> bytes:
    """What a peer sent after its HTTP head (frames it did not wait to send)."""
    for end in (b"\r\n\r\n", b"\n\n"):
        head, found, rest = received.partition(end)
        if found:
            return rest
    return b""


async def client_handshake(stream: trio.abc.Stream, url: str,
                           extra_headers: Iterable[tuple[str, str]] = ()) -> tuple[dict[str, str], bytes]:
    """Send the upgrade request for ``url`` and read the answer.  Returns the response headers
    (lower-case names) and any bytes that followed the head; raises Rejected for a plain HTTP
    answer and HandshakeRefused for an invalid one."""
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    host = parts.hostname or "localhost"
    if parts.port:
        host = f"{host}:{parts.port}"
    key = base64.b64encode(os.urandom(16)).decode("ascii")
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Upgrade: websocket", "Connection: Upgrade",
             f"Sec-WebSocket-Key: {key}", "Sec-WebSocket-Version: 13"]
    lines.extend(header_line(name, value) for name, value in extra_headers)
    await stream.send_all(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    received = bytearray()
    while b"\r\n\r\n" not in received:
        if len(received) > _MAX_HEAD:
            raise HandshakeRefused("the server's answer head is too large")
        data = await stream.receive_some(16384)
        if not data:
            raise HandshakeRefused("the server closed the connection during the handshake")
        received += data
    head, _, rest = bytes(received).partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    try:
        status = int(status_line.split()[1])
    except (IndexError, ValueError):
        raise HandshakeRefused(f"not an HTTP answer: {status_line[:80]!r}") from None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        headers[name] = f"{headers[name]}, {value.strip()}" if name in headers else value.strip()
    if status != 101:
        body = bytearray(rest)
        length = int(headers.get("content-length", "0") or 0)
        with trio.move_on_after(2.0):
            while len(body) < length:
                data = await stream.receive_some(16384)
                if not data:
                    break
                body += data
        raise Rejected(status, headers, bytes(body[:length] if length else body))
    if headers.get("sec-websocket-accept", "") != accept_key(key):
        raise HandshakeRefused("the server's Sec-WebSocket-Accept does not match the key")
    return headers, rest
