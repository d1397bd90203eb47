"""Opening a client WebSocket to a duplexrt route, and naming what went wrong when it fails.

A failed connection is a ``ConnectError`` with a short ``kind`` (``refused``, ``http_503``,
``timeout``, ...: what ``simulate --url`` counts) and a message a person can act on.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from urllib.parse import urlsplit

import trio
import trio_websocket

from duplexrt.client.protocols import ClientProtocol, Opened
from duplexrt.transport import Transport, TransportClosed
from duplexrt.websocket import WebSocketTransport
from duplexrt.wshandshake import HandshakeRefused, Rejected, client_handshake
from duplexrt.wsnative import NativeWebSocket

__all__ = ["ConnectError", "NativeWebSocket", "WebSocketTransport", "open_connection", "host_and_port"]

#: Largest message the client accepts (server audio messages are a few kB; this is generous).
MAX_MESSAGE_BYTES = 16 << 20


class ConnectError(Exception):
    """The connection could not be opened (or closed before the server's greeting)."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.status = status


def host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "wss" else 80)
    return parts.hostname or "localhost", port


def _describe_rejection(status: int, body: bytes | None) -> str:
    phrase = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    text = (body or b"").decode("utf-8", "replace").strip()
    described = f"the server refused the WebSocket connection: HTTP {status}" + (f" {phrase}" if phrase else "")
    return described + (f": {text[:300]}" if text else "")


def _classify(exc: BaseException, url: str) -> ConnectError:
    host, port = host_and_port(url)
    where = f"{host}:{port}"
    if isinstance(exc, trio_websocket.ConnectionRejected):
        return ConnectError(f"http_{exc.status_code}", _describe_rejection(exc.status_code, exc.body), exc.status_code)
    if isinstance(exc, Rejected):
        return ConnectError(f"http_{exc.status}", _describe_rejection(exc.status, exc.body), exc.status)
    if isinstance(exc, trio.TooSlowError):
        return ConnectError("timeout", f"timed out opening a WebSocket to {where}")
    if isinstance(exc, trio_websocket.ConnectionTimeout):
        return ConnectError("timeout", f"timed out opening a WebSocket to {where}")
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, ConnectionRefusedError):
            return ConnectError("refused", f"cannot connect to {where}: connection refused "
                                           "(is `duplexrt serve` running there?)")
        if isinstance(cause, BaseExceptionGroup):
            refused = cause.subgroup(lambda e: isinstance(e, ConnectionRefusedError))
            if refused is not None:
                return ConnectError("refused", f"cannot connect to {where}: connection refused "
                                               "(is `duplexrt serve` running there?)")
        if isinstance(cause, OSError) and not isinstance(cause, ConnectionRefusedError):
            text = str(cause)
            if "all attempts to connect" in text:
                # trio's summary of several failed attempts: the refusals are its causes.
                cause = cause.__cause__ or cause.__context__
                continue
            return ConnectError("connect_failed", f"cannot connect to {where}: {text}")
        cause = cause.__cause__ or cause.__context__
    return ConnectError("handshake_failed", f"the WebSocket handshake with {where} failed: {exc!r}")


@asynccontextmanager
async def open_connection(url: str, protocol: ClientProtocol, *, api_key: str | None = None, timeout: float = 10.0,
                          impl: str = "native") -> AsyncIterator[tuple[Transport, Opened | None]]:
    """Open a WebSocket to ``url`` (already carrying the protocol's query) and, where the protocol's
    server speaks first, wait for its greeting.  Yields the transport and the greeting; raises
    ConnectError if either fails.  The connection is closed when the block ends.

    ``impl``: ``native`` (duplexrt.wsnative: the load generator's frames cost what the server's
    do) or ``trio-websocket``; ``wss://`` URLs always take trio-websocket, which does TLS."""
    if impl == "trio-websocket" or url.startswith("wss:"):
        async with _open_trio_websocket(url, protocol, api_key=api_key, timeout=timeout) as opened:
            yield opened
        return
    host, port = host_and_port(url)
    headers = [("Authorization", f"Bearer {api_key}")] if api_key else []
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_tcp_stream(host, port)
            try:
                _, rest = await client_handshake(stream, url, headers)
            except BaseException:
                await trio.aclose_forcefully(stream)
                raise
    except (OSError, Rejected, HandshakeRefused, trio.TooSlowError, trio.BrokenResourceError) as exc:
        raise _classify(exc, url) from None
    transport = NativeWebSocket(stream, client=True, max_message=MAX_MESSAGE_BYTES, received=rest,
                                queue_limit=16, close_timeout=5.0)
    try:
        for message in protocol.hello():
            await transport.send(message)
        opened = await _greeting(transport, protocol, timeout) if protocol.greets else None
        yield transport, opened
    finally:
        with trio.CancelScope(shield=True):  # bounded by close_timeout
            await transport.close()


@asynccontextmanager
async def _open_trio_websocket(url: str, protocol: ClientProtocol, *, api_key: str | None,
                               timeout: float) -> AsyncIterator[tuple[Transport, Opened | None]]:
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else None
    try:
        context = trio_websocket.open_websocket_url(
            url, extra_headers=headers, message_queue_size=16, max_message_size=MAX_MESSAGE_BYTES,
            connect_timeout=timeout, disconnect_timeout=5.0)
        ws = await context.__aenter__()
    except trio_websocket.HandshakeError as exc:
        raise _classify(exc, url) from None
    except OSError as exc:
        raise _classify(exc, url) from None
    try:
        transport = WebSocketTransport(ws)
        for message in protocol.hello():
            await transport.send(message)
        opened = await _greeting(transport, protocol, timeout) if protocol.greets else None
        yield transport, opened
    except BaseException as exc:
        if not await context.__aexit__(type(exc), exc, exc.__traceback__):
            raise
    else:
        try:
            await context.__aexit__(None, None, None)
        except trio_websocket.DisconnectionTimeout:
            pass  # the conversation is over; a peer slow to finish the close changes nothing


async def _greeting(transport: Transport, protocol: ClientProtocol, timeout: float) -> Opened:
    """The server's first message, which must be its greeting."""
    with trio.move_on_after(timeout) as scope:
        try:
            message = await transport.receive()
        except TransportClosed as closed:
            reason = f": {closed.reason}" if closed.reason else ""
            raise ConnectError("closed_early", f"the server closed the connection (code {closed.code}{reason}) "
                                               "before greeting") from None
    if scope.cancelled_caught:
        raise ConnectError("timeout", f"the server did not greet within {timeout:g} s")
    event = protocol.parse(message)
    if not isinstance(event, Opened):
        raise ConnectError("protocol", f"expected the {protocol.name} greeting first, got {str(message)[:120]!r}")
    protocol.opened(event)
    return event
