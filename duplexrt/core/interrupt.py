"""Stopping a thread in the middle of code that cannot be told to stop: a model's load.

A model loads on the scheduler thread, inside a third-party package (building a 7B model, reading
its weights, capturing CUDA graphs) that takes no cancellation and may run for minutes.  A
process told to stop then (Kubernetes sends SIGTERM to a pod that is still loading) must not wait
for it, and must not leave it running either: a Python thread still inside torch's C++ when the
interpreter exits is killed there, which aborts the process (``terminate called without an active
exception``, status 134, measured here).

So the load is made interruptible: ``interrupt()`` raises ``Interrupted`` inside the loading
thread (CPython's ``PyThreadState_SetAsyncExc``), where it lands at the next Python bytecode the
thread runs.  Loading is Python calling torch operation by operation, each short, so the thread
unwinds within a fraction of a second, running every ``finally`` and ``with`` exit on its way:
its memory is freed, and it ends like any thread that raised.  Only code inside
``interruptible()`` can be hit: the exception is never aimed at the thread once it has left it,
and one aimed too late to land inside is withdrawn on the way out.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Interrupted(BaseException):
    """Raised inside an ``interruptible()`` section by ``interrupt()``.  A BaseException, as
    KeyboardInterrupt is, so that a library's ``except Exception`` does not swallow it."""


def _raise_in(ident: int, exc_type: type[BaseException] | None) -> None:
    """Aim ``exc_type`` at thread ``ident`` (None: withdraw one aimed and not yet raised)."""
    setter = ctypes.pythonapi.PyThreadState_SetAsyncExc
    setter(ctypes.c_ulong(ident), ctypes.py_object(exc_type) if exc_type is not None else ctypes.py_object())


class Interrupter:
    """One thread's interruptible section, and the one call that interrupts it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ident: int | None = None
        self._fired = False

    @contextmanager
    def interruptible(self) -> Iterator[None]:
        """Run the block where ``interrupt()`` may raise ``Interrupted`` (on the thread itself)."""
        with self._lock:
            self._ident = threading.get_ident()
        try:
            yield
        finally:
            with self._lock:
                self._ident = None
                if self._fired:
                    _raise_in(threading.get_ident(), None)

    def interrupt(self) -> bool:
        """From any other thread: raise ``Interrupted`` in the section, once.  False when no
        thread is inside it (it has not begun, or it is over): nothing is raised then."""
        with self._lock:
            if self._ident is None or self._fired:
                return False
            self._fired = True
            _raise_in(self._ident, Interrupted)
            return True
