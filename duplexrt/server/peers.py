"""Who is at the other end of a connection, and how many connections each client holds.

The address a connection comes from decides two things: who may stop the server (``POST
/drain``: by default only a loopback peer, see ``duplexrt.server.drain``) and how many connections
one client may hold open at once (``server.max_connections_per_peer``, counted by ``PeerCounts``).
Behind a balancer every connection comes from the balancer: when its address is listed in
``server.trusted_proxies``, the client is the one its ``X-Forwarded-For`` names (the rightmost
address there that is not itself a trusted proxy, as the balancer appended it).  The header of a
peer that is not trusted is never believed: any client can write one.

Nothing here awaits or does I/O beyond one ``getpeername``; the network lists are parsed once per
configuration (``functools.lru_cache``).
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping
from typing import Any, Union

__all__ = ["Address", "FORWARDING_HEADERS", "PeerCounts", "client_address", "forwarded", "in_networks", "parse_address",
           "peer_address"]

Address = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
_Network = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

#: Headers a proxy adds to say whom it forwards for: a request that carries one came through a
#: proxy, whatever its own peer address says.
FORWARDING_HEADERS = ("forwarded", "x-forwarded-for", "x-real-ip")


def parse_address(text: str) -> Address | None:
    """An IP address as ``getpeername`` or ``X-Forwarded-For`` writes it (``[::1]``, a zone
    index, an IPv4-mapped IPv6 address, which is read as its IPv4 address), or None."""
    text = text.strip()
    if text.startswith("[") and "]" in text:
        text = text[1:text.index("]")]
    try:
        address = ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def peer_address(stream: Any) -> Address | None:
    """The address a socket stream's peer connects from; None where there is none (a Unix
    socket, a test's in-memory stream, a socket already gone)."""
    try:
        name = stream.socket.getpeername()
    except (AttributeError, OSError):
        return None
    return parse_address(name[0]) if isinstance(name, tuple) and name and isinstance(name[0], str) else None


@functools.lru_cache(maxsize=32)
def _networks(items: tuple[str, ...]) -> tuple[_Network, ...]:
    return tuple(ipaddress.ip_network(item, strict=False) for item in items)


def in_networks(address: Address | None, networks: tuple[str, ...]) -> bool:
    """``address`` lies in one of ``networks`` (a configuration's list, e.g. ``server.drain_from``)."""
    return address is not None and any(address in network for network in _networks(networks))


def client_address(peer: Address | None, headers: Mapping[str, str], trusted: tuple[str, ...]) -> Address | None:
    """The client a request comes from: ``peer`` itself, unless ``peer`` is a trusted proxy
    that says whom it forwards for (``X-Forwarded-For``): then the rightmost address there that
    is not a trusted proxy too.  None when a trusted proxy forwards an address that is no
    address (nothing can be said of that client)."""
    if not trusted or not in_networks(peer, trusted):
        return peer
    client = peer
    for hop in reversed(headers.get("x-forwarded-for", "").split(",")):
        if not hop.strip():
            continue
        client = parse_address(hop)
        if client is None or not in_networks(client, trusted):
            break
    return client


def forwarded(headers: Mapping[str, str]) -> bool:
    """The request says it came through a proxy."""
    return any(name in headers for name in FORWARDING_HEADERS)


class PeerCounts:
    """Connections open per client address, up to ``cap`` each (0: no cap).  ``take`` before
    serving a connection, ``give_back`` when it ends."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._open: dict[Address, int] = {}

    def __len__(self) -> int:
        """Addresses with a connection open."""
        return len(self._open)

    def open(self, address: Address) -> int:
        return self._open.get(address, 0)

    def take(self, address: Address) -> bool:
        """Count one more connection from ``address``; False (nothing counted) when it already
        holds ``cap``."""
        count = self._open.get(address, 0)
        if self.cap and count >= self.cap:
            return False
        self._open[address] = count + 1
        return True

    def give_back(self, address: Address) -> None:
        count = self._open.get(address, 0) - 1
        if count > 0:
            self._open[address] = count
        else:
            self._open.pop(address, None)
