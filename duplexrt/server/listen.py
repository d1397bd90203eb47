"""The server's port: checked before the model loads, and named when it cannot be had.

Loading a model takes minutes; a port another process holds used to be found only after it, as
``cannot listen: [Errno 98] Address already in use`` without the address.  ``check_free`` binds
(and lets go of) every address the server will listen on before the load, the way
``trio.open_tcp_listeners`` binds them (``SO_REUSEADDR``, IPv6 sockets IPv6-only), so a taken
port is refused at once, naming it.  ``open_listeners`` names the address too, should the port be
taken during the load.
"""

from __future__ import annotations

import socket

import trio


def _address(host: str | None, port: int) -> str:
    shown = host or "every interface"
    return f"[{shown}]:{port}" if ":" in shown else f"{shown}:{port}"


def _named(exc: OSError, host: str | None, port: int) -> OSError:
    what = exc.strerror or str(exc)
    return OSError(exc.errno, f"{what}: {_address(host, port)} (server.host, server.port); another process "
                              "listens there: stop it, or choose another port (--port, DUPLEXRT_PORT)")


def check_free(host: str | None, port: int) -> None:
    """Raise ``OSError`` naming ``host:port`` where the server could not listen there now (port 0,
    any free port, is always free)."""
    if port == 0:
        return
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(exc.errno, f"cannot resolve server.host {host!r}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                raise _named(exc, host, port) from None


async def open_listeners(port: int, host: str | None) -> list[trio.SocketListener]:
    """``trio.open_tcp_listeners``, its error naming the address."""
    try:
        return await trio.open_tcp_listeners(port, host=host)
    except OSError as exc:
        raise _named(exc, host, port) from None
