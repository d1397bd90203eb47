"""``duplexrt serve`` with thread-CPU timers around chosen functions: what each costs in a loaded
server, where a loop of its own says far less (docs/benchmarks.md, "Hot path, seventh pass").

Each ``--time module:Qualified.name`` is wrapped before the server starts; at exit the server's
standard error gets one line per function: calls, thread CPU per call (``time.thread_time_ns``
around it, so time spent waiting for the GIL or descheduled is left out) and wall time per call.
A wrapper costs two clock reads a call (about a microsecond here), counted in its figure; time
one function or a few at once, not a whole call tree.

Drive it like any server, e.g. with ``duplexrt simulate --url ... --mode paced``, then stop it
with Ctrl-C (SIGINT) to print the table.  ``--against DIR`` runs another checkout's code (DIR is
its root, as for ``benchmarks/vad_cost.py``), for a side-by-side figure of one function.

Usage: python benchmarks/timed_serve.py --time duplexrt.wsframes:FrameParser._unmask [--time ...]
           [--against DIR] -- [serve options]
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import importlib.util
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _use_checkout(root: Path) -> None:
    """Import ``duplexrt`` from ``root`` and ``duplexrt_cli`` from its ``cli/``, as an installed
    checkout maps them, in place of this environment's own install."""
    # An editable install's finder would answer for both names before sys.path is searched.
    sys.meta_path[:] = [finder for finder in sys.meta_path if "editable" not in repr(finder).lower()]
    sys.path.insert(0, str(root))
    cli = root / "cli"
    spec = importlib.util.spec_from_file_location("duplexrt_cli", cli / "__init__.py",
                                                  submodule_search_locations=[str(cli)])
    if spec is None or spec.loader is None:
        raise SystemExit(f"--against {root}: no cli/ package there")
    module = importlib.util.module_from_spec(spec)
    sys.modules["duplexrt_cli"] = module
    spec.loader.exec_module(module)


def _wrap(spec: str, cpu: Counter[str], wall: Counter[str], calls: Counter[str]) -> None:
    module_name, _, qualified = spec.partition(":")
    if not qualified:
        raise SystemExit(f"--time {spec!r}: expected module:Qualified.name")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualified.split(".")
    for part in path:
        owner = getattr(owner, part)
    original: Callable[..., Any] = getattr(owner, name)
    thread_ns, wall_ns = time.thread_time_ns, time.perf_counter_ns

    def timed(*args: Any, **kwargs: Any) -> Any:
        started_wall, started = wall_ns(), thread_ns()
        try:
            return original(*args, **kwargs)
        finally:
            cpu[qualified] += thread_ns() - started
            wall[qualified] += wall_ns() - started_wall
            calls[qualified] += 1

    setattr(owner, name, timed)


def main() -> None:
    argv = sys.argv[1:]
    serve_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--time", action="append", default=[], metavar="MODULE:NAME")
    parser.add_argument("--against", type=Path, help="another checkout's root: time its code instead")
    args = parser.parse_args(own)
    if args.against is not None:
        _use_checkout(args.against.resolve())
    cpu: Counter[str] = Counter()
    wall: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for spec in args.time:
        _wrap(spec, cpu, wall, calls)

    def report() -> None:
        print(f"{'function':<44} {'calls':>8} {'µs CPU/call':>12} {'µs wall/call':>13}", file=sys.stderr)
        for name, spent in sorted(cpu.items(), key=lambda item: -item[1]):
            n = calls[name]
            print(f"{name:<44} {n:>8} {spent / n / 1e3:>12.2f} {wall[name] / n / 1e3:>13.2f}", file=sys.stderr)

    atexit.register(report)
    from duplexrt_cli.app import main as duplexrt_main

    sys.argv = ["duplexrt", "serve", *serve_args]
    duplexrt_main()


if __name__ == "__main__":
    main()
