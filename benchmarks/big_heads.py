"""Big request heads beside a call: how late does a paced session get while other clients send
big request heads in a loop?

A server (echo model) runs in a process of its own (with an API key), from the source tree given with ``--tree``
(default: this checkout; give two to compare two versions side by side: their rounds alternate).
In this process one victim session on ``/v1/duplex`` sends one 80 ms frame of PCM every 80 ms
and times each echo; beside it, ``--attackers`` processes each open connection after connection
and send one big upgrade head without the key (``--heads many``: about 60 KiB of thousands of tiny header fields; ``one``:
one 60 KiB field; ``none``: no attackers), read the answer (431, or 401 once parsed) and close.  Each round prints the
victim's echo time (p50, p99, max, in ms) and how many heads the attackers sent.

Usage: python benchmarks/big_heads.py [--tree DIR ...] [--heads many|one|none] [--rounds 3]
                                      [--seconds 8] [--attackers 4]
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import trio
import trio_websocket

FRAME = 1920  # samples: 80 ms at 24 kHz
PERIOD = 0.08
HEADS = {
    "many": b"".join(b"a%d: b\r\n" % n for n in range(6200)),
    "one": b"x-big: " + b"a" * 60_000 + b"\r\n",
}

_SERVER = """
import sys
sys.path.insert(0, sys.argv[1])
import trio
from duplexrt.config import load_config
from duplexrt.server import serve
trio.run(serve, load_config(None, ["server.port=0", "runtime.slots=4", "backend.options.delay_frames=0",
                                   "metrics.log_stats=false", 'server.api_key="bench"']))
"""


def start_server(tree: Path) -> tuple[subprocess.Popen, int]:
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + _SERVER
    proc = subprocess.Popen([sys.executable, "-c", code, str(tree)], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    for line in proc.stderr:
        if "port(s) " in line:
            port = int(line.split("port(s) ")[1].split()[0])
            break
    else:
        raise SystemExit(f"the server from {tree} did not start")
    # Keep its log drained so that it never blocks on a full pipe.
    threading.Thread(target=lambda: [None for _ in proc.stderr], daemon=True).start()
    return proc, port


def attack(port: int, heads: str, seconds: float, counter) -> None:
    request = (b"GET /v1/duplex HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
               + HEADS[heads] + b"\r\n")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(request)
                while conn.recv(65536):
                    pass
        except OSError:  # refused mid-head, the rest unread: the server resets the connection
            pass
        with counter.get_lock():
            counter.value += 1


async def victim(port: int, seconds: float) -> list[float]:
    frame = (np.sin(np.arange(FRAME) / 7.0) * 0.3).astype(np.float32).tobytes()
    lags: list[float] = []
    async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/v1/duplex",
                                                 extra_headers=[(b"authorization", b"Bearer bench")]) as ws:
        await ws.get_message()  # session.created
        start = trio.current_time()
        for n in range(int(seconds / PERIOD)):
            await trio.sleep_until(start + n * PERIOD)
            sent = trio.current_time()
            await ws.send_message(frame)
            got = 0
            while got < len(frame):
                message = await ws.get_message()
                if isinstance(message, bytes):
                    got += len(message)
            lags.append((trio.current_time() - sent) * 1e3)
    return lags


def one_round(tree: Path, heads: str, seconds: float, attackers: int) -> tuple[list[float], int]:
    proc, port = start_server(tree)
    try:
        counter = multiprocessing.Value("i", 0)
        workers = [] if heads == "none" else [
            multiprocessing.Process(target=attack, args=(port, heads, seconds + 1.0, counter))
            for _ in range(attackers)]
        for worker in workers:
            worker.start()
        time.sleep(0.5)  # the attack under way before the call starts
        lags = trio.run(victim, port, seconds)
        for worker in workers:
            worker.join()
        return lags, counter.value
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path,
                        help="source tree to serve from (repeat to alternate two)")
    parser.add_argument("--heads", choices=["many", "one", "none"], default="many")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--attackers", type=int, default=4)
    args = parser.parse_args()
    trees = args.tree or [Path(__file__).resolve().parents[1]]
    results: dict[Path, list[float]] = {tree: [] for tree in trees}
    for round_ in range(args.rounds):
        for tree in trees:
            lags, answered = one_round(tree, args.heads, args.seconds, args.attackers)
            results[tree] += lags
            ordered = sorted(lags)
            print(f"round {round_ + 1} {tree}: victim echo ms p50 {statistics.median(lags):.1f} "
                  f"p99 {ordered[int(len(ordered) * 0.99)]:.1f} max {ordered[-1]:.1f} "
                  f"({len(lags)} frames); heads sent {answered}", flush=True)
    for tree, lags in results.items():
        ordered = sorted(lags)
        late = sum(lag > PERIOD * 1e3 for lag in lags)
        print(f"all rounds {tree}: p50 {statistics.median(lags):.1f} ms, p99 {ordered[int(len(ordered) * 0.99)]:.1f} "
              f"ms, max {ordered[-1]:.1f} ms, {late} of {len(lags)} frames later than one frame period")


if __name__ == "__main__":
    main()
