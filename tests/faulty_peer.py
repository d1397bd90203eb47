"""A WebSocket client that can misbehave at any byte: wsproto over a plain trio socket.

The well-behaved clients in the suite (trio-websocket, the ``websockets`` library, the openai SDK)
all answer a Close, read what they are sent and finish the frames they start.  The fault tests need
peers that do none of that, so this one drives the protocol by hand and lets a test stop at any
point: half a frame, a Close never answered, a socket that is never read again.
"""

from __future__ import annotations

import struct

import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    RejectConnection,
    RejectData,
    Request,
    TextMessage,
)


class Rejected(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"handshake refused with HTTP {status}")
        self.status = status


class FaultyPeer:
    """One client connection.  Every method does exactly what it says and nothing more: no
    automatic pongs, no automatic Close reply."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.close_code: int | None = None
        self.close_reason = ""
        self.pings = 0
        #: The server dropped the TCP connection without (or after) its Close.
        self.dropped = False

    @classmethod
    async def connect(cls, port: int, path: str) -> FaultyPeer:
        peer = cls(await trio.open_tcp_stream("127.0.0.1", port))
        await peer.stream.send_all(peer.ws.send(Request(host="127.0.0.1", target=path)))
        while True:
            for event in await peer._events():
                if isinstance(event, AcceptConnection):
                    return peer
                if isinstance(event, RejectConnection | RejectData):
                    await peer.abort()
                    raise Rejected(getattr(event, "status_code", 0))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send_all(self.ws.send(BytesMessage(data=data)))

    async def send_text(self, text: str) -> None:
        await self.stream.send_all(self.ws.send(TextMessage(data=text)))

    async def send_raw(self, data: bytes) -> None:
        """Bytes straight onto the socket, outside wsproto's knowledge (half frames, bad UTF-8)."""
        await self.stream.send_all(data)

    async def receive(self) -> list[bytes | str]:
        """The next messages, or [] once the server has sent Close (recorded, not answered)."""
        messages: list[bytes | str] = []
        while not messages and self.close_code is None and not self.dropped:
            try:
                events = await self._events()
            except (EOFError, trio.BrokenResourceError):
                self.dropped = True
                break
            for event in events:
                if isinstance(event, BytesMessage | TextMessage):
                    messages.append(event.data)
                elif isinstance(event, CloseConnection):
                    self.close_code, self.close_reason = event.code, event.reason or ""
                elif isinstance(event, Ping):
                    self.pings += 1
        return messages

    async def receive_until_close(self) -> list[bytes | str]:
        received: list[bytes | str] = []
        while self.close_code is None and not self.dropped:
            received.extend(await self.receive())
        return received

    async def wait_closed_by_server(self) -> None:
        """Read until the server drops the TCP connection itself (EOF or reset)."""
        try:
            while await self.stream.receive_some(65536):
                pass
        except trio.BrokenResourceError:
            pass

    async def abort(self) -> None:
        """Vanish: close the socket with no Close frame."""
        await trio.aclose_forcefully(self.stream)

    async def _events(self) -> list:
        data = await self.stream.receive_some(65536)
        if not data:
            raise EOFError("the server closed the TCP connection")
        self.ws.receive_data(data)
        return list(self.ws.events())


def masked_frame_header(opcode: int, length: int, fin: bool = True) -> bytes:
    """The start of a client frame (mask key all zeros, so the payload goes as is)."""
    first = (0x80 if fin else 0) | opcode
    if length < 126:
        return bytes([first, 0x80 | length]) + b"\0\0\0\0"
    if length < 1 << 16:
        return bytes([first, 0x80 | 126]) + struct.pack(">H", length) + b"\0\0\0\0"
    return bytes([first, 0x80 | 127]) + struct.pack(">Q", length) + b"\0\0\0\0"
