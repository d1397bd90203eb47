"""Step time per stage of the ``moshi`` backend on the tiny random Moshi, against batch size.

Two tables, each over batch sizes 1, 2, 4, ... 64 (``--sizes``):

1. ``slots = B``, every row active: what one step of a batch of B sessions costs;
2. ``slots = 64`` (``--fixed-slots``), B rows active and the rest masked out: what the backend pays
   in a process sized for 64 sessions when B of them have a frame (the package's execution mask
   keeps the masked rows' state, not their compute).

Each cell is the mean over ``--steps`` steps after the backend's own warm-up, per stage (encode:
scatter + Mimi encoder; lm: LMGen step; decode: Mimi decoder + gather + text), from the backend's
``last_stages``.  The 80 ms column says whether a step fits one frame period (real time).

3. with ``--exactness``: does a session hear the same, bit for bit, in a batch of B rows as in
   row 0 of the fixed batch (what a step sized to the active rows would change: the kernels may
   round a row differently by batch size), and in other rows of the fixed batch (what moving a
   session between rows would change)?  ``--frames`` frames of one sampled session, alone.

4. with ``--kv-heavy``: the K/V-heavy configuration (``KV_HEAVY``: the tiny model's shape with a
   wider LM of few layers and a 60 s ring, where the attention's ring read dominates the step):
   8 calls (``--kv-calls``) about 10 s old (``--kv-age``) in a batch of 8, each step timed with
   the filled-only attention (``attention``) and with the package's full-ring read in turn (A B A
   B ..., same backend, same calls), the median of each and their ratio.  Every other table is
   skipped.

5. with ``--modes``: the step by active calls and call age on one server of ``--mode-slots`` slots
   (32), in each way a step can be run, alternated step by step on the same calls (A B C D E A
   B ...): the fixed batch with the package's full-ring attention (before either lever), the
   fixed batch with filled-only attention, buckets with the full-ring read, buckets with
   filled-only attention (the default), and a fixed batch of exactly as many slots as calls
   (what a server sized to the load would pay: the bar the buckets are held to).  Each cell is
   the median per mode and its ratio to the first, pair by pair.  ``--mode-shape kv-heavy``
   runs it on table 4's LM (a 60 s ring), where the call's age matters.  Every other table is
   skipped.

Usage: python benchmarks/moshi_tiny.py [--steps 20] [--sizes 1,2,4,8,16,32,64]
       [--fixed-slots 64] [--greedy] [--device cpu] [--threads N] [--json out.json]
       [--random moshi-7b --dtype bfloat16]   (the full-size architecture, random weights: a GPU)
       [--rings model,1.28 --rounds 3]        (each row's K/V ring, backend.options.context_seconds)
       [--exactness --frames 16]              (table 3)
       [--kv-heavy --steps 40 --kv-calls 8 --kv-age 10]   (table 4 only)
       [--modes --mode-slots 32 --mode-calls 1,2,8,32 --mode-ages 1,4 --mode-shape tiny|kv-heavy]  (table 5 only)
       [--batch buckets|fixed]                (tables 1-3: backend.options.batch)

``--rings`` gives K/V ring lengths in seconds (``model``: the model's own context); with more than
one, each cell is measured for every ring in turn, ``--rounds`` times (A B A B ...: a drift of the
machine's speed hits both alike), and each ring's median is reported with its ratio to the first.

A batch size that does not fit the device's memory (the 7B model's KV caches grow with the
slots) is reported as such and the table goes on.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

from duplexrt.backends.base import BackendInfo, SlotSession
from duplexrt.backends.moshi import STAGES, MoshiBackend, attention, tiny

FRAME = 1920
FRAME_MS = 80.0


def measure(slots: int, active: int, steps: int, options: dict) -> dict:
    model = {} if options.get("random") else {"tiny": True}
    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots), {**model, **options})
    started = time.perf_counter()
    backend.load()
    load_s = time.perf_counter() - started
    rows = np.arange(active, dtype=np.int64)
    for slot in rows:
        backend.open_slot(int(slot), SlotSession(int(slot) + 1))
    rng = np.random.default_rng(0)
    inputs = (rng.standard_normal((active, FRAME)) * 0.3).astype(np.float32)
    outputs = np.empty_like(inputs)
    backend.step(rows, inputs, outputs)  # the joining rows' reset lands in this one
    per_stage: dict[str, list[float]] = {name: [] for name in STAGES}
    totals = []
    for _ in range(steps):
        began = time.perf_counter_ns()
        backend.step(rows, inputs, outputs)
        totals.append((time.perf_counter_ns() - began) / 1e6)
        for name, ns in backend.last_stages:
            per_stage[name].append(ns / 1e6)
    positions = backend.ring.positions
    backend.close()
    result = {"slots": slots, "active": active, "ring": positions, "steps": steps, "load_s": round(load_s, 3)}
    for name, values in per_stage.items():
        result[f"{name}_ms"] = round(statistics.fmean(values), 3)
    result["step_ms"] = round(statistics.fmean(totals), 3)
    result["step_p50_ms"] = round(statistics.median(totals), 3)
    result["step_max_ms"] = round(max(totals), 3)
    result["per_session_ms"] = round(result["step_ms"] / active, 3)
    result["real_time"] = result["step_ms"] <= FRAME_MS
    return result


#: Table 4's LM: 8 layers (Moshi 7B has 32), wide, a 60 s ring (750 positions of 80 ms), over the tiny model's shape.
KV_HEAVY = {"dim": 512, "num_heads": 8, "num_layers": 8, "context": 750}


def _loaded(slots: int, options: dict, shape: dict | None) -> MoshiBackend:
    """The tiny model loaded on ``slots`` rows, its LM of ``shape`` (``TINY_LM`` keys) if given."""
    saved = {key: tiny.TINY_LM[key] for key in shape} if shape else {}
    if shape:
        tiny.TINY_LM.update(shape)  # the backend builds its tiny LM from TINY_LM (``tiny.lm_config``)
    try:
        backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots), {"tiny": True, **options})
        backend.load()
    finally:
        tiny.TINY_LM.update(saved)
    return backend


def kv_heavy(calls: int, age_s: float, steps: int, options: dict) -> dict:
    """Table 4: ``calls`` calls of ``age_s`` seconds (at the middle of the timed steps) on the
    K/V-heavy LM; ``steps`` steps with each attention, alternated step by step."""
    backend = _loaded(calls, options, KV_HEAVY)
    lm = backend._model.lm  # the benchmark switches the attention of the very model it steps
    rows = np.arange(calls, dtype=np.int64)
    for slot in rows:
        backend.open_slot(int(slot), SlotSession(int(slot) + 1))
    rng = np.random.default_rng(0)
    inputs = (rng.standard_normal((calls, FRAME)) * 0.3).astype(np.float32)
    outputs = np.empty_like(inputs)
    before = max(1, round(age_s * 12.5) - steps)  # the timed steps straddle age_s
    for _ in range(before):
        backend.step(rows, inputs, outputs)
    times: dict[str, list[float]] = {"filled": [], "ring": []}
    lm_times: dict[str, list[float]] = {"filled": [], "ring": []}
    for k in range(2 * steps):
        mode = "filled" if k % 2 == 0 else "ring"
        if mode == "filled":
            attention.install(lm)
        else:
            attention.uninstall(lm)
        began = time.perf_counter_ns()
        backend.step(rows, inputs, outputs)
        times[mode].append((time.perf_counter_ns() - began) / 1e6)
        lm_times[mode].append(dict(backend.last_stages)["lm"] / 1e6)
    backend.close()
    result = {"config": KV_HEAVY, "calls": calls, "ring": KV_HEAVY["context"],
              "positions_timed": [before + 1, before + 2 * steps]}
    for mode in times:
        result[f"{mode}_step_ms"] = round(statistics.median(times[mode]), 3)
        result[f"{mode}_lm_ms"] = round(statistics.median(lm_times[mode]), 3)
    result["ratio"] = round(statistics.median(a / b for a, b in zip(times["filled"], times["ring"])), 4)
    return result


#: Table 5's ways of running a step: (name, backend.options.batch, filled-only attention).
MODES = (("fixed/ring", "fixed", False), ("fixed/filled", "fixed", True), ("buckets/ring", "buckets", False),
         ("buckets/filled", "buckets", True), ("sized to calls", "fixed", True))


def modes(slots: int, calls: list[int], ages: list[float], steps: int, options: dict, shape: dict | None) -> list[dict]:
    """Table 5: for each number of calls and call age, every way of running a step (``MODES``)
    on the same calls' frames, alternated step by step; one backend per batch mode, the
    attention switched on the very model stepped."""
    servers = {batch: _loaded(slots, {**options, "batch": batch}, shape) for batch in ("fixed", "buckets")}
    rng = np.random.default_rng(0)
    results = []
    try:
        for count in calls:
            sized = _loaded(count, {**options, "batch": "fixed"}, shape)
            backends = [servers[batch] if name != "sized to calls" else sized for name, batch, _ in MODES]
            for age in ages:
                rows = np.arange(count, dtype=np.int64)
                for backend in {id(b): b for b in backends}.values():
                    for slot in rows:
                        backend.open_slot(int(slot), SlotSession(int(slot) + 1))
                inputs = (rng.standard_normal((count, FRAME)) * 0.3).astype(np.float32)
                outputs = np.empty_like(inputs)
                before = max(1, round(age * 12.5) - steps)  # the timed steps straddle the age
                for backend in {id(b): b for b in backends}.values():
                    for _ in range(before):
                        backend.step(rows, inputs, outputs)
                times: dict[str, list[float]] = {name: [] for name, _, _ in MODES}
                for _ in range(steps):
                    for (name, _, filled), backend in zip(MODES, backends):
                        lm = backend._model.lm
                        if filled:
                            attention.install(lm)
                        else:
                            attention.uninstall(lm)
                        began = time.perf_counter_ns()
                        backend.step(rows, inputs, outputs)
                        times[name].append((time.perf_counter_ns() - began) / 1e6)
                for backend in {id(b): b for b in backends}.values():
                    for slot in rows:
                        backend.close_slot(int(slot))
                first = MODES[0][0]
                cell = {"slots": slots, "calls": count, "age_s": age, "ring": servers["fixed"].ring.positions,
                        "bucket": servers["buckets"]._chooser.covering(count)}
                for name in times:
                    cell[f"{name}_ms"] = round(statistics.median(times[name]), 3)
                    cell[f"{name}_ratio"] = round(statistics.median(a / b for a, b in zip(times[name], times[first])), 4)
                cell["buckets_vs_sized"] = round(statistics.median(
                    a / b for a, b in zip(times["buckets/filled"], times["sized to calls"])), 4)
                results.append(cell)
                print(f"  calls={count} age={age:g}s: " + ", ".join(f"{n} {cell[n + '_ms']:.1f}" for n in times),
                      file=sys.stderr)
            sized.close()
    finally:
        for backend in servers.values():
            backend.close()
    return results


def modes_table(results: list[dict]) -> str:
    names = [name for name, _, _ in MODES]
    r0 = results[0]
    head = f"{'calls':>5} {'age s':>5} {'bucket':>6} " + " ".join(f"{n:>15}" for n in names) + f" {'buckets/sized':>13}"
    lines = [f"5. the step (ms, median; ratio to fixed/ring pair by pair) on {r0['slots']} slots, a "
             f"{r0['ring']}-position ring, by calls and their age", head, "-" * len(head)]
    for r in results:
        cells = " ".join(f"{r[n + '_ms']:>7.2f} ({r[n + '_ratio']:.2f})" for n in names)
        lines.append(f"{r['calls']:>5} {r['age_s']:>5g} {r['bucket']:>6} {cells} {r['buckets_vs_sized']:>13.3f}")
    return "\n".join(lines)


def kv_heavy_table(r: dict) -> str:
    lines = [f"4. K/V-heavy LM {r['config']}: {r['calls']} calls, positions {r['positions_timed'][0]}-"
             f"{r['positions_timed'][1]} of a {r['ring']}-position ring (step-by-step alternation, medians)",
             f"{'attention':>10} {'step ms':>9} {'lm ms':>9}"]
    for mode in ("filled", "ring"):
        lines.append(f"{mode:>10} {r[mode + '_step_ms']:>9.2f} {r[mode + '_lm_ms']:>9.2f}")
    lines.append(f"filled / ring, per step pair (median): {r['ratio']:.3f}")
    return "\n".join(lines)


def hear(backend: MoshiBackend, row: int, frames: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """One session alone in ``row``, frame by frame: its audio and text."""
    backend.open_slot(row, SlotSession(1))
    rows = np.array([row], dtype=np.int64)
    audio, texts = [], []
    for frame in frames:
        out = np.empty((1, FRAME), dtype=np.float32)
        texts += backend.step(rows, frame[None], out)
        audio.append(out[0])
    backend.close_slot(row)
    return np.stack(audio), texts


def compare(got: tuple[np.ndarray, list[str]], want: tuple[np.ndarray, list[str]]) -> dict:
    audio, texts = got
    differs = np.flatnonzero([not np.array_equal(a, b) for a, b in zip(audio, want[0])])
    return {"identical": not len(differs) and texts == want[1],
            "max_abs_diff": float(np.abs(audio - want[0]).max()),
            "first_frame_differing": int(differs[0]) if len(differs) else None,
            "text_identical": texts == want[1]}


def exactness(sizes: list[int], fixed: int, frames: int, options: dict) -> list[dict]:
    """Table 3: one session in batches of each size, and in several rows of the fixed batch,
    against row 0 of the fixed batch."""
    signal = (np.random.default_rng(1).standard_normal((frames, FRAME)) * 0.3).astype(np.float32)

    def loaded(slots: int) -> MoshiBackend:
        backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, slots), {"tiny": True, **options})
        backend.load()
        return backend

    reference = loaded(fixed)
    want = hear(reference, 0, signal)
    results = []
    for row in sorted({1, fixed // 2, fixed - 1} - {0}):
        results.append({"batch": fixed, "row": row, **compare(hear(reference, row, signal), want)})
    reference.close()
    for size in sizes:
        if size == fixed or size > fixed:
            continue
        backend = loaded(size)
        results.append({"batch": size, "row": 0, **compare(hear(backend, 0, signal), want)})
        backend.close()
    return results


def exactness_table(fixed: int, results: list[dict]) -> str:
    head = f"{'B':>4} {'row':>4} {'identical':>9} {'max |diff|':>11} {'from frame':>10} {'text':>5}"
    lines = [f"3. one session, alone: in row R of a batch of B against row 0 of the fixed batch of {fixed}",
             head, "-" * len(head)]
    for r in results:
        first = "" if r["first_frame_differing"] is None else str(r["first_frame_differing"])
        lines.append(f"{r['batch']:>4} {r['row']:>4} {'yes' if r['identical'] else 'no':>9} "
                     f"{r['max_abs_diff']:>11.3g} {first:>10} {'same' if r['text_identical'] else 'diff':>5}")
    return "\n".join(lines)


def table(title: str, results: list[dict]) -> str:
    head = f"{'B':>4} {'slots':>5} {'ring':>5} " + " ".join(f"{name + ' ms':>10}" for name in STAGES)
    head += f" {'step ms':>9} {'p50':>8} {'max':>8} {'ms/session':>10} {'<=80ms':>6} {'vs 1st ring':>11}"
    lines = [title, head, "-" * len(head)]
    for r in results:
        line = (f"{r['active']:>4} {r['slots']:>5} {r['ring']:>5} "
                + " ".join(f"{r[name + '_ms']:>10.2f}" for name in STAGES))
        ratio = f"{r['ratio_to_first_ring']:.3f}" if "ratio_to_first_ring" in r else ""
        line += (f" {r['step_ms']:>9.2f} {r['step_p50_ms']:>8.2f} {r['step_max_ms']:>8.2f}"
                 f" {r['per_session_ms']:>10.2f} {'yes' if r['real_time'] else 'no':>6} {ratio:>11}")
        lines.append(line)
    return "\n".join(lines)


def alternated(rings: list[float | None], rounds: int, measure_one) -> list[dict]:
    """Every ring measured in turn, ``rounds`` times; per ring the round with the median step, and
    with more than one ring its ratio to the first ring's, round by round (the median of those)."""
    runs: dict[float | None, list[dict]] = {ring: [] for ring in rings}
    for _ in range(rounds):
        for ring in rings:
            result = measure_one(ring)
            if result is None:
                return []
            runs[ring].append(result)
    chosen = []
    for ring in rings:
        ordered = sorted(runs[ring], key=lambda r: r["step_ms"])
        result = dict(ordered[len(ordered) // 2])
        if len(rings) > 1:
            ratios = sorted(a["step_ms"] / b["step_ms"] for a, b in zip(runs[ring], runs[rings[0]]))
            result["ratio_to_first_ring"] = round(ratios[len(ratios) // 2], 4)
        chosen.append(result)
    return chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--sizes", default="1,2,4,8,16,32,64")
    parser.add_argument("--fixed-slots", type=int, default=64, help="0 skips the second table")
    parser.add_argument("--greedy", action="store_true", help="argmax instead of per-session sampling")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument("--random", default="", help="a full-size architecture with random weights "
                                                     "(moshi-7b) instead of the tiny model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rings", default="model", help="K/V ring lengths in seconds, comma separated "
                                                          "(model: the model's own context)")
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds per cell (with several rings)")
    parser.add_argument("--exactness", action="store_true", help="table 3: bit-exactness by batch size and row")
    parser.add_argument("--frames", type=int, default=16, help="frames of the session table 3 compares")
    parser.add_argument("--kv-heavy", action="store_true", help="table 4 only: filled-only vs full-ring attention")
    parser.add_argument("--kv-calls", type=int, default=8)
    parser.add_argument("--kv-age", type=float, default=10.0, help="seconds each call has been going")
    parser.add_argument("--modes", action="store_true", help="table 5 only: the step in every way it can be run")
    parser.add_argument("--mode-slots", type=int, default=32)
    parser.add_argument("--mode-calls", default="1,2,8,32")
    parser.add_argument("--mode-ages", default="1,4", help="seconds each call has been going, comma separated")
    parser.add_argument("--mode-shape", choices=("tiny", "kv-heavy"), default="tiny")
    parser.add_argument("--batch", choices=("buckets", "fixed"), default="buckets",
                        help="backend.options.batch for tables 1-3")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    rings = [None if s == "model" else float(s) for s in args.rings.split(",") if s]
    # torch.compile as served: the backend turns it off on a CPU (NO_TORCH_COMPILE=1 before moshi is
    # imported), never on a GPU.  Four warm-up steps: on a GPU the second captures the CUDA graphs.
    options = {"device": args.device, "greedy": args.greedy, "warmup_steps": 4, "dtype": args.dtype,
               "batch": args.batch}
    if args.random:
        options["random"] = args.random

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    machine = {
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(), "torch": torch.__version__,
        "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "device": args.device,
        "greedy": args.greedy, "steps": args.steps, "rings_s": args.rings, "rounds": args.rounds,
    }
    print(f"{args.random or 'tiny'} random Moshi, {machine}", file=sys.stderr)

    if args.modes:
        shape = KV_HEAVY if args.mode_shape == "kv-heavy" else None
        found = modes(args.mode_slots, [int(c) for c in args.mode_calls.split(",") if c],
                      [float(a) for a in args.mode_ages.split(",") if a], args.steps, options, shape)
        print(modes_table(found))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"machine": machine, "modes": found, "shape": args.mode_shape}, handle, indent=1)
        return

    if args.kv_heavy:
        result = kv_heavy(args.kv_calls, args.kv_age, args.steps, options)
        print(kv_heavy_table(result))
        if args.json:
            with open(args.json, "w") as handle:
                json.dump({"machine": machine, "kv_heavy": result}, handle, indent=1)
        return

    def fitting(slots: int, active: int, ring: float | None) -> dict | None:
        try:
            result = measure(slots, active, args.steps, {**options, "context_seconds": ring})
        except torch.OutOfMemoryError:
            print(f"  slots={slots} active={active}: does not fit the device's memory", file=sys.stderr)
            return None
        finally:
            if args.device.startswith("cuda"):
                gc.collect()
                torch.cuda.empty_cache()
        print(f"  slots={slots} active={active} ring={result['ring']}: {result['step_ms']:.1f} ms/step",
              file=sys.stderr)
        return result

    def cell(slots: int, active: int) -> list[dict]:
        return alternated(rings, max(1, args.rounds), lambda ring: fitting(slots, active, ring))

    scaled = [r for size in sizes for r in cell(size, size)]
    fixed = []
    if args.fixed_slots:
        fixed = [r for size in sizes if size <= args.fixed_slots for r in cell(args.fixed_slots, size)]
    print(table("1. a batch of B sessions (slots = B, all active)", scaled))
    if fixed:
        print()
        print(table(f"2. B active rows of a fixed batch of {args.fixed_slots} slots (the rest masked)", fixed))
    exact = []
    if args.exactness:
        exact = exactness(sizes, args.fixed_slots or max(sizes), args.frames,
                          {**options, "context_seconds": rings[0]})
        print()
        print(exactness_table(args.fixed_slots or max(sizes), exact))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"machine": machine, "scaled": scaled, "fixed": fixed, "exactness": exact}, handle, indent=1)


if __name__ == "__main__":
    main()
