"""Joining PersonaPlex calls without stalling the others (issue 36's targets), on ``personaplex-tiny``.

Each round starts a fresh ``duplexrt serve`` (8 slots more than the callers need), runs 8 paced
callers for ``--seconds`` with ``duplexrt simulate --url`` (the *talkers*: the real-time criterion
of docs/capacity.md, their lag percentiles), and, in the joining rounds, opens 8 more calls over
``/v1/duplex`` within one second, ``--join-at`` seconds in, each with its own role prompt of about
``--prompt-tokens`` tokens (uncached: no two alike) or all with one (cached after the first), and
records each joiner's time to first audio (its first frame sent to its first audio heard).

Rounds, all in one run so that they share the machine's load:

* ``alone``: the talkers alone (their lag without joins: the baseline);
* ``uncached``: 8 joins with 8 new personas, ``prefill = "batch"`` (the default);
* ``frames``: the same with ``prefill = "frames"`` (the reference's frame-by-frame prompt);
* ``cached``: 8 joins with one persona the server has already prompted;
* ``plain``: 8 joins on ``moshi-tiny`` (no persona): the time a Moshi join takes.

Targets (printed as a verdict per line): the talkers keep the real-time criterion and their lag
p99 grows by at most one step (``uncached`` against ``alone``); a cached persona's time to first
audio is within 2 steps of a plain join's; an uncached 200-token persona's is at most 10 steps.

Usage: python benchmarks/personaplex_join.py [--seconds 30] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlencode

import numpy as np
import trio

BIN = Path(sys.executable).parent / "duplexrt"
TALKERS = 8
JOINERS = 8
WORDS = ("ka lo mi ne ru sa to vi en or ba di fu ge ha ji ku la mo nu pe ro su ta ve wa xo yo ze an il ber cal").split()


def persona_text(index: int, tokens: int) -> str:
    """A role prompt of about ``tokens`` tokens of the tiny tokenizer, different for each index."""
    rng = np.random.default_rng(1000 + index)
    return "You are " + " ".join(rng.choice(WORDS, size=max(1, tokens // 2 - 4)))


class Server:
    def __init__(self, config: str, *options: str) -> None:
        command = [str(BIN), "serve", "--config", config, "--port", "0", "--slots", str(TALKERS + JOINERS),
                   "--no-log-stats", *[item for option in options for item in ("-o", option)]]
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1", "NO_TORCH_COMPILE": "1", "OMP_NUM_THREADS": "1"})
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            if "port(s)" in line:
                self.port = int(line.split("port(s) ")[1].split()[0])
                break
        else:
            raise RuntimeError(f"the server did not start: {self.proc.wait()}")

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/duplex"

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


async def join(url: str, query: dict[str, str], seconds: float) -> float:
    """One call for ``seconds`` of paced audio: its time to first audio, in milliseconds."""
    from duplexrt.client.connection import open_connection
    from duplexrt.client.conversation import Conversation
    from duplexrt.client.protocols import client_for_url

    first_audio: list[float] = []
    protocol = client_for_url(url, input_format="pcm_f32le", input_rate=24000)
    full = protocol.url(f"{url}?{urlencode(query)}" if query else url)
    frame = np.zeros(1920, dtype=np.float32)
    frame[::7] = 0.05
    async with open_connection(full, protocol, timeout=30) as (transport, _greeting):
        conversation = Conversation(transport, protocol, on_audio=lambda _buf, at: first_audio.append(at),
                                    idle_timeout=10)
        frames = int(seconds / 0.08)
        await conversation.run(frames, lambda _i: frame.tobytes(), interval=0.08)
    if not first_audio or conversation.first_send is None:
        raise RuntimeError(f"no audio came back: {conversation.describe()}")
    return (first_audio[0] - conversation.first_send) * 1e3


async def joins(url: str, queries: list[dict[str, str]], start_after: float, seconds: float) -> list[float]:
    times: list[float] = [0.0] * len(queries)
    await trio.sleep(start_after)
    async with trio.open_nursery() as nursery:
        for i, query in enumerate(queries):
            async def one(i: int = i, query: dict[str, str] = query) -> None:
                await trio.sleep(i / len(queries))  # all within one second
                times[i] = await join(url, query, seconds)
            nursery.start_soon(one)
    return times


def talkers(url: str, seconds: float, report: Path) -> subprocess.Popen[str]:
    return subprocess.Popen([str(BIN), "simulate", "--url", url, "--concurrency", str(TALKERS), "--mode", "paced",
                             "--frames", str(int(seconds / 0.08)), "--json", str(report), "--no-progress",
                             "--require-real-time"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def run_round(name: str, config: str, options: list[str], queries: list[dict[str, str]] | None,
              args: argparse.Namespace, folder: Path) -> dict:
    server = Server(config, *options)
    try:
        if queries is not None and name == "cached":
            trio.run(join, server.url, queries[0], 1.0)  # the persona prompted once before
        report = folder / f"{name}.json"
        load = talkers(server.url, args.seconds, report)
        ttfa = trio.run(joins, server.url, queries, args.join_at, args.seconds - args.join_at - 2) if queries else []
        output, _ = load.communicate()
        data = json.loads(report.read_text())
    finally:
        server.close()
    measured = data["rounds"][-1]
    lag = measured.get("frame_lag_ms") or {}
    verdict = [line for line in output.splitlines() if "real time (docs/capacity.md)" in line]
    result = {"round": name, "talkers_p50_ms": lag.get("p50"), "talkers_p99_ms": lag.get("p99"),
              "talkers_max_ms": lag.get("max"), "real_time": load.returncode == 0 and bool(data.get("ok")),
              "verdict": verdict[-1].strip() if verdict else None, "step_ms": measured.get("server_step_ms_mean"),
              "ttfa_ms": [round(t, 1) for t in ttfa],
              "ttfa_median_ms": round(statistics.median(ttfa), 1) if ttfa else None,
              "ttfa_max_ms": round(max(ttfa), 1) if ttfa else None}
    if load.returncode not in (0, 1):
        result["simulate_output"] = output[-2000:]
    print(json.dumps(result), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=32.0, help="paced audio per talker")
    parser.add_argument("--join-at", type=float, default=6.0, help="when the joiners start, in seconds")
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    uncached = [{"instructions": persona_text(i, args.prompt_tokens), "voice": f"NATF{i % 4}"} for i in range(JOINERS)]
    fresh = [{"instructions": persona_text(100 + i, args.prompt_tokens), "voice": f"VARM{i % 5}"}
             for i in range(JOINERS)]
    cached = [{"instructions": persona_text(500, args.prompt_tokens), "voice": "NATM0"}] * JOINERS
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        results = [
            run_round("alone", "personaplex-tiny", [], None, args, folder),
            run_round("uncached", "personaplex-tiny", [], uncached, args, folder),
            run_round("frames", "personaplex-tiny", ["prefill=\"frames\""], fresh, args, folder),
            run_round("cached", "personaplex-tiny", [], cached, args, folder),
            run_round("plain", "moshi-tiny", [], [{}] * JOINERS, args, folder),
        ]
    by = {r["round"]: r for r in results}
    step = by["uncached"]["step_ms"] or 0.0
    verdicts = {
        "talkers keep real time while 8 uncached personas join": by["uncached"]["real_time"],
        "talkers' lag p99 grows by at most one step": (by["uncached"]["talkers_p99_ms"] - by["alone"]["talkers_p99_ms"]) <= step,
        "cached persona's first audio within 2 steps of a plain join":
            by["cached"]["ttfa_median_ms"] - by["plain"]["ttfa_median_ms"] <= 2 * step,
        "uncached persona's first audio within 10 steps": by["uncached"]["ttfa_max_ms"] <= 10 * step,
    }
    for what, ok in verdicts.items():
        print(f"{'MET ' if ok else 'MISSED'}  {what}")
    if args.json:
        args.json.write_text(json.dumps({"rounds": results, "verdicts": verdicts, "step_ms": step,
                                         "seconds": time.time() - started}, indent=1))


if __name__ == "__main__":
    main()
