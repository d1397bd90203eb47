"""Caller transcripts (issue 41) on this CPU, with the tiny models: what the transcriber's step
costs by batch size beside the tiny Moshi's, and what the hook costs the host.

1. step time by batch size: ``stt-tiny``'s step (Mimi encode + one ``LMGen`` step, greedy) and the
   tiny Moshi backend's whole step (encode, LM with depformer, decode), each over a batch of
   ``rows`` slots, every row active, median of ``--steps`` steady steps (the first few dropped);
   one torch thread.
2. host cost, burst sessions in process, the echo model both times: with ``stt-tiny``, against
   the same hook with a stand-in transcriber whose step sleeps (GIL released, no CPU, as a GPU
   wait) as long as the real step took and writes nothing, so both runs have the same step
   cadence.  Host CPU per frame = the process's CPU per frame less the scheduler thread's CPU
   inside the transcriber's steps (``Transcriber.cpu_seconds``: torch runs there, one thread), so
   what is left is the scheduler loop, the deliveries and the sessions (the transcriber's own
   Python around the model is counted as the step's); and the thread crossings per frame of
   each.  A third run is the first with the pieces delivered to the sessions but no message
   sent for them (``/v1/duplex``'s ``input_text``): what the messages cost apart from the hook
   (the tiny random model writes a piece nearly every frame; a trained one a few a second).
   ``--pairs`` rounds of the three.

Usage: python benchmarks/transcribe_tiny.py [--steps 30] [--pairs 3] [--sessions 8] [--frames 96] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("NO_TORCH_COMPILE", "1")

import numpy as np  # noqa: E402
import trio  # noqa: E402

from duplexrt.config import TranscriberConfig, load_config  # noqa: E402
from duplexrt.simulate.runner import SimulateOptions, run_simulation  # noqa: E402

FRAME = 1920
ROWS = (1, 2, 4, 8, 16)


def _signal(rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, FRAME)) * 0.1).astype(np.float32)


def _median_ms(step, steps: int, unsettled: int = 3) -> float:
    costs = []
    for _ in range(steps + unsettled):
        started = time.perf_counter()
        step()
        costs.append(time.perf_counter() - started)
    return statistics.median(costs[unsettled:]) * 1e3


def transcriber_step_ms(rows: int, steps: int) -> float:
    from duplexrt.transcribe.model import load_model
    from duplexrt.transcribe.transcriber import Transcriber

    transcriber = Transcriber(load_model(TranscriberConfig(enabled=True, tiny=True)), rows)
    transcriber.load()
    try:
        index = np.arange(rows, dtype=np.int64)
        for row in index:
            transcriber.open_slot(int(row))
        frames = _signal(rows, 1)
        return _median_ms(lambda: transcriber.step(index, frames), steps)
    finally:
        transcriber.close()


def moshi_step_ms(rows: int, steps: int) -> float:
    from duplexrt.backends import create_backend
    from duplexrt.backends.base import SlotSession
    from duplexrt.presets import resolve

    config = load_config(resolve("moshi-tiny"), [f"runtime.slots={rows}", "backend.options.warmup_steps=1"])
    backend = create_backend(config)
    backend.load()
    try:
        index = np.arange(rows, dtype=np.int64)
        for row in index:
            backend.open_slot(int(row), SlotSession(session_id=int(row) + 1))
        frames = _signal(rows, 2)
        out = np.empty_like(frames)
        return _median_ms(lambda: backend.step(index, frames, out), steps)
    finally:
        backend.close()


def _simulate(overrides: list[str], sessions: int, frames: int) -> dict:
    config = load_config(None, [f"runtime.slots={sessions}", "metrics.log_stats=false", 'backend.name="echo"',
                                "backend.options.delay_frames=0", "transcriber.enabled=true",
                                "transcriber.tiny=true", *overrides])
    # One round, no warm-up round: the transcriber's own totals then cover the round exactly.
    report = trio.run(run_simulation, config, SimulateOptions(concurrency=sessions, frames=frames))
    assert len(report.rounds) == 1
    return report.rounds[-1].as_dict()


class _SleepingTranscriber:
    """The hook with no model behind it: a step that sleeps as long as the real one took (the
    GIL released, no CPU, as a GPU wait) and writes nothing."""

    step_s = 0.0
    warmup_cost = 0.0

    def __init__(self, *args, **kwargs) -> None:
        self.model = None
        self.device = "cpu"
        self.last_stage = ("transcribe", 0)

    def load_weights(self) -> None:
        pass

    def state_bytes_per_slot(self) -> int:
        return 0

    def load(self, slots: int | None = None, *, warmup_steps: int = 0) -> None:
        pass

    def check_audio(self, sample_rate: int, frame_size: int) -> None:
        pass

    def open_slot(self, slot: int) -> None:
        pass

    def close_slot(self, slot: int) -> None:
        pass

    def end_input(self, slot: int) -> None:
        pass

    def close(self) -> None:
        pass

    def step(self, rows, inputs):
        time.sleep(self.step_s)
        return [()] * len(rows)


def host_cost(sessions: int, frames: int) -> dict:
    from duplexrt.protocols.raw import RawTranslator
    from duplexrt.transcribe import transcriber as module

    real = module.Transcriber
    made: list = []

    class Counted(real):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.pieces = 0
            made.append(self)

        def step(self, rows, inputs):
            out = super().step(rows, inputs)
            self.pieces += sum(1 for row in out for piece in row if piece.text)
            return out

    runs = {}
    module.Transcriber = Counted  # type: ignore[misc]
    sends = RawTranslator.input_text
    try:
        runs["transcriber_on"] = (_simulate([], sessions, frames), made[-1])
        # The same, the pieces delivered to the sessions but no message sent for them.
        RawTranslator.input_text = lambda self, pieces: []  # type: ignore[method-assign]
        runs["transcriber_on_no_messages"] = (_simulate([], sessions, frames), made[-1])
        RawTranslator.input_text = sends  # type: ignore[method-assign]
        _SleepingTranscriber.step_s = runs["transcriber_on"][0]["step_ms"]["mean"] / 1e3
        module.Transcriber = _SleepingTranscriber  # type: ignore[misc,assignment]
        runs["hook_sleeping_same_step"] = (_simulate([], sessions, frames), None)
    finally:
        module.Transcriber = real  # type: ignore[misc]
        RawTranslator.input_text = sends  # type: ignore[method-assign]
    result = {}
    for name, (run, transcriber) in runs.items():
        handoffs = run["handoffs"]
        model_us = 0.0
        pieces = 0
        if transcriber is not None:
            # The model's CPU inside its steps (torch runs on the scheduler thread, one thread).
            assert transcriber.steps == run["steps"], (transcriber.steps, run["steps"])
            model_us = transcriber.cpu_seconds * 1e6 / run["frames_in"]
            pieces = transcriber.pieces
        result[name] = {
            "cpu_us_per_frame": run["cpu_us_per_frame"],
            "model_us_per_frame": model_us,
            "host_us_per_frame": run["cpu_us_per_frame"] - model_us,
            "pieces_per_frame": pieces / run["frames_in"],
            "crossings_per_frame": sum(handoffs.values()) / run["frames_in"],
            "output_deliveries": handoffs["output_delivery"],
            "offloads": sum(v for k, v in handoffs.items() if k.endswith("offload")),
            "steps": run["steps"],
            "frames": run["frames_in"],
            "step_ms_mean": run["step_ms"]["mean"],
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--frames", type=int, default=96)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results: dict = {"machine": f"{platform.machine()} {platform.processor() or ''} Python {platform.python_version()} "
                                f"torch {torch.__version__}, 1 torch thread"}
    print("1. step time by batch size (ms, median), every row active", file=sys.stderr)
    steps = {}
    for rows in ROWS:
        stt = transcriber_step_ms(rows, args.steps)
        moshi = moshi_step_ms(rows, args.steps)
        steps[rows] = {"stt_tiny_ms": stt, "moshi_tiny_ms": moshi}
        print(f"   rows {rows:3d}: stt-tiny {stt:7.2f}   moshi-tiny {moshi:7.2f}", file=sys.stderr)
    results["steps"] = steps
    print(f"2. host cost, {args.sessions} sessions x {args.frames} frames, burst, {args.pairs} pairs", file=sys.stderr)
    pairs = []
    for i in range(args.pairs):
        pair = host_cost(args.sessions, args.frames)
        pairs.append(pair)
        for name, run in pair.items():
            print(f"   pair {i + 1} {name:27s}: host {run['host_us_per_frame']:6.1f} us/frame (cpu "
                  f"{run['cpu_us_per_frame']:.1f} - step {run['model_us_per_frame']:.1f}), pieces/frame "
                  f"{run['pieces_per_frame']:.2f}, crossings/frame {run['crossings_per_frame']:.3f}, offloads "
                  f"{run['offloads']}, step {run['step_ms_mean']:.2f} ms", file=sys.stderr)
    results["host"] = pairs
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as handle:
            handle.write(text)
    print(text)


if __name__ == "__main__":
    main()
