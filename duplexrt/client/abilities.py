"""A client transport's optional abilities, as types a checker can follow (not ``getattr``).

A load generator that sends hundreds of paced conversations from one process wants to write a
message without a checkpoint when the connection can take it now (``NativeWebSocket`` and the
in-memory transport can; trio-websocket's cannot).  Whether a transport can is found once, when a
conversation (or a resuming wrapper) starts, and from then on called directly.  ``simulate
--drop-rate`` also cuts connections without a Close frame, where the transport can be aborted.
A server's session asks more of a direct send (a flush, and whether the message went whole); a
client needs only this.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from duplexrt.wire.transport import Message

__all__ = ["Abortable", "NowaitSender", "SendsNowait", "nowait_sender"]

#: Send one message without yielding, or raise ``trio.WouldBlock`` having taken nothing (the
#: caller then sends it with ``await send``).  What it returns is not read by the client.
NowaitSender = Callable[[Message], object]


@runtime_checkable
class SendsNowait(Protocol):
    """A transport that offers ``send_nowait``."""

    def send_nowait(self, message: Message) -> object:
        """Send ``message`` now, or raise ``trio.WouldBlock`` having taken nothing."""
        ...


def nowait_sender(transport: object) -> NowaitSender | None:
    """``transport.send_nowait``, or None for a transport that only sends by ``await``."""
    return transport.send_nowait if isinstance(transport, SendsNowait) else None


@runtime_checkable
class Abortable(Protocol):
    """A transport that can drop its connection at once, without a Close frame (``simulate
    --drop-rate`` cuts connections so)."""

    def abort(self) -> None:
        """Drop the connection now."""
        ...
