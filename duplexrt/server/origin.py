"""Which web pages may open a WebSocket session (or POST /drain) when the server has no API key.

A browser lets any page it shows open a WebSocket to any address, the developer's own
``127.0.0.1:8000`` included, and says which page asked in the ``Origin`` header.  Without a key
nothing else stands between a page on some other site and the model, so an upgrade whose Origin
is a foreign page is refused (403), unless ``server.allowed_origins`` names it.  So is a foreign
page's ``POST /drain``: a plain form may send one, no script needed.  What passes:

* no Origin header: not a browser (SDKs, ``duplexrt client``, curl); a browser always sends one;
* the server's own pages (the talk page, the dashboard): the Origin's host and port are the
  request's ``Host``;
* pages on a loopback host (``localhost``, ``*.localhost``, ``127.0.0.0/8``, ``[::1]``) on any
  port: a developer's own front end during development;
* an origin ``server.allowed_origins`` lists (``"*"``: every one).

With a key the key decides and the Origin is not looked at: a page that holds the key was given
it.  The check only reads headers: nothing here costs more than a few string operations.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Mapping
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from duplexrt.config import ServerConfig

__all__ = ["origin_refusal", "normalized_origin"]

_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def normalized_origin(text: str) -> str | None:
    """``scheme://host[:port]`` in lower case without its default port, as the Origin header
    and ``server.allowed_origins`` are compared; ``"null"`` (a page from a file, a sandboxed
    frame) as is; None for anything that is no origin (a path, no host, a bad port)."""
    text = text.strip().lower()
    if text == "null":
        return text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:  # "http://[::1" (a bracket left open), a port that is no number
        return None
    if parts.scheme not in _DEFAULT_PORTS or not parts.hostname or parts.path not in ("", "/") \
            or parts.query or parts.fragment or parts.username is not None or parts.password is not None:
        return None
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    if port is None or port == _DEFAULT_PORTS[parts.scheme]:
        return f"{parts.scheme}://{host}"
    return f"{parts.scheme}://{host}:{port}"


def origin_refusal(headers: Mapping[str, str], settings: ServerConfig) -> str | None:
    """Why an upgrade with these request headers (lower-case names) is refused (403), or None
    when it may go on, under ``settings`` (``server.api_key`` and ``server.allowed_origins``)."""
    origin = headers.get("origin")
    if settings.api_key or origin is None:
        return None
    listed = _listed(settings.allowed_origins)
    if "*" in listed:
        return None
    normal = normalized_origin(origin)
    if normal is not None and (normal in listed or _same_host(normal, headers.get("host", ""))
                               or _is_loopback(normal)):
        return None
    shown = origin if len(origin) <= 100 else origin[:100] + "..."
    return (f"Origin {shown!r} is not this server's, and the server has no API key: a web page on "
            "another site may not open a session or drain the server; list the page's origin in "
            "server.allowed_origins, or set an API key")


@functools.lru_cache(maxsize=8)
def _listed(allowed: tuple[str, ...]) -> frozenset[str]:
    """``server.allowed_origins`` as compared (normalized once per config, not per upgrade)."""
    return frozenset("*" if item.strip() == "*" else normalized_origin(item) or "" for item in allowed) - {""}


def _host_port(normal: str) -> tuple[str, int]:
    """The host and port of a normalized origin (the port filled in from its scheme)."""
    parts = urlsplit(normal)
    return parts.hostname or "", parts.port or _DEFAULT_PORTS[parts.scheme]


def _same_host(normal: str, host_header: str) -> bool:
    """The page came from this server: its host and port are those the request was sent to."""
    if normal == "null" or not host_header:
        return False
    host, port = _host_port(normal)
    scheme = urlsplit(normal).scheme
    target = normalized_origin(f"{scheme}://{host_header.strip()}")
    return target is not None and _host_port(target) == (host, port)


def _is_loopback(normal: str) -> bool:
    if normal == "null":
        return False
    host = _host_port(normal)[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
