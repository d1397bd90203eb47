"""``duplexrt serve``: WebSocket routes, plain-HTTP health and metrics, on one port."""

from duplexrt.server.app import Server, serve

__all__ = ["Server", "serve"]
