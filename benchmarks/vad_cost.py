"""The Realtime server VAD's host cost per 80 ms append, in process (no sockets, no scheduler).

Feeds ``InputVad`` (pcm16 at 24 kHz, 1,920-sample appends) two signals and times ``feed``, best of
seven: ``voiced``, harmonics over speech-band noise (WebRTC's VAD and the noise check both hear
speech: a speaker who keeps talking, where the noise check waits until a pause could end the
turn), and ``noise``, ``simulate``'s own speech-band noise (WebRTC's VAD hears speech, the noise
check does not: no turn ever starts, and the check runs on every append: what the server
benchmarks' sessions cost).  ``_flatness`` is timed alone on four windows.  With ``--against
DIR`` the same is run on another checkout's ``duplexrt/protocols/vad.py`` (e.g. main's),
alternated with this one's in one process, so that the two share the machine's load.

``--translator``: the whole Realtime translator instead, both directions of one frame as the
server route runs it (``duplex=1&continuous=1``, server VAD on): ``parse`` of an append as
``simulate`` writes it, then ``audio_out`` of an 80 ms delta, for 96 sessions taken in turn (so
each session's state is cold again by its next frame, as in the server), CPU time per frame, best
of three.  With ``--against DIR`` each round runs DIR's own package (its ``.venv``'s python, in a
subprocess) and then this checkout's.

Usage: python benchmarks/vad_cost.py [--against /work/main] [--rounds 3] [--translator]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import timeit
from pathlib import Path
from types import ModuleType

import numpy as np

from duplexrt.audio import AudioFormat, AudioSpec
from duplexrt.simulate.workload import _pool_signal

HERE = Path(__file__).resolve().parent.parent / "duplexrt" / "protocols" / "vad.py"


def load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def signal(seconds: int = 20) -> bytes:
    t = np.arange(24000 * seconds) / 24000
    voiced = sum(a * np.sin(2 * np.pi * f * t) for a, f in ((1.0, 150), (0.5, 450), (0.3, 900)))
    return (3000 * voiced + 3000 * _pool_signal(t.size, 24000, 1)).astype("<i2").tobytes()


def noise(seconds: int = 20) -> bytes:
    return (32767 * _pool_signal(24000 * seconds, 24000, 20261129)).astype("<i2").tobytes()


def feed_cost(vad: ModuleType, appends: list[bytes]) -> float:
    spec = AudioSpec.create(AudioFormat.PCM_S16LE, 24000, model_rate=24000)
    detector = vad.InputVad(vad.VadSettings(), spec)
    return min(timeit.repeat(lambda: [detector.feed(a) for a in appends], number=1, repeat=7)) / len(appends) * 1e6


def costs(vad: ModuleType, signals: dict[str, list[bytes]], windows: np.ndarray) -> str:
    feeds = ", ".join(f"{name} {feed_cost(vad, appends):.1f}" for name, appends in signals.items())
    flat = min(timeit.repeat(lambda: vad._flatness(windows), number=3000, repeat=7)) / 3000 * 1e6
    return f"feed us/append: {feeds}; flatness {flat:.1f} us"


def translator_cost(kind: str, sessions: int = 96, frames: int = 100) -> float:
    """CPU µs per frame of ``RealtimeProtocol``, an append in and a delta out."""
    import base64
    import json

    from duplexrt.protocols.realtime import RealtimeProtocol

    class Progress:
        frames_in = frames_out = frames_answered = 0

    raw = noise(10) if kind == "noise" else signal(10)
    chunks = [raw[i:i + 3840] for i in range(0, 3840 * frames, 3840)]
    appends = [json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(c).decode()})
               for c in chunks]
    protocols = []
    for _ in range(sessions):
        protocol = RealtimeProtocol(duplex=True, server_vad=True)
        protocol.attach(Progress())
        protocol.start()
        protocols.append(protocol)
    start = time.process_time()
    for append, chunk in zip(appends, chunks, strict=True):
        for protocol in protocols:
            protocol.parse(append)
            protocol.audio_out(chunk, 1)
    return (time.process_time() - start) / (sessions * frames) * 1e6


def translator_line() -> str:
    return ", ".join(f"{kind} {min(translator_cost(kind) for _ in range(3)):.1f}" for kind in ("noise", "voiced"))


def translator_rounds(against: Path | None, rounds: int) -> None:
    here = Path(__file__).resolve().parent.parent
    variants = [("this checkout", Path(sys.executable), here)]
    if against is not None:
        variants.insert(0, ("against", against / ".venv" / "bin" / "python", against))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}; translator CPU us per frame")
    for _ in range(rounds):
        figures = [subprocess.run([str(python), str(Path(__file__).resolve()), "--translator-once"], cwd=root,
                                  check=True, capture_output=True, text=True).stdout.strip()
                   for _, python, root in variants]
        print("   ".join(f"{name}: {figure}" for (name, _, _), figure in zip(variants, figures, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, default=None, help="another checkout's root")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--translator", action="store_true", help="the whole translator, both directions")
    parser.add_argument("--translator-once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.translator_once:
        print(translator_line())
        return
    if args.translator:
        translator_rounds(args.against, args.rounds)
        return
    signals = {name: [raw[i:i + 3840] for i in range(0, 3840 * 200, 3840)]
               for name, raw in (("voiced", signal()), ("noise", noise()))}
    windows = (np.random.default_rng(1).standard_normal((4, 160)) * 3000).astype(np.int16)
    variants = [("this checkout", load(HERE, "vad_here"))]
    if args.against is not None:
        variants.insert(0, ("against", load(args.against / "duplexrt" / "protocols" / "vad.py", "vad_against")))
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for _ in range(args.rounds):
        print("   ".join(f"{name}: {costs(m, signals, windows)}" for name, m in variants))


if __name__ == "__main__":
    main()
