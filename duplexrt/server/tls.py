"""HTTPS and wss:// on the server's one port (``server.ssl_certfile``, ``server.ssl_keyfile``).

Browsers give a page the microphone only over https:// or on localhost, so the talk page on a
remote GPU box needs TLS.  ``server_context`` loads the certificate and key at start, before the
model loads, and says plainly what is wrong with them (missing, unreadable, not PEM, not a pair).

A connection is wrapped in a ``trio.SSLStream`` as it is accepted; its TLS handshake is then done
as the first part of reading its request head (``Server._read_head``), so it falls under the same
limits as the head: ``server.handshake_timeout_s`` and ``server.max_pending_handshakes``.  A client
that speaks plain HTTP to the port is told so in plain HTTP (``plain_http_refusal``), as nginx does.

``TLSWebSocket``: the native WebSocket (``duplexrt.wire.native``) with its reads and writes
through the ``SSLStream`` instead of the socket; everything else (limits, pings, close) is its own.
"""

from __future__ import annotations

import socket
import ssl
from typing import Any

import trio

from duplexrt.config import ConfigError
from duplexrt.server.http import response_bytes
from duplexrt.wire.frames import MIN_ROOM
from duplexrt.wire.native import NativeWebSocket

__all__ = ["Stream", "TLSWebSocket", "refuse_plain_http", "server_context", "speaks_tls"]

#: A connection as the server serves it: plain TCP, or TLS over it.
Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]

#: The first byte of a TLS record carrying a handshake (a ClientHello).
_TLS_HANDSHAKE_RECORD = 0x16
#: The most one TLS read takes (as the native path's ``_MAX_READ``).
_MAX_READ = 1 << 18
#: What is read of a plain HTTP request refused on the TLS port, at most.
_REFUSED_READ = 1 << 16


def server_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    """The server's TLS context from PEM files; ``ConfigError`` saying what is wrong with them."""
    for key, path in (("server.ssl_certfile (--ssl-certfile)", certfile), ("server.ssl_keyfile (--ssl-keyfile)", keyfile)):
        try:
            with open(path, "rb") as file:
                file.read(1)
        except FileNotFoundError:
            raise ConfigError(f"{key}: no such file: {path}") from None
        except IsADirectoryError:
            raise ConfigError(f"{key}: {path} is a directory, not a PEM file") from None
        except OSError as exc:
            raise ConfigError(f"{key}: cannot read {path}: {exc.strerror or exc}") from None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])  # no h2: a WebSocket upgrade is HTTP/1.1's
    try:
        context.load_cert_chain(certfile, keyfile)
    except ssl.SSLError as exc:
        reason = str(exc.reason or exc)
        if "KEY_VALUES_MISMATCH" in reason:
            raise ConfigError(f"server.ssl_keyfile {keyfile} is not the key of the certificate in "
                              f"server.ssl_certfile {certfile}") from None
        raise ConfigError(f"cannot load the TLS certificate {certfile} and key {keyfile} (PEM files "
                          f"expected, the key unencrypted): {reason}") from None
    except OSError as exc:
        raise ConfigError(f"cannot load the TLS certificate {certfile} and key {keyfile}: "
                          f"{exc.strerror or exc}") from None
    return context


async def speaks_tls(stream: trio.SocketStream) -> bool | None:
    """Whether the client's first byte begins a TLS handshake (it is only looked at, not taken);
    None when the connection ended before any byte."""
    try:
        data = await stream.socket.recv(1, socket.MSG_PEEK)
    except OSError:
        return None
    if not data:
        return None
    return data[0] == _TLS_HANDSHAKE_RECORD


async def refuse_plain_http(stream: trio.SocketStream) -> None:
    """Answer plain HTTP on the TLS port in plain HTTP (400), then read the request to its end
    (a close with unread bytes would reset the connection before the answer is read).  The
    caller bounds the time (the head's deadline)."""
    try:
        await stream.receive_some(_REFUSED_READ)
        await stream.send_all(response_bytes(400, b"this port speaks TLS: use https:// (wss:// for WebSocket "
                                                  b"sessions)\n", "text/plain; charset=utf-8"))
        await stream.send_eof()
        taken = 0
        while taken < _REFUSED_READ and (data := await stream.receive_some(_REFUSED_READ)):
            taken += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


class TLSWebSocket(NativeWebSocket):
    """``NativeWebSocket`` over TLS: the frames are read and written through ``tls``; the socket
    under it is what a drop closes and an idle limit shuts (as on the plain path)."""

    def __init__(self, tls: trio.SSLStream[trio.SocketStream], **options: Any) -> None:
        super().__init__(tls.transport_stream, **options)
        self._tls = tls

    async def _receive_some(self) -> int:
        try:
            data = await self._tls.receive_some(_MAX_READ)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            return 0
        if data and not self._connection.failed:
            self._parser.feed(data)
        self._drained = len(data) < MIN_ROOM
        return len(data)

    def _write_now(self, data: bytes | bytearray, tail: bytes) -> bytes | memoryview | None:
        # Nothing goes out without a wait here: all of it is left to ``_write_rest``.
        if self._sock.fileno() < 0:
            self._lost()
            return None
        return memoryview(bytes(data) + tail)

    async def _write_rest(self, view: bytes | memoryview) -> bool:
        try:
            await self._tls.send_all(view)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            self._lost()
            return False
        return True
