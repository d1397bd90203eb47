"""One hostile client beside one paced caller: what the under-attack tests share.

The caller (``paced_victim``) is an honest /v1/duplex session on the echo model, in the test's
own trio run next to the server: one 80 ms frame of f32 audio on schedule, each frame's echo timed
from when it was due, so that any time the trio thread spends on someone else shows as lag.  The
attacker runs in a process of its own (``tests/hostile_client.py``, standard library only, blocking
sockets), so that flooding costs the server's thread and not the caller's: ``hostile`` starts it,
it says ``go`` once its connection is open, and prints one JSON line of what happened to it when
its time is up.  ``server_rss_mib`` reads the server's memory from /proc (the server runs in this
process), and ``assert_nothing_held`` checks that the server is back where it was: nothing
admitted, no session, ``/readyz`` ready with every slot free, and a new caller served exactly.

API for test files: ``ATTACKS`` (the kinds), ``hostile``, ``paced_victim``, ``Victim``,
``server_rss_mib``, ``assert_nothing_held``, ``FRAME_PERIOD_S``.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
import sys
from typing import Any
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import trio

from duplexrt.server.tls import TLSWebSocket
from duplexrt.wire.handshake import client_handshake
from duplexrt.wire.native import NativeWebSocket
from hostile_client import ATTACKS

#: The model frame the caller paces by (the echo model's 24 kHz, 1920 samples).
FRAME = 1920
FRAME_PERIOD_S = 0.08
_SCRIPT = Path(__file__).with_name("hostile_client.py")


PATIENCE = 20.0


@dataclass
class Attack:
    """A running attacker: ``report`` is what it printed at the end (after ``hostile`` exits)."""

    kind: str
    report: dict = field(default_factory=dict)


@contextlib.asynccontextmanager
async def hostile(port: int, kind: str, seconds: float) -> AsyncIterator[Attack]:
    """Run the attacker of ``kind`` against ``port`` for ``seconds``; the body runs once it is
    flooding, and the exit waits for the attacker to end and reads its report."""
    attack = Attack(kind)
    process = await trio.lowlevel.open_process([sys.executable, str(_SCRIPT), kind, str(port), str(seconds)],
                                               stdout=subprocess.PIPE)
    assert process.stdout is not None
    lines = _Lines(process.stdout)
    try:
        with trio.fail_after(PATIENCE):
            assert await lines.next() == "go", "the attacker did not start"
        yield attack
        with trio.fail_after(seconds + PATIENCE):
            attack.report = json.loads(await lines.next())
            await process.wait()
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        await process.stdout.aclose()


class _Lines:
    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self._buffer = b""

    async def next(self) -> str:
        while b"\n" not in self._buffer:
            data = await self._stream.receive_some(65536)
            if not data:
                return ""
            self._buffer += data
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


@dataclass
class Victim:
    """A paced caller's figures: each frame's lag (s) from when it was due to when its echo
    had all come back, and whether what came back is exactly what went."""

    lags: list[float]
    exact: bool
    close_code: int | None

    @property
    def p99_ms(self) -> float:
        """The 99th percentile by rank ("lower"): of a few dozen frames, the second latest, so
        that one scheduling hiccup of a shared machine is not taken for the attack's doing."""
        return float(np.percentile(self.lags, 99, method="lower")) * 1e3 if self.lags else float("inf")

    @property
    def p50_ms(self) -> float:
        return float(np.percentile(self.lags, 50)) * 1e3 if self.lags else float("inf")


async def paced_victim(port: int, seconds: float, seed: int = 0, ssl_context: ssl.SSLContext | None = None) -> Victim:
    """One /v1/duplex session on the echo model: a frame every 80 ms for ``seconds``, then the
    end of input; returns each frame's lag and whether the echo was exact.  ``ssl_context``: over
    wss:// (a server with TLS), trusting what it trusts."""
    count = round(seconds / FRAME_PERIOD_S)
    audio = (np.random.default_rng(seed).standard_normal((count, FRAME)) * 0.2).astype(np.float32)
    frame_bytes = FRAME * 4
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    if ssl_context is None:
        _, rest = await client_handshake(stream, f"ws://127.0.0.1:{port}/v1/duplex")
        ws = NativeWebSocket(stream, client=True, max_message=1 << 22, received=rest, queue_limit=16)
    else:
        tls = trio.SSLStream(stream, ssl_context, server_hostname="127.0.0.1", https_compatible=True)
        _, rest = await client_handshake(tls, f"wss://127.0.0.1:{port}/v1/duplex")
        ws = TLSWebSocket(tls, client=True, max_message=1 << 22, received=rest, queue_limit=16)
    due = [0.0] * count
    lags: list[float] = []
    received = bytearray()
    close_code = None
    with trio.fail_after(seconds + PATIENCE):
        async with trio.open_nursery() as nursery:
            async def send() -> None:
                start = trio.current_time() + 0.01
                for i in range(count):
                    due[i] = start + i * FRAME_PERIOD_S
                    await trio.sleep_until(due[i])
                    await ws.send(audio[i].tobytes())
                await ws.send(json.dumps({"type": "input.end"}))

            nursery.start_soon(send)
            try:
                while True:
                    message = await ws.receive()
                    if isinstance(message, str):
                        continue
                    received += message
                    now = trio.current_time()
                    while len(lags) < len(received) // frame_bytes:
                        lags.append(now - due[len(lags)])
            except Exception as closed:  # TransportClosed: the session's end
                close_code = getattr(closed, "code", None)
            await ws.close()
    return Victim(lags, bytes(received) == audio.tobytes(), close_code)


def server_rss_mib() -> float:
    """The server's resident memory now: it runs in this process."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


async def assert_nothing_held(served) -> None:
    """Once the attacker is gone: nothing admitted, no session, ``/readyz`` ready with every slot
    free, and a new caller admitted and served exactly."""
    server = served.server
    with trio.fail_after(PATIENCE):
        while server.admitted or server.runtime.sessions:
            await trio.sleep(0.02)
    status, body = await served.readyz()
    assert status == 200 and body["ready"] and body["free_slots"] == body["slots"], body
    assert body["admitted"] == 0 and body["detached"] == 0, body
    after = await paced_victim(served.port, 0.4, seed=1)
    assert after.exact and len(after.lags) == 5, after


#: The server's host threads pinned, as on a replica given its own CPUs (``runtime.pin_host_threads
#: = true``).  The default, ``"auto"``, leaves a process that may use every CPU of the box unpinned
#: (it cannot tell its own box from a shared Kubernetes pool, where pinning would stack replicas on
#: one core), and the victim's bounds here are those of a replica with its CPU: unpinned on two
#: shared cores, the attacker's process takes turns with the trio thread.
PINNED = "runtime.pin_host_threads=true"


def pinned_start(start_server: Any) -> Any:
    """conftest's ``start_server`` with the host threads pinned (``PINNED``; an override after
    it still wins)."""
    async def start(*overrides: str, **kwargs: Any) -> Any:
        return await start_server(PINNED, *overrides, **kwargs)

    return start


__all__ = ["ATTACKS", "FRAME_PERIOD_S", "PINNED", "Victim", "assert_nothing_held", "hostile", "paced_victim",
           "pinned_start", "server_rss_mib"]


async def _measure(kinds: list[str], seconds: float) -> None:
    """For each kind: the caller's lag alone, then beside the attacker; RSS growth; its close."""
    from duplexrt.config import load_config
    from duplexrt.server import Server

    config = load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0",
                                "metrics.log_stats=false", "runtime.resume_window_s=0", PINNED])
    async with trio.open_nursery() as nursery:
        server = Server(config)
        await nursery.start(server.run)
        port = server.ports[0]
        await paced_victim(port, 0.4, seed=2)
        for kind in kinds:
            alone = await paced_victim(port, seconds)
            rss = server_rss_mib()
            async with hostile(port, kind, seconds + 0.6) as attack:
                await trio.sleep(0.2)
                attacked = await paced_victim(port, seconds)
                grown = server_rss_mib() - rss
            print(json.dumps({"kind": kind, "alone_p50_ms": round(alone.p50_ms, 1),
                              "alone_p99_ms": round(alone.p99_ms, 1), "p50_ms": round(attacked.p50_ms, 1),
                              "p99_ms": round(attacked.p99_ms, 1),
                              "late_frames": sum(lag > FRAME_PERIOD_S for lag in attacked.lags),
                              "frames": len(attacked.lags), "exact": attacked.exact,
                              "rss_growth_mib": round(grown, 1), "attacker": attack.report}), flush=True)
            with trio.fail_after(PATIENCE):
                while server.admitted:
                    await trio.sleep(0.05)
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    # python tests/attack.py [KIND ...] [--seconds S]: the caller's figures alone and under each attack.
    import argparse

    parser = argparse.ArgumentParser(description=_measure.__doc__)
    parser.add_argument("kinds", nargs="*", default=list(ATTACKS))
    parser.add_argument("--seconds", type=float, default=4.0)
    arguments = parser.parse_args()
    trio.run(_measure, arguments.kinds, arguments.seconds)
