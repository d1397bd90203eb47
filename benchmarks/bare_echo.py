"""The floor under ``duplexrt serve``: what trio and the WebSocket layer cost with no runtime at all.

One trio task per connection reads each message and sends back, in the same wake-up, the whole
frames of echo it makes ready (one send per message of whole frames; none for a message shorter
than a frame, as the server answers per frame): no scheduler thread, no inbox, no session, no
translator, no metrics beyond two counters.  It speaks
just enough of ``/v1/duplex`` (pcm_f32le at 24 kHz, 80 ms frames) for ``duplexrt simulate --url``
to drive it and check every frame: the greeting, the output delayed by two frames as the echo
model's default ``delay_frames``, ``session.end`` with usage after ``input.end``, and a
``/metrics`` page with the three series ``simulate`` reads (frames in and out, process CPU), so its
CPU per frame is measured exactly as the server's is.

The difference between this and ``duplexrt serve`` on the same load is what the runtime adds; what
this costs is a floor no change inside the runtime can go below, given one socket operation each
way.  ``benchmarks/server.py --variants bare,...`` runs it beside the others.

Usage: python benchmarks/bare_echo.py [--port 0]   (prints "listening on port(s) N" on stderr)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import trio

from duplexrt.wire.transport import TransportClosed
from duplexrt.wire.handshake import HandshakeRefused, accept_response, after_head, check_request
from duplexrt.wire.native import NativeWebSocket

SAMPLE_RATE = 24000
FRAME_BYTES = 1920 * 4  # one 80 ms frame of pcm_f32le
DELAY_BYTES = 2 * FRAME_BYTES
_GREETING = json.dumps({"type": "session.created",
                        "input": {"format": "pcm_f32le", "sample_rate": SAMPLE_RATE},
                        "output": {"format": "pcm_f32le", "sample_rate": SAMPLE_RATE}})


class Counters:
    """Bytes in and out, as the frames ``/metrics`` reports."""

    def __init__(self) -> None:
        self.bytes_in = 0
        self.bytes_out = 0

    def metrics_page(self) -> bytes:
        times = os.times()
        return (f"duplexrt_frames_in_total {self.bytes_in / FRAME_BYTES}\n"
                f"duplexrt_frames_out_total {self.bytes_out / FRAME_BYTES}\n"
                f"process_cpu_seconds_total {times.user + times.system}\n").encode()


async def _read_head(stream: trio.SocketStream) -> bytes:
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = await stream.receive_some(65536)
        if not chunk:
            raise EOFError
        received += chunk
    return received


def _plain_response(status: str, body: bytes = b"") -> bytes:
    return (f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\ncontent-length: {len(body)}\r\n"
            "connection: close\r\n\r\n").encode() + body


class _Echo:
    """One connection's echo: every binary message two frames late; ``input.end`` ends it."""

    def __init__(self, ws: NativeWebSocket, counters: Counters) -> None:
        self.ws = ws
        self.counters = counters
        self.held = bytes(DELAY_BYTES)
        self.received = 0  # bytes of audio: whole frames once the input has ended
        self.ended = False

    def _answer(self, message: bytes) -> bytes:
        """The whole frames ``message`` makes ready, two frames late: nothing for a message that
        completes no frame, as the server sends per frame, whatever the client's message size."""
        size = len(message)
        self.counters.bytes_in += size
        self.received += size
        stream = self.held + message
        ready = max(0, len(stream) - DELAY_BYTES) // FRAME_BYTES * FRAME_BYTES
        self.held = stream[ready:]
        self.counters.bytes_out += ready
        return stream[:ready]

    def _ends(self, message: str) -> bool:
        return json.loads(message).get("type") == "input.end"

    async def run(self) -> None:
        ws = self.ws
        while not self.ended:
            message = await ws.receive()
            if isinstance(message, str):
                self.ended = self._ends(message)
            elif answer := self._answer(message):
                await ws.send(answer)
        frames = self.received // FRAME_BYTES
        await ws.send(json.dumps({"type": "session.end", "reason": "stop",
                                  "usage": {"frames_in": frames, "frames_out": frames}}))


async def _connection(stream: trio.SocketStream, counters: Counters) -> None:
    try:
        received = await _read_head(stream)
        lines = received.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
        method, path = (lines[0].split(" ") + ["", ""])[:2]
        headers = {name.strip().lower(): value.strip()
                   for name, _, value in (line.partition(":") for line in lines[1:])}
        if "websocket" not in headers.get("upgrade", "").lower():
            if path.startswith("/metrics"):
                await stream.send_all(_plain_response("200 OK", counters.metrics_page()))
            else:
                await stream.send_all(_plain_response("404 Not Found"))
            return
        try:
            accept = accept_response(check_request(method, headers), None)
        except HandshakeRefused as refused:
            await stream.send_all(_plain_response("400 Bad Request", str(refused).encode()))
            return
        await stream.send_all(accept)
    except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
        await stream.aclose()
        return
    ws = NativeWebSocket(stream, received=after_head(received))
    try:
        await ws.send(_GREETING)
        await _Echo(ws, counters).run()
    except TransportClosed:
        pass
    finally:
        with trio.CancelScope(shield=True):
            await ws.close()


async def serve(port: int) -> None:
    counters = Counters()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            lambda task_status: trio.serve_tcp(lambda stream: _connection(stream, counters), port,
                                               host="127.0.0.1", task_status=task_status))
        bound = listeners[0].socket.getsockname()[1]
        print(f"bare echo listening on port(s) {bound}", file=sys.stderr, flush=True)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                nursery.cancel_scope.cancel()  # the benchmark's stop: exit 0, as the server does
                break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    trio.run(serve, args.port)


if __name__ == "__main__":
    main()
