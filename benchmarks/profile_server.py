"""Where a frame's CPU goes in ``duplexrt serve`` over real WebSockets, by layer (issue 12, step 1).

For each route in ``--routes``: start ``duplexrt serve`` (echo model) on a free loopback port,
attach ``py-spy record`` to it, drive it with ``duplexrt simulate --url`` (paced sessions, a
separate process), stop py-spy when the load ends, fold the collapsed stacks into layers and print
a table per route, with the server's CPU per frame as simulate reports it (from the server's own
/metrics).  ``--baseline`` first runs the same load without py-spy attached, because py-spy stops
the process for each sample and so inflates the CPU figure a little.

Layers, matched on the file path py-spy prints for a Python frame (first rule that matches wins):

    socket I/O          trio/_socket.py, trio/_highlevel_socket.py, trio/_core/_io_epoll.py,
                        selectors.py, socket.py
    WebSocket framing   wsproto/*, duplexrt/wire/frames.py, connection.py, native.py, handshake.py
    trio-websocket      trio_websocket/*
    trio scheduling     trio/* (the rest: the run loop, checkpoints, memory channels, locks)
    translator          duplexrt/protocols/*
    session             duplexrt/session/*, duplexrt/core/slot_owner.py, duplexrt/audio/*
    scheduler/inbox     duplexrt/core/scheduler.py, duplexrt/core/inbox.py, duplexrt/core/handoffs.py,
                        duplexrt/core/capacity.py, duplexrt/core/affinity.py
    metrics             duplexrt/core/metrics.py, duplexrt/core/histogram.py,
                        duplexrt/core/stage_meter.py, duplexrt/server/metrics.py,
                        duplexrt/server/stats_log.py
    backend             duplexrt/backends/*, duplexrt/runtime.py
    server glue         duplexrt/wire/wss.py, duplexrt/wire/transport.py, duplexrt/wire/resume.py,
                        duplexrt/server/*
    other               no frame of the stack matches (interpreter start-up, logging, ...)

Attribution rules:

* **Self** ("where the CPU is spent"): a sample belongs to the layer of the *innermost* frame
  that matches a rule.  Frames of libraries outside the list (json, base64, numpy, stdlib
  helpers, native frames with ``--native``) count for the listed layer that called them: a
  ``json.dumps`` inside ``duplexrt/protocols/realtime.py`` is translator time, a
  ``threading.Lock.release`` inside ``duplexrt/core/inbox.py`` is scheduler/inbox time.  Self shares
  add up to 100 %.
* **Inclusive** ("what this layer and everything it calls costs"): a sample counts once for every
  layer that appears anywhere in its stack.  Shares add up to more than 100 %; the trio run loop is
  at the root of every stack of the trio thread, so its inclusive share is that thread's share.
* Samples are py-spy's default non-idle samples, less the *blocked waits*: a sample whose innermost
  Python frame is trio's ``EpollIOManager.get_events`` (epoll_wait), ``Inbox._sleep`` (the
  scheduler thread waiting for a batch), a ``threading`` wait, or ``WorkerThread._work`` (an idle
  worker thread of trio's cache waiting for a job).  py-spy's idle test (the thread's state in /proc at
  the sample) lets many of those through here: with them, py-spy's "busy" time came out at 1.5-3
  times the CPU the process's own counter reports.  They are printed apart and left out, so the
  epoll syscall's own CPU (small: one call per run-loop pass) is not in the table.  A share is a
  share of the remaining busy samples; multiplied by the server's CPU per frame (simulate's
  figure, from the server's process_cpu_seconds_total) it gives a layer's µs per frame.  Threads are reported apart: ``MainThread`` runs trio
  (sessions, translators, WebSockets), ``duplexrt-scheduler`` runs the model; any other thread
  is a worker (offloads).

Usage: python benchmarks/profile_server.py [--routes '/v1/duplex,/v1/realtime?duplex=1&continuous=1']
           [--concurrency 96] [--frames 250] [--rate 200] [--native] [--baseline] [--keep DIR]
       python benchmarks/profile_server.py --fold DIR/v1_duplex.txt --cpu 206.2   # kept stacks again

Needs py-spy in the same environment (``pip install py-spy``) and ptrace on the server process
(same user; in a container, CAP_SYS_PTRACE or a permissive kernel.yama.ptrace_scope).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent
DUPLEXRT = BIN / "duplexrt"
PY_SPY = BIN / "py-spy"

#: (layer, path test) in order: the first match wins, so the socket files of trio come before trio.
RULES: list[tuple[str, re.Pattern[str]]] = [
    ("socket I/O", re.compile(r"^(trio/_socket\.py|trio/_highlevel_socket\.py|trio/_core/_io_epoll\.py"
                              r"|selectors\.py|socket\.py)$")),
    ("WebSocket framing", re.compile(r"^wsproto/|^duplexrt/wire/(frames|connection|native|handshake)\.py$")),
    ("trio-websocket", re.compile(r"^trio_websocket/")),
    ("trio scheduling", re.compile(r"^trio/")),
    ("translator", re.compile(r"^duplexrt/protocols/")),
    ("session", re.compile(r"^duplexrt/(session/|core/slot_owner\.py|audio/)")),
    ("scheduler/inbox", re.compile(r"^duplexrt/core/(scheduler|inbox|handoffs|capacity|affinity)\.py$")),
    ("metrics", re.compile(r"^duplexrt/(core/(metrics|histogram|stage_meter)|server/(metrics|stats_log))\.py$")),
    ("backend", re.compile(r"^duplexrt/(backends/|core/runtime\.py)")),
    ("server glue", re.compile(r"^duplexrt/wire/(wss|transport|resume)\.py$|^duplexrt/server/")),
]
WAIT = "blocked wait"
LAYERS = [name for name, _ in RULES] + ["other", WAIT]
#: Innermost Python frames that are a blocking wait: epoll_wait in trio's run loop, the
#: scheduler thread's sleep in the inbox.  py-spy's idle detection (the thread's state
#: in /proc) misses many of them, because the sample lands as the thread enters or leaves the
#: call; they are counted apart and left out of the busy shares (see the docstring).
WAITS = {("EpollIOManager.get_events", "trio/_core/_io_epoll.py"), ("Condition.wait", "threading.py"),
         ("Event.wait", "threading.py"), ("Thread.join", "threading.py"),
         # the scheduler thread asleep on its wake-up lock (held until a signal releases it)
         ("Inbox._sleep", "duplexrt/core/inbox.py"),
         # an idle worker of trio's thread cache waiting for its next job (a job's frames are deeper)
         ("WorkerThread._work", "trio/_core/_thread_cache.py")}
#: "name (path:line)" for a Python frame, "name (libfoo.so)" for a native one.
FRAME = re.compile(r"^(?P<func>.*) \((?P<path>[^():]+?)(?::(?P<line>\d+))?\)$")
#: "thread (TID): NAME"; a thread sampled before its name is set has no ": NAME".
THREAD = re.compile(r"^thread \(\w+\)(?:: (?P<name>.*))?$")


def is_python(match: re.Match[str] | None) -> bool:
    """A Python frame: with --native, C frames of CPython's modules carry a file and line too."""
    return bool(match and match.group("line") and not match.group("path").endswith((".c", ".h", ".cc", ".cpp")))


def package_path(path: str) -> str:
    """``path`` from its package's name on: py-spy prints site-packages files relative to
    site-packages, and a file of this checkout may come with a longer prefix."""
    for marker in ("duplexrt/", "trio_websocket/", "wsproto/", "trio/"):
        at = path.rfind("/" + marker)
        if at >= 0:
            return path[at + 1:]
    return path


def layer_of(path: str) -> str | None:
    path = package_path(path)
    for name, test in RULES:
        if test.search(path):
            return name
    return None


class Profile:
    """Collapsed stacks folded into layers, per thread group."""

    def __init__(self) -> None:
        self.self_: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        self.total: collections.Counter[str] = collections.Counter()
        #: Innermost matching frame -> samples, to name the hottest functions of each layer.
        self.functions: collections.Counter[tuple[str, str]] = collections.Counter()
        #: PARTS label -> busy samples whose stack holds one of its functions.
        self.parts: collections.Counter[str] = collections.Counter()
        #: (trio task, self layer) -> samples of the trio thread: which task pays for what.
        self.tasks: collections.Counter[tuple[str, str]] = collections.Counter()

    def add(self, line: str) -> None:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            return
        count = int(count_text)
        frames = stack.split(";")
        thread = "all"
        if frames and (match := THREAD.match(frames[0])):
            name = match.group("name") or ""
            thread = "trio (MainThread)" if name == "MainThread" else (
                "scheduler thread" if name.startswith("duplexrt-scheduler") else "worker threads")
            frames = frames[1:]
        innermost: str | None = None
        function = ""
        seen: set[str] = set()
        python = [m for m in map(FRAME.match, frames) if is_python(m)]
        if python and (python[-1].group("func"), package_path(python[-1].group("path"))) in WAITS:
            innermost, function = WAIT, f"{python[-1].group('func')} ({python[-1].group('path')})"
            frames = []
        for frame in frames:
            match = FRAME.match(frame)
            if not is_python(match):  # native frame or unparsable: no layer
                continue
            layer = layer_of(match.group("path"))
            if layer is not None:
                innermost = layer
                function = f"{match.group('func')} ({match.group('path').rsplit('site-packages/', 1)[-1]})"
                seen.add(layer)
        innermost = innermost or "other"
        if thread.startswith("trio") and innermost != WAIT:
            self.tasks[(task_of(frames), innermost)] += count
        if innermost != WAIT:
            names = {m.group("func") for m in python}
            for label, wanted in PARTS:
                if any(_matches(name, w) for name in names for w in wanted):
                    self.parts[label] += count
        for group in (thread, "whole process"):
            self.total[group] += count
            self.self_[group][innermost] += count
            for layer in seen or {innermost}:
                self.inclusive[group][layer] += count
        self.functions[(innermost, function)] += count


#: What each cut the issue suggests would act on: (label, function names), counted inclusively (a
#: sample counts when any of the functions is anywhere in its stack), so each row is what that code
#: and everything it calls cost.  Rows overlap; they are not meant to add up.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("trio-websocket reader task, all of it", ("WebSocketConnection._reader_task",)),
    ("  wsproto receive: Connection.events + receive_data", ("Connection.events", "Connection.receive_data")),
    ("    of which unmasking: XorMaskerSimple.process", ("XorMaskerSimple.process",)),
    ("  socket receive: SocketStream.receive_some", ("SocketStream.receive_some",)),
    ("  message to the session: _handle_message_event (channel send)", ("WebSocketConnection._handle_message_event",)),
    ("session's receive from the channel: WebSocketTransport.receive(_nowait)",
     ("WebSocketTransport.receive", "WebSocketTransport.receive_nowait")),
    ("send path: WebSocketTransport.send", ("WebSocketTransport.send",)),
    ("  socket send: SocketStream.send_all", ("SocketStream.send_all",)),
    ("  wsproto send: Connection.send", ("Connection.send",)),
    ("  trio-websocket send lock: _LockImpl.acquire/release", ("_LockImpl.acquire", "_LockImpl.release")),
    ("session read loop: Reader._read_loop", ("Reader._read_loop",)),
    ("  PCM decode: _PcmDecoder.decode", ("_PcmDecoder.decode",)),
    ("    of which the range check: _in_range", ("_in_range",)),
    ("  submit to the scheduler: Reader._submit", ("Reader._submit",)),
    ("session write loop: Writer.run", ("Writer.run",)),
    ("output sent from a step's delivery: Writer._send_directly", ("Writer._send_directly",)),
    ("  PCM encode: _PcmEncoder.encode(_rows)", ("_PcmEncoder.encode", "_PcmEncoder.encode_rows")),
    ("thread handoffs into trio: EntryQueue.task", ("EntryQueue.task",)),
    ("realtime/live VAD: InputVad.*", ("InputVad.",)),
    ("base64 audio: Base64Audio.*", ("Base64Audio.",)),
    ("Opus: _OpusEncoder.* / _OpusDecoder.*", ("_OpusEncoder.", "_OpusDecoder.")),
    ("stage metrics: StageMeter.*, Histogram.record/add/add_many",
     ("StageMeter.", "Histogram.record", "Histogram.add", "Histogram.add_many")),
    ("attrs/dataclass __init__ (per-event objects)", ("__create_fn__.<locals>.__init__",)),
    ("logging: Logger.*", ("Logger.",)),
]


def _matches(name: str, wanted: str) -> bool:
    return name.startswith(wanted) if wanted.endswith(".") else name == wanted


#: The first frame of a task's stack, as the run loop calls it, and the name it gets in the table.
TASK_NAMES = {"_run_handler": "connection handler (session read loop)",
              "WebSocketConnection._reader_task": "trio-websocket reader task",
              "Writer.run": "session write loop", "EntryQueue.task": "trio entry queue (thread handoffs)"}


def task_of(frames: list[str]) -> str:
    """The trio task a sample of the trio thread ran in: the frame the run loop stepped into, or
    the run loop itself when that frame is trio's own (epoll events, rescheduling, deadlines)."""
    names = [(m.group("func"), m.group("path")) for m in map(FRAME.match, frames) if is_python(m)]
    for at, (func, _) in enumerate(names):
        if func == "unrolled_run":
            if at + 1 == len(names):
                return "run loop (between tasks)"
            func, path = names[at + 1]
            if func in TASK_NAMES:
                return TASK_NAMES[func]
            return "run loop (between tasks)" if path.startswith(("trio/_core/", "collections/")) else func
    return "outside the run loop"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, port: int) -> None:
        self.log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
        self.proc = subprocess.Popen(
            [str(DUPLEXRT), "serve", "--host", "127.0.0.1", "--port", str(port), "--slots", "1024",
             "--no-log-stats"], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if "port(s)" in Path(self.log.name).read_text():
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"the server did not start:\n{Path(self.log.name).read_text()}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        os.unlink(self.log.name)


def simulate(url: str, concurrency: int, frames: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = handle.name
    proc = subprocess.run([str(DUPLEXRT), "simulate", "--url", url, "--mode", "paced", "--concurrency",
                           str(concurrency), "--frames", str(frames), "--json", out, "--no-progress"],
                          capture_output=True, text=True, timeout=900)
    try:
        round_ = json.loads(Path(out).read_text())["rounds"][-1]
    except (OSError, ValueError, KeyError, IndexError):
        raise SystemExit(f"simulate failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    finally:
        if os.path.exists(out):
            os.unlink(out)
    round_["exit_code"] = proc.returncode
    return round_


def run_route(route: str, args: argparse.Namespace, keep: Path | None) -> dict:
    result: dict = {"route": route, "load_before": os.getloadavg()[0]}
    if args.baseline:
        port = free_port()
        server = Server(port)
        try:
            result["baseline"] = simulate(f"ws://127.0.0.1:{port}{route}", args.concurrency, args.frames)
        finally:
            server.stop()
    port = free_port()
    server = Server(port)
    raw = (keep / f"{route.strip('/').replace('/', '_').replace('?', '_')}.txt") if keep else \
        Path(tempfile.mkstemp(suffix=".txt")[1])
    spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(server.proc.pid), "--rate", str(args.rate),
                            "--format", "raw", "--threads", "--output", str(raw),
                            *(["--native"] if args.native else []), *(["--nonblocking"] if args.nonblocking else [])],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.0)  # py-spy attaches before the load starts
    try:
        result["profiled"] = simulate(f"ws://127.0.0.1:{port}{route}", args.concurrency, args.frames)
    finally:
        spy.send_signal(signal.SIGINT)
        spy_out = spy.communicate(timeout=120)[0]
        server.stop()
    result["load_after"] = os.getloadavg()[0]
    profile = Profile()
    text = raw.read_text() if raw.exists() else ""
    if not text:
        raise SystemExit(f"py-spy wrote no samples:\n{spy_out}")
    for line in text.splitlines():
        profile.add(line)
    if not keep:
        raw.unlink()
    result["profile"] = profile
    return result


def report(result: dict, args: argparse.Namespace) -> dict:
    profile: Profile = result["profile"]
    profiled = result["profiled"]
    cpu = profiled["server_cpu_us_per_frame"]
    sessions_frames = args.concurrency * args.frames
    whole = profile.total["whole process"]
    print(f"\n## {result['route']}  ({args.concurrency} paced sessions x {args.frames} frames, echo; "
          f"load average {result['load_before']:.1f} before, {result['load_after']:.1f} after)")
    line = (f"server CPU per frame: {cpu:.1f} µs with py-spy attached"
            f" (load generator {profiled['load_generator_cpu_us_per_frame']:.1f} µs)")
    if "baseline" in result:
        line += f"; {result['baseline']['server_cpu_us_per_frame']:.1f} µs without it"
    print(line)
    lag = profiled.get("frame_lag_ms") or {}
    print(f"frame lag p99 {lag.get('p99', float('nan')):.1f} ms, late frames {profiled.get('late_frames')}, "
          f"guards {'ok' if not profiled.get('failures') else profiled['failures'][:2]}; "
          f"{whole} samples at {args.rate} Hz")
    groups = ["whole process"] + sorted(g for g in profile.total if g != "whole process")
    busy = {g: profile.total[g] - profile.self_[g][WAIT] for g in groups}
    print(f"{profile.self_['whole process'][WAIT]} of the {whole} samples py-spy counted busy are blocking waits "
          f"(epoll_wait, the scheduler's sleep), left out; the {busy['whole process']} busy samples make "
          f"{busy['whole process'] / args.rate * 1e6 / sessions_frames:.1f} µs of thread time per frame")
    print("\nShares of the busy samples (self: innermost matching frame; inclusive: anywhere in the stack); "
          "µs/frame = whole-process self share x the server CPU per frame above.")
    print("\n| layer | " + " | ".join(f"self, {g}" for g in groups) + " | self µs/frame | inclusive, whole process |")
    print("|---|" + "---|" * (len(groups) + 2))
    rows = {}
    for layer in sorted((name for name in LAYERS if name != WAIT), key=lambda name: -profile.self_["whole process"][name]):
        shares = [100 * profile.self_[g][layer] / max(busy[g], 1) for g in groups]
        if not any(shares) and not profile.inclusive["whole process"][layer]:
            continue
        inclusive = 100 * profile.inclusive["whole process"][layer] / max(busy["whole process"], 1)
        us = shares[0] / 100 * cpu
        rows[layer] = {"self_share": shares[0], "self_us_per_frame": us, "inclusive_share": inclusive}
        print(f"| {layer} | " + " | ".join(f"{s:.1f} %" for s in shares) + f" | {us:.1f} | {inclusive:.1f} % |")
    print("| busy samples | " + " | ".join(str(busy[g]) for g in groups) + " | | |")
    trio_groups = [g for g in groups if g.startswith("trio")]
    if trio_groups and busy[trio_groups[0]]:
        # µs per frame: the trio thread's part of the server CPU, split by its samples.
        trio_cpu = cpu * busy[trio_groups[0]] / max(busy["whole process"], 1)
        per_task = collections.Counter()
        for (task, _), count in profile.tasks.items():
            per_task[task] += count
        columns = [name for name in sorted(LAYERS, key=lambda n: -profile.self_[trio_groups[0]][n])
                   if profile.self_[trio_groups[0]][name] and name != WAIT]
        print(f"\nThe trio thread by task, µs per frame (its {trio_cpu:.1f} µs split by its busy samples; self layer):")
        print("\n| task | total | " + " | ".join(columns) + " |")
        print("|---|---|" + "---|" * len(columns))
        for task, count in per_task.most_common(args.tasks):
            scale = trio_cpu / busy[trio_groups[0]]
            print(f"| {task} | {count * scale:.1f} | "
                  + " | ".join(f"{profile.tasks[(task, name)] * scale:.1f}" for name in columns) + " |")
    print("\nWhat the suggested cuts act on (inclusive, whole process; rows overlap):\n")
    print("| code | share of busy samples | µs per frame |\n|---|---|---|")
    parts = {}
    for label, _ in PARTS:
        if profile.parts[label]:
            share = 100 * profile.parts[label] / max(busy["whole process"], 1)
            parts[label.strip()] = share / 100 * cpu
            print(f"| {label.replace('  ', '&nbsp;&nbsp;')} | {share:.1f} % | {share / 100 * cpu:.1f} |")
    print("\nHottest innermost matching frames (self share of busy samples, whole process; µs per frame):")
    hottest = []
    for (layer, function), count in profile.functions.most_common(args.top):
        if layer == WAIT:
            continue
        share = 100 * count / max(busy["whole process"], 1)
        hottest.append({"layer": layer, "function": function, "share": share, "us_per_frame": share / 100 * cpu})
        print(f"  {share:5.1f} %  {share / 100 * cpu:6.1f} µs  {layer:18s} {function}")
    return {"route": result["route"], "server_cpu_us_per_frame": cpu,
            "baseline_server_cpu_us_per_frame": result.get("baseline", {}).get("server_cpu_us_per_frame"),
            "load_generator_cpu_us_per_frame": profiled["load_generator_cpu_us_per_frame"],
            "load_average": [result["load_before"], result["load_after"]], "samples": whole, "busy_samples": busy["whole process"],
            "threads": {g: busy[g] for g in groups}, "layers": rows, "parts_us_per_frame": parts,
            "hottest": hottest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--routes", default="/v1/duplex,/v1/realtime?duplex=1&continuous=1")
    parser.add_argument("--concurrency", type=int, default=96)
    parser.add_argument("--frames", type=int, default=250)
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    parser.add_argument("--nonblocking", action="store_true", help="py-spy --nonblocking (no pause per sample)")
    parser.add_argument("--baseline", action="store_true", help="also run the load once without py-spy")
    parser.add_argument("--top", type=int, default=20, help="hottest functions to list")
    parser.add_argument("--tasks", type=int, default=6, help="trio tasks to list")
    parser.add_argument("--keep", type=Path, default=None, help="keep py-spy's collapsed stacks in this folder")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--fold", type=Path, default=None,
                        help="no run: fold stacks kept by --keep again (with --cpu, the server's µs per frame)")
    parser.add_argument("--cpu", type=float, default=0.0, help="with --fold: server CPU µs per frame")
    args = parser.parse_args()
    if args.fold:
        profile = Profile()
        for line in args.fold.read_text().splitlines():
            profile.add(line)
        nan = float("nan")
        report({"route": str(args.fold), "profile": profile, "load_before": nan, "load_after": nan,
                "profiled": {"server_cpu_us_per_frame": args.cpu, "load_generator_cpu_us_per_frame": nan}}, args)
        return
    if not PY_SPY.exists():
        raise SystemExit(f"{PY_SPY} not found: pip install py-spy into this environment")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}, {os.cpu_count()} CPUs, "
          f"py-spy at {args.rate} Hz{' --native' if args.native else ''}")
    out = [report(run_route(route, args, args.keep), args) for route in args.routes.split(",")]
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
