"""A hostile WebSocket client, run as a process of its own by ``tests/attack.py``: standard library
only, blocking sockets, so that its flooding costs the server's trio thread and not the test's.

``python tests/hostile_client.py KIND PORT SECONDS``: open the route of ``KIND`` (``ATTACKS``),
print ``go``, send its flood back to back for ``SECONDS`` while a thread reads everything the
server sends (so that the server's writes never stall) and notes its Close, reset the
connection, then print one JSON line: bytes sent and received, and the server's close code and
reason (null if the server kept serving it to the end).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
import sys
import threading
import time

#: What the attacker can do, each on its route: what it sends, back to back, as fast as it can.
ATTACKS = {
    "ping": "/v1/duplex",  # 125-byte pings, reading the pongs
    "tiny-messages": "/v1/duplex",  # 4-byte audio messages (one f32 sample), reading the output
    "empty-fragments": "/v1/duplex",  # a binary frame without FIN, then empty continuations
    "byte-fragments": "/v1/duplex",  # the same with one-byte continuations
    "big-json": "/v1/realtime",  # 2 MiB JSON events
    "metrics": "/metrics",  # GET /metrics in a loop, a connection each
    "big-heads": "/v1/duplex",  # four clients in parallel, each upgrade head ~6,200 tiny fields (60 KiB)
    "close-flood": "/v1/duplex",  # a frame and input.end; once the server's Close comes, 1 MiB messages
    "many-connections": "/v1/duplex",  # 32 connections from 127.0.0.2, each sending tiny messages
}


def _frame(opcode: int, payload: bytes = b"", fin: bool = True) -> bytes:
    """A client frame with the all-zero mask key: the payload goes as is, the server unmasks."""
    first = (0x80 if fin else 0) | opcode
    size = len(payload)
    if size < 126:
        head = struct.pack("!BB", first, 0x80 | size)
    elif size < 1 << 16:
        head = struct.pack("!BBH", first, 0x80 | 126, size)
    else:
        head = struct.pack("!BBQ", first, 0x80 | 127, size)
    return head + b"\0\0\0\0" + payload


def _flood_batch(kind: str) -> tuple[bytes, bytes]:
    """What goes first, and what is sent again and again (about 64 KiB a send)."""
    if kind == "ping":
        return b"", _frame(0x9, b"p" * 125) * 480
    if kind == "tiny-messages":
        return b"", _frame(0x2, b"\0\0\0\0") * 6500
    if kind == "empty-fragments":
        return _frame(0x2, b"", fin=False), _frame(0x0, b"", fin=False) * 10000
    if kind == "byte-fragments":
        return _frame(0x2, b"\0", fin=False), _frame(0x0, b"\0", fin=False) * 9000
    if kind == "big-json":
        event = json.dumps({"type": "x.unknown", "pad": "a" * ((2 << 20) - 100)}).encode()
        return b"", _frame(0x1, event)
    raise ValueError(kind)


class _ServerFrames(threading.Thread):
    """Reads everything the server sends (so its writes never stall) and notes its Close."""

    def __init__(self, sock: socket.socket, pending: bytes) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.buffer = bytearray(pending)
        self.close: tuple[int, str] | None = None
        self.received = 0

    def run(self) -> None:
        while self.close is None:
            try:
                data = self.sock.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            self.received += len(data)
            self.buffer += data
            self._parse()

    def _parse(self) -> None:
        buffer = self.buffer
        while len(buffer) >= 2:
            size, at = buffer[1] & 0x7F, 2
            if size == 126:
                if len(buffer) < 4:
                    return
                size, at = struct.unpack_from("!H", buffer, 2)[0], 4
            elif size == 127:
                if len(buffer) < 10:
                    return
                size, at = struct.unpack_from("!Q", buffer, 2)[0], 10
            if len(buffer) < at + size:
                return
            if buffer[0] & 0x0F == 0x8:
                payload = bytes(buffer[at:at + size])
                code = struct.unpack("!H", payload[:2])[0] if len(payload) >= 2 else 1005
                self.close = (code, payload[2:].decode("utf-8", "replace"))
            del buffer[:at + size]


def _open_websocket(port: int, path: str, source: str | None = None) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0) if source else None)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                  f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    received = b""
    while b"\r\n\r\n" not in received:
        data = sock.recv(65536)
        if not data:
            raise SystemExit("the server closed during the handshake")
        received += data
    head, _, rest = received.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 101"):
        raise SystemExit(f"refused: {head[:80]!r}")
    return sock, rest


def _scrape(port: int, seconds: float) -> dict:
    scrapes = 0
    deadline = time.monotonic() + seconds
    print("go", flush=True)
    while time.monotonic() < deadline:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            while sock.recv(65536):
                pass
        scrapes += 1
    return {"scrapes": scrapes}


def _big_heads(port: int, seconds: float, clients: int = 4) -> dict:
    """Upgrade heads of thousands of one-letter header fields, back to back from ``clients``
    threads, each answered (431) before the next: what costs the server most per byte to parse."""
    head = (f"GET {ATTACKS['big-heads']} HTTP/1.1\r\nHost: x\r\n".encode()
            + b"".join(b"x%d: y\r\n" % i for i in range(6200))[:60_000] + b"\r\n")
    answers: list[bytes] = []
    deadline = time.monotonic() + seconds

    def loop() -> None:
        while time.monotonic() < deadline:
            with socket.create_connection(("127.0.0.1", port)) as sock:
                try:
                    sock.sendall(head)
                    answers.append(sock.recv(64)[:12])
                except OSError:  # refused before the whole head was read: also an answer
                    answers.append(b"reset")

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(clients)]
    print("go", flush=True)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"heads": len(answers), "answers": sorted({answer.decode("latin-1") for answer in answers})}


def _close_flood(port: int, seconds: float) -> dict:
    """Ends its input so that the server closes, never answers the server's Close, and streams
    1 MiB binary messages into the closing handshake until the server hangs up (or the time
    is up): what a server that keeps the messages of a closing peer holds until its close
    timeout."""
    sock, rest = _open_websocket(port, ATTACKS["close-flood"])
    reader = _ServerFrames(sock, rest)
    reader.start()
    print("go", flush=True)
    deadline = time.monotonic() + seconds
    sock.sendall(_frame(0x2, bytes(4 * 1920)) + _frame(0x1, b'{"type": "input.end"}'))
    while reader.close is None and reader.is_alive() and time.monotonic() < deadline:
        reader.join(0.01)
    closed_at = time.monotonic()
    message = _frame(0x2, bytes(1 << 20))
    sent = 0
    try:
        while reader.close is not None and time.monotonic() < deadline:
            sock.sendall(message)
            sent += len(message)
    except OSError:  # the server hung up: its close timeout, or reset
        pass
    hung_up = time.monotonic() - closed_at
    while time.monotonic() < deadline and reader.is_alive():
        reader.join(0.05)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    code, reason = reader.close or (None, "")
    return {"sent": sent, "received": reader.received, "close_code": code, "close_reason": reason,
            "hung_up_after_s": round(hung_up, 2)}


def _flood(kind: str, port: int, seconds: float) -> dict:
    sock, rest = _open_websocket(port, ATTACKS[kind])
    reader = _ServerFrames(sock, rest)
    reader.start()
    first, batch = _flood_batch(kind)
    sent = 0
    deadline = time.monotonic() + seconds
    print("go", flush=True)
    try:
        if first:
            sock.sendall(first)
        while time.monotonic() < deadline and reader.close is None:
            sock.sendall(batch)
            sent += len(batch)
    except OSError:  # the server hung up
        pass
    # Hold the connection open for the rest of the time, as an attacker waiting would; then
    # reset it, so that what the flood left queued is thrown away, not worked through first.
    while time.monotonic() < deadline and reader.is_alive():
        reader.join(0.05)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    code, reason = reader.close or (None, "")
    return {"sent": sent, "received": reader.received, "close_code": code, "close_reason": reason}


def _many_connections(port: int, seconds: float, connections: int = 32, source: str = "127.0.0.2") -> dict:
    """``connections`` sessions from one address (another one than the victim's), each sending
    tiny messages back to back: what one client's many connections take from everyone else's."""
    opened, refused = [], 0
    for _ in range(connections):
        try:
            opened.append(_open_websocket(port, ATTACKS["many-connections"], source))
        except (SystemExit, OSError):  # refused (429), or reset before the answer was read
            refused += 1
    readers = []
    for sock, rest in opened:
        reader = _ServerFrames(sock, rest)
        reader.start()
        readers.append(reader)
    _, batch = _flood_batch("tiny-messages")
    deadline = time.monotonic() + seconds
    sent = [0] * len(opened)

    def flood(index: int, sock: socket.socket) -> None:
        try:
            while time.monotonic() < deadline and readers[index].close is None:
                sock.sendall(batch)
                sent[index] += len(batch)
        except OSError:
            pass

    threads = [threading.Thread(target=flood, args=(i, sock), daemon=True) for i, (sock, _) in enumerate(opened)]
    print("go", flush=True)
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for sock, _ in opened:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    return {"opened": len(opened), "refused": refused, "sent": sum(sent)}


def _main(kind: str, port: int, seconds: float) -> None:
    if kind == "metrics":
        report = _scrape(port, seconds)
    elif kind == "big-heads":
        report = _big_heads(port, seconds)
    elif kind == "close-flood":
        report = _close_flood(port, seconds)
    elif kind == "many-connections":
        report = _many_connections(port, seconds)
    else:
        report = _flood(kind, port, seconds)
    print(json.dumps(report), flush=True)




if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
