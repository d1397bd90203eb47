"""Clients of a running duplexrt server: one sans-IO protocol class per route, a conversation
driver shared with ``duplexrt simulate``, and the ``duplexrt client`` command's logic."""

from duplexrt.client.connection import ConnectError, open_connection
from duplexrt.wire.wss import WebSocketTransport
from duplexrt.client.conversation import Conversation
from duplexrt.client.protocols import (
    ClientProtocol,
    DuplexClient,
    Ended,
    LiveClient,
    MoshiClient,
    Opened,
    Other,
    RealtimeClient,
    ServerError,
    Text,
    UnknownRoute,
    client_for_url,
    route_of,
)

__all__ = [
    "ClientProtocol", "ConnectError", "Conversation", "DuplexClient", "Ended", "LiveClient", "MoshiClient", "Opened",
    "Other", "RealtimeClient", "ServerError", "Text", "UnknownRoute", "WebSocketTransport",
    "client_for_url", "open_connection", "route_of",
]
