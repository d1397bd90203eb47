"""Only core/handoffs.py and the scheduler thread's own module cross between threads.

The runtime promises that it moves work off the trio thread for two reasons only, and counts
every crossing by kind (``Handoffs.statistics()``).  That holds only while no other module starts
a thread, runs a function on one, or reaches trio from one.  Reading the source with ``ast``
finds every such call in ``duplexrt/`` and ``cli/``, however it is imported or spelt:
``trio.to_thread`` / ``trio.from_thread``, a trio token (``current_trio_token``,
``run_sync_soon``), ``threading.Thread`` / ``Timer``, ``_thread``, ``concurrent.futures``,
``multiprocessing``, asyncio's thread hops, and an exception raised into another thread.

Locks, conditions and events are not crossings: they guard what two threads share (the inbox,
a counter), and the scheduler's wake through the inbox is counted by handoffs as
``scheduler_wake``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("duplexrt", "cli")

#: Dotted names (after resolving imports) that cross a thread boundary, by what they are.
CROSSING_NAMES = {
    "trio.to_thread": "trio.to_thread",
    "trio.from_thread": "trio.from_thread",
    "trio.lowlevel.current_trio_token": "trio token",
    "trio.lowlevel.start_thread_soon": "thread start",
    "trio.lowlevel.start_guest_run": "thread start",
    "threading.Thread": "thread start",
    "threading.Timer": "thread start",
    "_thread": "thread start",
    "concurrent.futures": "executor",
    "multiprocessing": "executor",
    "asyncio.to_thread": "executor",
    "ctypes.pythonapi.PyThreadState_SetAsyncExc": "async exception",
}
#: Attribute names that cross whatever object they are read from (a token, an event loop).
CROSSING_ATTRIBUTES = {
    "run_sync_soon": "trio token",
    "run_in_executor": "executor",
    "call_soon_threadsafe": "executor",
    "run_coroutine_threadsafe": "executor",
    "PyThreadState_SetAsyncExc": "async exception",
}

#: Where a crossing is the module's job, and which.  Each entry must still be found (so the list
#: shrinks with the code), and nothing else may be.
ALLOWED = {
    # The gateway: worker-thread offloads and deliveries into trio, each counted by kind.
    "duplexrt/core/handoffs.py": {"trio.to_thread", "trio token"},
    # The scheduler thread's module: it starts its one thread and takes the trio token that
    # thread hands its deliveries back through (``Handoffs.deliver_from_thread``).
    "duplexrt/core/scheduler.py": {"thread start", "trio token"},
    # The load interrupt: stopping a model's load that takes no cancellation (SIGTERM to a pod
    # still loading) by raising in the scheduler thread, once, at shutdown.  No work crosses and
    # nothing is delivered, so there is nothing for handoffs to count; only the scheduler uses
    # it (test_only_the_scheduler_interrupts_a_thread below).
    "duplexrt/core/interrupt.py": {"async exception"},
}


def _dotted(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """``a.b.c`` with its first name resolved through the module's imports, or None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def _matches(name: str) -> str | None:
    for prefix, kind in CROSSING_NAMES.items():
        if name == prefix or name.startswith(prefix + "."):
            return kind
    return None


def crossings(source: str) -> list[tuple[int, str]]:
    """Each thread crossing in ``source``: (line, kind)."""
    tree = ast.parse(source)
    aliases: dict[str, str] = {}
    found: set[tuple[int, str]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname is not None:
                    aliases[alias.asname] = alias.name
                kind = _matches(alias.name)
                if kind is not None:
                    found.add((node.lineno, kind))
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            for alias in node.names:
                qualified = f"{node.module}.{alias.name}"
                aliases[alias.asname or alias.name] = qualified
                kind = _matches(qualified) or _matches(node.module)
                if kind is not None:
                    found.add((node.lineno, kind))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)):
            name = _dotted(node, aliases)
            kind = _matches(name) if name is not None else None
            if kind is None and isinstance(node, ast.Attribute):
                kind = CROSSING_ATTRIBUTES.get(node.attr)
            if kind is not None:
                found.add((node.lineno, kind))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
              and node.args[1].value in CROSSING_ATTRIBUTES):
            found.add((node.lineno, CROSSING_ATTRIBUTES[node.args[1].value]))
    # One report per line and kind: ``trio.to_thread.run_sync`` is one crossing, not three.
    return sorted(found)


def _library() -> dict[str, str]:
    return {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
            for folder in SOURCES for path in sorted((ROOT / folder).rglob("*.py"))}


def test_only_handoffs_and_the_scheduler_cross_threads():
    found: dict[str, set[str]] = {}
    offenders = []
    for path, source in _library().items():
        for line, kind in crossings(source):
            found.setdefault(path, set()).add(kind)
            if kind not in ALLOWED.get(path, set()):
                offenders.append(f"{path}:{line}: {kind}")
    assert offenders == [], ("thread crossings outside core/handoffs.py and the scheduler: go through "
                             "Handoffs, or name the module in ALLOWED with why:\n" + "\n".join(offenders))
    stale = {path: sorted(kinds - found.get(path, set())) for path, kinds in ALLOWED.items()
             if kinds - found.get(path, set())}
    assert stale == {}, f"ALLOWED names crossings that are no longer there: {stale}"


def test_only_the_scheduler_interrupts_a_thread():
    users = sorted(path for path, source in _library().items()
                   if path != "duplexrt/core/interrupt.py" and "duplexrt.core.interrupt" in source)
    assert users == ["duplexrt/core/scheduler.py"]


def test_the_scan_finds_each_way_of_crossing():
    """The scan itself, on made-up modules: each spelling of a crossing is found, under its
    kind; what only guards shared state, or names a type, is not."""
    source = "\n".join([
        "import trio",                                          # 1
        "import trio as t",                                     # 2
        "from trio import to_thread",                           # 3
        "import concurrent.futures",                            # 4
        "from threading import Thread as Worker",               # 5
        "import threading, ctypes, asyncio",                    # 6
        "async def f(token, loop):",                            # 7
        "    await trio.to_thread.run_sync(len, ())",           # 8
        "    await t.from_thread.run(f)",                       # 9
        "    token.run_sync_soon(print)",                       # 10
        "    getattr(token, 'run_sync_soon')(print)",           # 11
        "    Worker(target=print).start()",                     # 12
        "    threading.Timer(1, print).start()",                # 13
        "    loop.call_soon_threadsafe(print)",                 # 14
        "    await asyncio.to_thread(print)",                   # 15
        "    ctypes.pythonapi.PyThreadState_SetAsyncExc(1, None)",  # 16
        "    trio.lowlevel.current_trio_token()",               # 17
        "    await to_thread.run_sync(print)",                  # 18
    ])
    assert crossings(source) == [
        (3, "trio.to_thread"), (4, "executor"), (5, "thread start"), (8, "trio.to_thread"),
        (9, "trio.from_thread"), (10, "trio token"), (11, "trio token"), (12, "thread start"),
        (13, "thread start"), (14, "executor"), (15, "executor"), (16, "async exception"),
        (17, "trio token"), (18, "trio.to_thread"),
    ]
    benign = "\n".join([
        "import threading",
        "import trio",
        "lock = threading.Lock()",
        "ready = threading.Event()",
        "def g(token: trio.lowlevel.TrioToken) -> None:",
        "    with lock:",
        "        threading.get_ident()",
        "    trio.lowlevel.checkpoint()",
        "    run_sync_soon = None",  # a name, not a call through a token
    ])
    assert crossings(benign) == []


def test_a_new_crossing_outside_the_two_modules_fails_the_rule():
    """The rule as the first test applies it, on a module that is not allowed one."""
    source = "import trio\nasync def decode(payload):\n    return await trio.to_thread.run_sync(bytes, payload)\n"
    path = "duplexrt/audio/formats.py"
    assert [kind for _line, kind in crossings(source) if kind not in ALLOWED.get(path, set())] == ["trio.to_thread"]
