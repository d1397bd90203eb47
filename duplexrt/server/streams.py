"""A stream that gives back bytes already read from it before reading on."""

from __future__ import annotations

import trio


class PrefixedStream(trio.abc.Stream):
    """Lets the server read a request head to choose what to do with a connection, then hand the
    whole connection — head included — to the WebSocket layer as if it had never been read."""

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self.stream = stream
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            if max_bytes is None or max_bytes >= len(self._prefix):
                data, self._prefix = self._prefix, b""
            else:
                data, self._prefix = self._prefix[:max_bytes], self._prefix[max_bytes:]
            await trio.lowlevel.checkpoint()
            return data
        return await self.stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.stream.aclose()
