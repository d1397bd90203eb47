"""Opening a client WebSocket to a duplexrt route, and naming what went wrong when it fails.

A failed connection is a ``ConnectError`` with a short ``kind`` (``refused``, ``http_503``,
``timeout``, ...: what ``simulate --url`` counts) and a message a person can act on.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from http.client import responses
from urllib.parse import urlsplit

import trio
import trio_websocket

from duplexrt.client.protocols import ClientProtocol, Opened
from duplexrt.client.resume import Connect, ResumingTransport
from duplexrt.wire.transport import Transport, TransportClosed
from duplexrt.wire.wss import WebSocketTransport
from duplexrt.wire.handshake import HandshakeRefused, Rejected, client_handshake
from duplexrt.wire.native import NativeWebSocket

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
    phrase = responses.get(status, "")
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
async def open_connection(url: str, protocol: ClientProtocol, *, api_key: str | None = None,
                          timeout: float = 10.0, resume: bool = False, resume_window: float = 10.0,
                          impl: str = "native", on_drop: Callable[[TransportClosed, float], None] | None = None,
                          ) -> AsyncIterator[tuple[Transport, Opened | None]]:
    """Open a WebSocket to ``url`` (already carrying the protocol's query) and, where the protocol's
    server speaks first, wait for its greeting.  Yields the transport and the greeting; raises
    ConnectError if either fails.  The connection is closed when the block ends.

    ``resume``: the transport is a ``ResumingTransport``, which resumes the session on a new
    connection (for up to ``resume_window`` seconds) when this one drops.

    ``impl``: ``native`` (duplexrt.wire.native: the load generator's frames cost what the server's
    do) or ``trio-websocket``; ``wss://`` URLs always take trio-websocket, which does TLS."""
    native = impl != "trio-websocket" and not url.startswith("wss:")
    try:
        async with trio.open_nursery() as nursery:
            if native:
                connect: Connect = partial(_connect_native, api_key=api_key, timeout=timeout)
            else:
                connect = partial(_connect, nursery, api_key=api_key, timeout=timeout)
            transport: Transport = await connect(url)
            if resume:
                transport = ResumingTransport(transport, url, connect, window=resume_window, on_drop=on_drop,
                                              notices=2 if protocol.name == "moshi" else 1)
            try:
                for message in protocol.hello():
                    await transport.send(message)
                opened = await _greeting(transport, protocol, timeout) if protocol.greets else None
                yield transport, opened
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(5):
                    await transport.close()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # The nursery is this function's own business: callers catch ConnectError and the like.
        if len(group.exceptions) == 1 and not isinstance(group.exceptions[0], BaseExceptionGroup):
            raise group.exceptions[0] from None
        raise


async def _connect_native(url: str, *, api_key: str | None, timeout: float) -> NativeWebSocket:
    """One WebSocket to ``url`` on the native path: the conversation's own tasks read and write
    it, so it needs no task of its own; raises ConnectError if it cannot be opened."""
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
    return NativeWebSocket(stream, client=True, max_message=MAX_MESSAGE_BYTES, received=rest,
                           queue_limit=16, close_timeout=5.0)


async def _connect(nursery: trio.Nursery, url: str, *, api_key: str | None, timeout: float) -> WebSocketTransport:
    """One trio-websocket connection to ``url`` in a task of ``nursery`` that lasts as long as the
    connection; raises ConnectError if it cannot be opened."""
    headers = [(b"authorization", f"Bearer {api_key}".encode())] if api_key else None
    return await nursery.start(partial(_run_connection, url, headers=headers, timeout=timeout))


async def _run_connection(url: str, *, headers: list[tuple[bytes, bytes]] | None, timeout: float,
                          task_status: trio.TaskStatus[WebSocketTransport]) -> None:
    # Over a stream of our own, so that the connection can also be cut (``abort``); in a nursery
    # of its own, where trio-websocket's reader raises a refused handshake.
    parts = urlsplit(url)
    host, port = host_and_port(url)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    default_port = 443 if parts.scheme == "wss" else 80
    host_header = host if port == default_port else f"{host}:{port}"
    started = False
    try:
        async with trio.open_nursery() as connection:
            with trio.fail_after(timeout):
                socket_stream = await trio.open_tcp_stream(host, port)
                stream: trio.SocketStream | trio.SSLStream[trio.SocketStream] = socket_stream
                if parts.scheme == "wss":
                    stream = trio.SSLStream(socket_stream, ssl.create_default_context(), server_hostname=host,
                                            https_compatible=True)
                ws = await trio_websocket.wrap_client_stream(
                    connection, stream, host_header, resource, extra_headers=headers, message_queue_size=16,
                    max_message_size=MAX_MESSAGE_BYTES)
            task_status.started(WebSocketTransport(ws, stream=socket_stream))
            started = True
    except BaseException as exc:
        if started and not isinstance(exc, trio.Cancelled):
            # The conversation saw the connection end already (trio-websocket's reader can fail
            # on its way out, e.g. answering a ping while closing): nothing more to tell anyone.
            if isinstance(exc, BaseExceptionGroup):
                _, rest = exc.split(trio.Cancelled)
                if rest is None:
                    raise
            return
        leaf = exc
        while isinstance(leaf, BaseExceptionGroup) and len(leaf.exceptions) == 1:
            leaf = leaf.exceptions[0]
        if isinstance(leaf, trio.TooSlowError):
            raise ConnectError("timeout", f"timed out opening a WebSocket to {host}:{port}") from None
        if isinstance(leaf, (trio_websocket.HandshakeError, OSError, trio.BrokenResourceError)):
            raise _classify(leaf, url) from None
        raise


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
