"""The WebSocket routes: the one table the server, the client, ``simulate`` and the CLI all read.

Only facts live here (path, protocol, what a person is told, the wire format ``simulate`` uses);
how the server builds each route's translator is in ``server/routes.py``, and how a client speaks
it is in ``client/protocols.py``, both keyed by the protocol name.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class RouteInfo:
    #: The URL path, e.g. ``/v1/realtime``.
    path: str
    #: The protocol spoken there: ``duplex``, ``realtime``, ``moshi``, ``live`` or ``twilio``.
    protocol: str
    #: One line for ``duplexrt serve --help``.
    summary: str
    #: The wire format ``simulate --url`` uses there when ``--format`` is not given.
    simulate_format: str
    #: A variant of another route's protocol with an option forced (``/v1/realtime/duplex``): the
    #: server serves it, but clients pick the plain route with the option in the query.
    variant: bool = False


ROUTE_TABLE: tuple[RouteInfo, ...] = (
    RouteInfo("/v1/duplex", "duplex", "raw PCM (?format=pcm_f32le|pcm_s16le|g711_ulaw|g711_alaw&rate=HZ)",
              "pcm_f32le"),
    RouteInfo("/v1/realtime", "realtime", "OpenAI Realtime protocol (?duplex=1 for a continuous response)",
              "pcm_s16le"),
    # Duplex without the query string: frameworks append their own ``?model=`` to a base URL.
    RouteInfo("/v1/realtime/duplex", "realtime", "OpenAI Realtime protocol, one continuous response",
              "pcm_s16le", variant=True),
    RouteInfo("/api/chat", "moshi", "Kyutai Moshi protocol (Ogg Opus), for Moshi's web client", "opus"),
    RouteInfo("/v1/live/sessions", "live", "OpenAI's full-duplex Live protocol (GPT-Live clients, e.g. LiveKit's)",
              "pcm_s16le"),
    RouteInfo("/twilio/media", "twilio", "Twilio Media Streams, bidirectional (<Connect><Stream>): mu-law 8 kHz",
              "g711_ulaw"),
)

#: Path -> protocol of the routes a client speaks (the variants are reached through their plain route).
CLIENT_ROUTES: dict[str, str] = {route.path: route.protocol for route in ROUTE_TABLE if not route.variant}

#: Protocol -> the wire format ``simulate --url`` uses on its routes by default.
SIMULATE_FORMATS: dict[str, str] = {route.protocol: route.simulate_format for route in ROUTE_TABLE}


def routes_help() -> str:
    """The routes, one per line, for help texts."""
    width = max(len(route.path) for route in ROUTE_TABLE)
    return "\n".join(f"  {route.path:<{width}}  {route.summary}" for route in ROUTE_TABLE)


def client_paths() -> str:
    """``/v1/duplex, /v1/realtime, ...`` : the paths a client may name."""
    return ", ".join(CLIENT_ROUTES)
