"""The GPU table in one call: step time by batch, the wait's CPU, fixed and bucketed batches, and one paced
serving round over real WebSockets, for the Moshi 7B architecture with seeded random weights
(``moshi-7b-random``: nothing to download), built once and reused by every phase.

Runs from the repository root with nothing installed but the device machine's own Python, torch
and common packages, plus a folder of wheels for the rest (``benchmarks/gpu.sh --wheels DIR``
installs it with ``pip install --no-index --no-deps --target`` and sets ``PYTHONPATH``; see
docs/capacity.md, "Sizing a GPU").  Without CUDA it runs the same phases on the tiny model with
small sizes, so that CI keeps it working (``tests/test_gpu_script.py``); those are no GPU figures.

    python3 benchmarks/gpu.py --out DIR [--budget-s 420]

Phases, each under its own time limit, the JSON (``DIR/gpu.json``) rewritten after each:

1. ``device``: what ran (torch, CUDA, the GPU, its memory, whether torch.compile and graphs are on,
   and whether a C compiler is there for torch.compile).
2. ``build``: the model built once; its weights and per-slot state (the arithmetic of
   ``backends/moshi/memory.py``) and how many slots fit the free memory; ``model_s`` (building the
   weights) and ``warmup_s`` (allocation, torch.compile's cold compile, graph capture) apart.  It
   gets up to 5 minutes on a GPU: a cold compile is slow, and without the model nothing else runs.
3. ``steps``: for each batch size (1, 8, 16, 32, 48, 64, 80; sizes that cannot fit are skipped),
   the backend sized to it (CUDA graphs captured, torch.compile as served) and a full batch
   stepped: step time p50/p99, per stage, this thread's CPU per step (the wait is the backend's
   blocking one), and the GPU memory allocated.  Then one seeded session alone, in row 0 and in
   the last row, for a few frames: ``exact`` says whether its audio is bit for bit the largest
   batch's row 0 (what a step over only the rows in use would change) and the same in both rows
   (what moving a session between rows would change).
4. ``variants``: at 8 rows and at the largest batch within the budget, the step with CUDA graphs and
   torch.compile each on and off (four runs a size, the rows' state allocated again for each):
   ``columns`` gives each combination's p50 step by size, the first thing a GPU reader asks.
5. ``wait``: the CPU one thread spends waiting for 50 ms of GPU work, with a spinning event
   (CUDA's default) and with a blocking one (what the backend uses).
6. ``ring``: each row's K/V ring (``backend.options.context_seconds``) at 750 positions (a call
   cap of 60 s) against the model's own 3000 (240 s), at 32 and 64 rows, alternated: the step, its
   stages, the state per slot and how many slots fit the memory at each ring, and the ratio of
   the short ring's step to the full one's at the same rows.
7. ``batch``: the largest batch measured, with 1, 2, an eighth and all of its rows active, run as
   the fixed batch (``backend.options.batch = "fixed"``, every row every step) and in buckets
   (the default: the smallest bucket covering the calls); then ``probe``: one seeded call of
   ``NEIGHBOUR_FRAMES`` frames alone and again while neighbours join (1 -> 2 -> 8 rows) and leave
   around it, in buckets: how many of its frames' text and audio differ (rounding by batch size,
   which at a near-tie samples another token).  The phases before it run the fixed batch, so
   that ``steps``' ``exact`` still asks what a batch size changes.
8. ``serve``: ``duplexrt serve`` on that model at the largest batch whose step leaves the capacity
   margin (5 % of the 80 ms frame), its host threads pinned to one CPU, and paced callers over
   real WebSockets from another process kept off that CPU (``benchmarks/bare_cli.py simulate
   --url``): frames late, lag p50/p99, host CPU per frame.

Every phase writes ``{"running": true}`` when it starts and its result when it ends, so a run cut
short says where it was.  The output folder gets ``gpu.json`` and nothing else: the clients'
report goes to a temporary folder.
"""

from __future__ import annotations

import argparse
import faulthandler
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Every module the phases import, checked before anything runs: (module, what provides it).
REQUIRED = (
    ("numpy", "numpy"), ("torch", "torch"), ("attrs", "attrs"), ("typer", "typer"), ("h11", "h11"),
    ("prometheus_client", "prometheus-client"), ("einops", "einops"), ("safetensors", "safetensors"),
    ("sentencepiece", "sentencepiece"), ("huggingface_hub", "huggingface-hub"), ("trio", "trio"),
    ("trio_websocket", "trio-websocket"), ("wsproto", "wsproto"), ("outcome", "outcome"),
    ("sniffio", "sniffio"), ("sortedcontainers", "sortedcontainers"), ("idna", "idna"), ("soxr", "soxr"),
    ("sphn", "sphn"), ("pybase64", "pybase64"), ("websockets", "websockets"),
    ("webrtcvad", "webrtcvad-wheels"), ("moshi", "moshi"), ("duplexrt", "this checkout"),
)
GPU_SIZES = (1, 8, 16, 32, 48, 64, 80)
CPU_SIZES = (1, 2, 4)
#: The ``ring`` phase's cells (rows, ring positions: the short ring first, then the model's own).
GPU_RING = ((32, 64), (750, 3000))
CPU_RING = ((2, 4), (16, 64))
#: Seconds each phase may take (GPU, CPU); the whole run is also bounded by --budget-s.
LIMITS = {"build": (300, 120), "steps": (150, 120), "variants": (90, 60), "wait": (20, 10), "ring": (90, 60),
          "batch": (60, 60), "serve": (90, 120)}
#: The ``variants`` phase: (CUDA graphs, torch.compile) for each run, all on first.
VARIANTS = ((True, True), (False, True), (True, False), (False, False))
FRAME = 1920
#: Frames of the one session the steps phase hears alone at each batch size.
PROBE_FRAMES = 8
#: Frames of the call the ``batch`` phase hears alone and among neighbours (GPU, CPU).
NEIGHBOUR_FRAMES = (200, 24)
FRAME_MS = 80.0


def check_imports() -> list[str]:
    """What is missing, named with what provides it (empty: everything imports)."""
    missing = []
    for module, provider in REQUIRED:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure to import is a missing part
            missing.append(f"{module} (from {provider}): {type(exc).__name__}: {exc}")
    return missing


class Results:
    """The JSON, rewritten whole after every phase (a run cut short keeps what it had)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "phases": {}}

    def put(self, phase: str, value: dict) -> None:
        self.data["phases"][phase] = value
        temporary = self.path.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.data, indent=1, default=str))
        temporary.replace(self.path)


def _ms(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"mean": round(statistics.fmean(values), 3), "p50": round(ordered[len(ordered) // 2], 3),
            "p99": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))], 3),
            "max": round(ordered[-1], 3)}


def device_phase(cuda: bool) -> dict:
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "machine": platform.machine(), "cuda": cuda,
            "torch_compile": not os.environ.get("NO_TORCH_COMPILE"),
            "cuda_graphs": cuda and os.environ.get("NO_CUDA_GRAPH", "").lower() in ("", "0", "no", "n")}
    from duplexrt.backends.moshi import compiler

    info["c_compiler"] = compiler.find_c_compiler()
    info["python_headers"] = str(compiler.python_headers() or "")
    if cuda:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, cuda_version=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    return info


def build_phase(options: dict, first: int) -> tuple[object, dict]:
    from duplexrt.backends.base import BackendInfo
    from duplexrt.backends.moshi import MoshiBackend, memory

    backend = MoshiBackend(BackendInfo("moshi", 24000, FRAME, first), options)
    build = backend._build  # noqa: SLF001 - timed apart: the weights, then the warm-up
    parts: dict = {}

    def timed_build(torch):
        began = time.perf_counter()
        try:
            return build(torch)
        finally:
            parts["model_s"] = round(time.perf_counter() - began, 2)

    backend._build = timed_build  # type: ignore[method-assign]
    started = time.perf_counter()
    backend.load()
    seconds = time.perf_counter() - started
    model = backend._model  # noqa: SLF001 - the benchmark reads what it built
    fit = backend.slot_choice.details.get("fit_memory")
    model_s = parts.get("model_s", 0.0)
    return backend, {"load_s": round(seconds, 2), "model_s": model_s, "warmup_s": round(seconds - model_s, 2),
                     "torch_compile": backend.description.get("torch_compile"),
                     "weights_bytes": memory.weight_bytes(model.lm, model.mimi),
                     "bytes_per_slot": backend.slot_bytes.as_dict(), "fit_memory": fit,
                     "free_bytes": backend.slot_choice.details.get("free_bytes"),
                     "reserve_bytes": backend.slot_choice.details.get("reserve_bytes")}


def _timed_steps(backend, active: int, steps: int, cuda: bool) -> dict:
    import numpy as np

    from duplexrt.backends.base import SlotSession

    rows = np.arange(active, dtype=np.int64)
    for slot in rows:
        backend.open_slot(int(slot), SlotSession(int(slot) + 1))
    inputs = (np.random.default_rng(0).standard_normal((active, FRAME)) * 0.3).astype(np.float32)
    outputs = np.empty_like(inputs)
    backend.step(rows, inputs, outputs)  # the joining rows' reset lands in this one
    walls, cpus = [], []
    stages: dict[str, list[float]] = {}
    for _ in range(steps):
        wall, cpu = time.perf_counter(), time.thread_time()
        backend.step(rows, inputs, outputs)
        cpus.append((time.thread_time() - cpu) * 1e3)
        walls.append((time.perf_counter() - wall) * 1e3)
        for name, ns in backend.last_stages:
            stages.setdefault(name, []).append(ns / 1e6)
    for slot in rows:
        backend.close_slot(int(slot))
    return {"step_ms": _ms(walls), "stage_ms": {name: round(statistics.fmean(v), 3) for name, v in stages.items()},
            "thread_cpu_ms_per_step": round(statistics.fmean(cpus), 3),
            "thread_cpu_share": round(sum(cpus) / sum(walls), 3)}


def _hear(backend, row: int, frames):
    """One seeded session alone in ``row``: its audio, frame by frame."""
    import numpy as np

    from duplexrt.backends.base import SlotSession

    backend.open_slot(row, SlotSession(999_999))
    rows = np.array([row], dtype=np.int64)
    heard = np.empty((len(frames), FRAME), dtype=np.float32)
    for k, frame in enumerate(frames):
        backend.step(rows, frame[None], heard[k:k + 1])
    backend.close_slot(row)
    return heard


def _exactness(rows: list[dict], heard: dict) -> None:
    """Each measured size's ``exact``: its row 0 against the largest size's, its last row against
    its row 0, bit for bit."""
    import numpy as np

    if not heard:
        return
    reference = heard[max(heard)][0]
    for row in rows:
        size = row["rows"]
        if size not in heard:
            continue
        first, last = heard[size]
        row["exact"] = {"row_0_as_largest_batch": bool(np.array_equal(first, reference)),
                        "max_abs_diff": float(np.abs(first - reference).max()),
                        "last_row_as_row_0": bool(np.array_equal(last, first))}


def _memory_now(cuda: bool) -> dict:
    if not cuda:
        return {}
    import torch

    return {"allocated_bytes": torch.cuda.memory_allocated(), "peak_bytes": torch.cuda.max_memory_allocated(),
            "reserved_bytes": torch.cuda.memory_reserved()}


def steps_phase(backend, sizes: tuple[int, ...], fit: int | None, steps: int, cuda: bool, deadline: float,
                budget_ms: float, on_row) -> dict:
    import numpy as np
    import torch

    rows = []
    heard: dict[int, tuple] = {}
    probe = (np.random.default_rng(1).standard_normal((PROBE_FRAMES, FRAME)) * 0.3).astype(np.float32)
    for size in sizes:
        if fit is not None and size > fit:
            rows.append({"rows": size, "skipped": f"does not fit: {fit} slots fit the memory"})
            on_row(rows)
            continue
        if time.monotonic() > deadline:
            rows.append({"rows": size, "skipped": "the phase's time ran out"})
            on_row(rows)
            continue
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        started = time.perf_counter()
        try:
            backend.resize(size)
            row = {"rows": size, "resize_s": round(time.perf_counter() - started, 2)}
            row.update(_timed_steps(backend, size, steps, cuda))
            heard[size] = (_hear(backend, 0, probe), _hear(backend, size - 1, probe))
        except torch.OutOfMemoryError as exc:  # the arithmetic's reserve was too small: say so, stop here
            rows.append({"rows": size, "error": f"out of memory: {exc}"[:500], **_memory_now(cuda)})
            on_row(rows)
            break
        row.update(_memory_now(cuda))
        row["within_budget"] = row["step_ms"]["p50"] <= budget_ms
        rows.append(row)
        on_row(rows)
    _exactness(rows, heard)
    return {"budget_ms": budget_ms, "steps_per_size": steps, "rows": rows}


def variants_phase(backend, sizes: list[int], steps: int, cuda: bool, deadline: float, on_run) -> dict:
    """The step at each of ``sizes`` with CUDA graphs and torch.compile each on and off.  Graphs
    are the package's ``NO_CUDA_GRAPH`` (read at every call), compilation its own switch (read
    at every call of a compiled function); both are put back after."""
    import moshi.utils.compile as package_compile

    from duplexrt.backends.moshi import compiler

    compiled_here = compiler.compile_enabled()  # off at import (NO_TORCH_COMPILE, no compiler): no "on" run
    saved_env, saved_flag = os.environ.get("NO_CUDA_GRAPH"), package_compile._compile_disabled
    runs: list[dict] = []
    try:
        for size in sizes:
            for graphs, compiled in VARIANTS:
                run: dict = {"rows": size, "cuda_graphs": graphs and cuda, "torch_compile": compiled and compiled_here}
                if (graphs and not cuda) or (compiled and not compiled_here):
                    run["skipped"] = "not available here" + ("" if cuda else ": no GPU, no graphs")
                    if not compiled_here and compiled:
                        run["skipped"] = "torch.compile is off in this process"
                elif time.monotonic() > deadline:
                    run["skipped"] = "the phase's time ran out"
                else:
                    os.environ["NO_CUDA_GRAPH"] = "" if graphs else "1"
                    package_compile._compile_disabled = not compiled
                    started = time.perf_counter()
                    backend.resize(size)
                    run["resize_s"] = round(time.perf_counter() - started, 2)
                    run.update(_timed_steps(backend, size, steps, cuda))
                runs.append(run)
                on_run(runs)
    finally:
        if saved_env is None:
            os.environ.pop("NO_CUDA_GRAPH", None)
        else:
            os.environ["NO_CUDA_GRAPH"] = saved_env
        package_compile._compile_disabled = saved_flag
    columns: dict = {}
    for run in runs:
        if "step_ms" in run:
            name = f"graphs_{'on' if run['cuda_graphs'] else 'off'}_compile_{'on' if run['torch_compile'] else 'off'}"
            columns.setdefault(name, {})[str(run["rows"])] = run["step_ms"]["p50"]
    return {"runs": runs, "columns": columns}


def wait_phase(cuda: bool) -> dict:
    """CPU a thread spends waiting for ~50 ms of GPU work: spinning event against blocking one."""
    if not cuda:
        return {"skipped": "no GPU: a CPU model has no device to wait for"}
    import torch

    def waited(blocking: bool, cycles: int) -> tuple[float, float]:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True, blocking=blocking)
        start.record()
        torch.cuda._sleep(cycles)  # noqa: SLF001 - torch's own busy kernel, for exactly this
        end.record()
        cpu = time.thread_time()
        end.synchronize()
        return (time.thread_time() - cpu) * 1e3, start.elapsed_time(end)

    cycles = 1_000_000
    _, ms = waited(True, cycles)
    cycles = int(cycles * 50.0 / max(ms, 1e-3))
    result = {}
    for name, blocking in (("spinning", False), ("blocking", True)):
        runs = [waited(blocking, cycles) for _ in range(10)]
        result[name] = {"gpu_ms": round(statistics.fmean(r[1] for r in runs), 2),
                        "thread_cpu_ms": round(statistics.fmean(r[0] for r in runs), 3)}
    return result


def ring_phase(backend, rows: tuple[int, ...], rings: tuple[int, ...], steps: int, cuda: bool, deadline: float,
               on_cell) -> dict:
    """The step at each ring length and batch size, the rings alternated at each size (the model
    is the same; only the rows' state is allocated again).  The backend's own ring is put back."""
    import attrs
    import torch

    settings = backend.settings
    frame_rate = 1000.0 / FRAME_MS
    cells: list[dict] = []
    try:
        for size in rows:
            for positions in rings:
                cell: dict = {"rows": size, "ring_positions": positions, "ring_seconds": positions / frame_rate}
                if time.monotonic() > deadline:
                    cells.append({**cell, "skipped": "the phase's time ran out"})
                    on_cell(cells)
                    continue
                backend.settings = attrs.evolve(settings, context_seconds=positions / frame_rate)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                try:
                    backend.resize(size)
                except Exception as exc:  # noqa: BLE001 - a size that does not fit (ConfigError, OOM): said
                    cells.append({**cell, "skipped": f"{type(exc).__name__}: {exc}"[:500]})
                    on_cell(cells)
                    continue
                cell.update(resize_s=round(time.perf_counter() - started, 2),
                            bytes_per_slot=backend.slot_bytes.total,
                            fit_memory=backend.slot_choice.details.get("fit_memory"))
                cell.update(_timed_steps(backend, size, steps, cuda))
                cell.update(_memory_now(cuda))
                cells.append(cell)
                on_cell(cells)
    finally:
        backend.settings = settings
    full = {c["rows"]: c for c in cells if c["ring_positions"] == max(rings) and "step_ms" in c}
    for cell in cells:
        if "step_ms" in cell and cell["rows"] in full:
            cell["ratio_to_full_ring"] = round(cell["step_ms"]["p50"] / full[cell["rows"]]["step_ms"]["p50"], 4)
    return {"cells": cells}


def batch_phase(backend, slots: int, steps: int, cuda: bool, probe_frames: int) -> dict:
    """The step by active rows, fixed batch against buckets, then the neighbour probe."""
    import attrs

    settings = backend.settings
    runs = []
    try:
        for batch in ("fixed", "buckets"):
            backend.settings = attrs.evolve(settings, batch=batch)
            backend.resize(slots)
            for active in sorted({1, min(2, slots), max(1, slots // 8), slots}):
                runs.append({"batch": batch, "active": active, **_timed_steps(backend, active, steps, cuda)})
        probe = _neighbour_probe(backend, probe_frames)
    finally:
        backend.settings = settings
    fixed = {r["active"]: r["step_ms"]["p50"] for r in runs if r["batch"] == "fixed"}
    for run in runs:
        run["ratio_to_fixed"] = round(run["step_ms"]["p50"] / fixed[run["active"]], 4)
    return {"slots": slots, "runs": runs, "probe": probe}


def _neighbour_probe(backend, frames: int) -> dict:
    """One seeded call alone, then the same call while 1 and then 6 neighbours join and leave
    (buckets 1 -> 2 -> 8 -> 1, as the slots allow): the frames whose text or audio differ."""
    import numpy as np

    from duplexrt.backends.base import SlotSession

    rng = np.random.default_rng(7)
    signal = (rng.standard_normal((frames, FRAME)) * 0.3).astype(np.float32)
    noise = (rng.standard_normal((frames, FRAME)) * 0.3).astype(np.float32)
    slots = backend.info.slots
    plan = [(slot, frames // 4 if slot == 1 else frames // 2, 3 * frames // 4) for slot in range(1, min(slots, 8))]

    def call(with_neighbours: bool) -> tuple[np.ndarray, list[str]]:
        backend.open_slot(0, SlotSession(4242))
        heard = np.empty((frames, FRAME), dtype=np.float32)
        texts: list[str] = []
        for k in range(frames):
            present = [0]
            if with_neighbours:
                for slot, start, end in plan:
                    if k == start:
                        backend.open_slot(slot, SlotSession(5000 + slot))
                    if k == end:
                        backend.close_slot(slot)
                    if start <= k < end:
                        present.append(slot)
            rows = np.array(sorted(present), dtype=np.int64)
            inputs = np.stack([signal[k] if r == 0 else noise[k] for r in rows])
            out = np.empty_like(inputs)
            said = backend.step(rows, inputs, out)
            heard[k] = out[0]
            texts.append(said[0])
        backend.close_slot(0)
        return heard, texts

    alone = call(False)
    among = call(True)
    audio = [not np.array_equal(a, b) for a, b in zip(alone[0], among[0])]
    return {"frames": frames, "neighbours": len(plan), "frames_text_differs": sum(a != b for a, b in zip(alone[1], among[1])),
            "frames_audio_differs": int(sum(audio)), "max_abs_diff": float(np.abs(alone[0] - among[0]).max()),
            "frames_audio_differs_over_1e-3": int((np.abs(alone[0] - among[0]).max(axis=1) > 1e-3).sum())}


def serve_phase(backend, slots: int, seconds: float, out: Path, limit_s: float) -> dict:
    """``duplexrt serve`` on the built model at ``slots``, paced callers from another process."""
    import attrs
    import trio

    from duplexrt.config import load_config
    from duplexrt.server import Server

    import tempfile

    backend.info = attrs.evolve(backend.info, slots=slots)  # the scheduler's load sizes it again
    backend.settings = attrs.evolve(backend.settings, batch="buckets")  # served as a user's server is
    # The server's host threads pinned to one CPU, as on CPUs given to it; the clients kept off it.
    config = load_config(None, ["server.port=0", 'backend.name="moshi"', f"runtime.slots={slots}",
                                'runtime.late_input="fill"', "metrics.log_stats=false",
                                "runtime.pin_host_threads=true"])
    frames = max(4, int(seconds * 1000 / FRAME_MS))
    report = Path(tempfile.mkdtemp(prefix="duplexrt-gpu-serve-")) / "serve-clients.json"  # not in OUT
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
    result: dict = {"slots": slots, "sessions": slots, "frames_per_session": frames}

    async def main() -> None:
        server = Server(config, backend)
        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            before = server.statistics().runtime
            cpu = time.process_time()
            command = [sys.executable, str(ROOT / "benchmarks" / "bare_cli.py"), "simulate", "--url",
                       f"ws://127.0.0.1:{server.ports[0]}/v1/duplex", "--concurrency", str(slots),
                       "--mode", "paced", "--frames", str(frames), "--message-ms", "80", "--no-progress",
                       "--json", str(report)]
            # A process started from the pinned trio thread would inherit its one CPU: the clients
            # get every other CPU instead (all of them, where there is no other).
            server_cpu = server.runtime.scheduler.pin_cpu if server.runtime is not None else None
            clients = (allowed - {server_cpu}) or allowed
            result.update(server_cpu=server_cpu, clients_cpus=sorted(clients))

            def place_clients() -> None:
                if clients:
                    os.sched_setaffinity(0, clients)

            with trio.move_on_after(limit_s) as guard:
                done = await trio.run_process(command, capture_stdout=True, capture_stderr=True, check=False,
                                              preexec_fn=place_clients)
            result["server_process_cpu_s"] = round(time.process_time() - cpu, 3)
            after = server.statistics().runtime
            if guard.cancelled_caught:
                result["error"] = f"the clients did not finish within {limit_s:g} s"
            else:
                result["clients_exit_status"] = done.returncode
                result["clients_output"] = done.stdout.decode()[-3000:] + done.stderr.decode()[-2000:]
            stepped = after.scheduler.frames - before.scheduler.frames
            result["frames_stepped"] = stepped
            result["steps"] = after.scheduler.steps - before.scheduler.steps
            result["scheduler_thread_cpu_s"] = round(after.scheduler.thread_cpu_seconds
                                                     - before.scheduler.thread_cpu_seconds, 3)
            if stepped:
                result["host_cpu_us_per_frame"] = round(result["server_process_cpu_s"] / stepped * 1e6, 1)
            result["slot_choice"] = after.slot_choice.as_dict()
            server.shutdown()

    trio.run(main)
    if report.exists():
        rounds = json.loads(report.read_text()).get("rounds", [])
        if rounds:
            r = rounds[-1]
            lag = r.get("frame_lag_ms") or {}
            result.update(late_frames=r.get("late_frames"), lag_p50_ms=lag.get("p50"), lag_p99_ms=lag.get("p99"),
                          real_time_factor=r.get("real_time_factor"),
                          server_cpu_us_per_frame=r.get("server_cpu_us_per_frame"),
                          frames_out=r.get("frames_out"), failures=r.get("failures"))
    return result


def run_phase(results: Results, name: str, limit_s: float, work):
    """``work()`` as phase ``name``: its result (or its error) written at once.  Past ``limit_s``
    the process dumps every thread's stack and exits (faulthandler): a hung GPU call cannot take
    the next phases' time, and what was written so far stays."""
    results.put(name, {"running": True, "limit_s": round(limit_s, 1)})  # a run cut short says where it was
    began = time.monotonic()
    faulthandler.dump_traceback_later(limit_s, exit=True)
    try:
        value = work()
    except Exception as exc:  # noqa: BLE001 - recorded, and the next phases still run
        value = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-4000:]}
    finally:
        faulthandler.cancel_dump_traceback_later()
    value.setdefault("phase_s", round(time.monotonic() - began, 2))
    results.put(name, value)
    print(f"{name}:", json.dumps({k: v for k, v in value.items() if k not in ("clients_output", "traceback")}),
          flush=True)
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("benchmark-gpu"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole run's seconds")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per size (0: 20 on a GPU, 3 on a CPU)")
    parser.add_argument("--serve-seconds", type=float, default=0.0, help="the paced round (0: 30 s GPU, 3 s CPU)")
    args = parser.parse_args()
    missing = check_imports()
    if missing:
        print("benchmarks/gpu.py cannot run: missing\n  " + "\n  ".join(missing), file=sys.stderr)
        return 3
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("NO_TORCH_COMPILE", "1")
    args.out.mkdir(parents=True, exist_ok=True)
    results = Results(args.out / "gpu.json")
    began = time.monotonic()
    end = began + args.budget_s
    which = 0 if cuda else 1

    def deadline(phase: str) -> float:
        return min(end, time.monotonic() + LIMITS[phase][which])

    from duplexrt.config import load_config

    # The presets' own model options: configs/moshi-7b-random.toml on a GPU, moshi-tiny.toml on a CPU.
    preset = ROOT / "configs" / ("moshi-7b-random.toml" if cuda else "moshi-tiny.toml")
    # The fixed batch until the ``batch`` phase compares it with buckets: ``steps``' ``exact`` asks
    # what the batch size changes, which only the fixed batch lets a lone call see.
    options = {**dict(load_config(preset).backend.options), "batch": "fixed"}
    sizes = GPU_SIZES if cuda else CPU_SIZES
    steps = args.steps or (20 if cuda else 3)
    budget_ms = FRAME_MS * 0.95
    hard = 30.0  # beyond a phase's own limit, before faulthandler ends the process

    run_phase(results, "device", 60, lambda: device_phase(cuda))
    made: dict = {}

    def build() -> dict:
        made["backend"], built = build_phase(options, sizes[0])
        return built

    built = run_phase(results, "build", LIMITS["build"][which] + hard, build)
    backend = made.get("backend")
    if backend is None:
        return 1
    table = run_phase(results, "steps", LIMITS["steps"][which] + hard + 60, lambda: steps_phase(
        backend, sizes, built["fit_memory"], steps, cuda, deadline("steps"), budget_ms,
        lambda rows: results.put("steps", {"budget_ms": budget_ms, "rows": rows})))
    measured = [r for r in table.get("rows", []) if "step_ms" in r]
    within = [r["rows"] for r in measured if r["within_budget"]]
    if measured and time.monotonic() < end:
        largest = max(within) if within else measured[0]["rows"]
        variant_sizes = sorted({size for size in (8 if cuda else sizes[0], largest)
                                if any(r["rows"] == size for r in measured)})
        run_phase(results, "variants", LIMITS["variants"][which] + hard + 30, lambda: variants_phase(
            backend, variant_sizes, steps, cuda, deadline("variants"),
            lambda runs: results.put("variants", {"running": True, "runs": runs})))
    run_phase(results, "wait", LIMITS["wait"][which] + hard, lambda: wait_phase(cuda))
    if measured and time.monotonic() < end:
        ring_rows, rings = GPU_RING if cuda else CPU_RING
        run_phase(results, "ring", LIMITS["ring"][which] + hard + 30, lambda: ring_phase(
            backend, ring_rows, rings, steps, cuda, deadline("ring"),
            lambda cells: results.put("ring", {"cells": cells})))
    if measured and time.monotonic() < end:
        run_phase(results, "batch", LIMITS["batch"][which] + hard,
                  lambda: batch_phase(backend, measured[-1]["rows"], steps, cuda, NEIGHBOUR_FRAMES[which]))
    if measured and time.monotonic() < end:
        serve_slots = max(within) if within else 1
        seconds = args.serve_seconds or (30.0 if cuda else 3.0)
        limit = min(LIMITS["serve"][which], max(10.0, end - time.monotonic()))
        run_phase(results, "serve", limit + hard + 60,
                  lambda: serve_phase(backend, serve_slots, seconds, args.out, limit))
    results.data["seconds"] = round(time.monotonic() - began, 1)
    results.put("done", {"seconds": results.data["seconds"]})
    print(f"wrote {results.path} in {results.data['seconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
