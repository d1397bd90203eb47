"""The WebSocket layer alone: CPU per echoed message, native (duplexrt.wsnative) against
trio-websocket, client and server in one process over loopback TCP.

Each variant runs ``--sessions`` connections at once; each client sends ``--messages`` binary
messages of ``--size`` bytes (7,680: 80 ms of pcm_f32le at 24 kHz), one at a time, and waits for
the server's echo.  The figure is the process's CPU time (user + system) per round trip, i.e. four
message operations: client send, server receive, server send, client receive.  CPU time, not
wall time, so a busy host slows the run but changes the figure less; the variants are still run
alternately, ``--rounds`` times each, and the median printed.

Usage: python benchmarks/websocket_echo.py [--sessions 32] [--messages 300] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import trio
import trio_websocket

from duplexrt.wshandshake import accept_response, after_head, check_request, client_handshake
from duplexrt.wsnative import NativeWebSocket


async def _native_server(stream: trio.SocketStream) -> None:
    received = b""
    while b"\r\n\r\n" not in received:
        received += await stream.receive_some(65536)
    head = received.split(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
    await stream.send_all(accept_response(check_request("GET", headers), None))
    ws = NativeWebSocket(stream, received=after_head(received))
    try:
        while True:
            await ws.send(await ws.receive())
    except Exception:
        pass
    finally:
        with trio.CancelScope(shield=True):
            await ws.close()


async def _native_client(port: int, payload: bytes, count: int) -> None:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    _, rest = await client_handshake(stream, f"ws://127.0.0.1:{port}/echo")
    ws = NativeWebSocket(stream, client=True, received=rest)
    for _ in range(count):
        await ws.send(payload)
        await ws.receive()
    await ws.close()


async def _trio_websocket_server(request: trio_websocket.WebSocketRequest) -> None:
    ws = await request.accept()
    try:
        while True:
            await ws.send_message(await ws.get_message())
    except trio_websocket.ConnectionClosed:
        pass


async def _trio_websocket_client(port: int, payload: bytes, count: int) -> None:
    async with trio_websocket.open_websocket("127.0.0.1", port, "/echo", use_ssl=False) as ws:
        for _ in range(count):
            await ws.send_message(payload)
            await ws.get_message()


async def _run(variant: str, sessions: int, count: int, size: int) -> float:
    payload = os.urandom(size)
    async with trio.open_nursery() as nursery:
        if variant == "native":
            listeners = await nursery.start(partial(trio.serve_tcp, _native_server, 0, host="127.0.0.1"))
            port = listeners[0].socket.getsockname()[1]
            client = _native_client
        else:
            server = await nursery.start(partial(
                trio_websocket.serve_websocket, _trio_websocket_server, "127.0.0.1", 0, ssl_context=None,
                max_message_size=1 << 20, receive_buffer_size=None))
            port = server.port
            client = _trio_websocket_client
        start = time.process_time()
        async with trio.open_nursery() as clients:
            for _ in range(sessions):
                clients.start_soon(client, port, payload, count)
        spent = time.process_time() - start
        nursery.cancel_scope.cancel()
    return spent / (sessions * count) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--size", type=int, default=7680)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    figures: dict[str, list[float]] = {"native": [], "trio-websocket": []}
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for _ in range(args.rounds):
        for variant in figures:
            figures[variant].append(trio.run(_run, variant, args.sessions, args.messages, args.size))
    for variant, values in figures.items():
        print(f"{variant:>15}: {statistics.median(values):7.1f} us CPU per round trip (median of "
              f"{', '.join(f'{v:.1f}' for v in values)})")
    ratio = statistics.median(figures["native"]) / statistics.median(figures["trio-websocket"])
    print(f"native / trio-websocket: {ratio:.2f}; load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
