"""One task that notices input on every served connection, and hands it on without a wake-up each.

With a task per connection blocked on its socket, every message a client sends costs trio a
re-armed registration, a task switch and the resumption of that task's whole chain of awaits
before any of the message's own work starts; at paced load there is one such message per
connection every 80-160 ms, so that machinery is most of what a frame costs the server's thread
(measured: benchmarks/bare_echo.py against the same echo answered from one hub task, docs/benchmarks.md).

A ``ReadHub`` keeps one level-triggered epoll set of its own.  A connection registers its socket
once, with a callback; the hub waits on the set (one trio registration per wake-up, however many
sockets are ready) and calls the callback of each ready socket, which reads and handles what came
without yielding.  A callback that cannot finish its work without waiting (a full queue, a control
frame to answer) unregisters and wakes its own task instead: the hub is a shortcut for the common
case, never the only way a connection is read.

Linux only (epoll); elsewhere ``ReadHub.available()`` is False and connections read themselves.
"""

from __future__ import annotations

import logging
import select
from collections.abc import Callable

import trio

log = logging.getLogger("duplexrt.readhub")

#: What a socket's owner is called with when the socket is readable (or at its end, or in error).
#: It must not raise; it runs inside the hub, between other connections' callbacks.
Callback = Callable[[], None]


class ReadHub:
    """Calls ``callback()`` for each registered socket that has something to read (see the module
    docstring).  Run it with ``nursery.start_soon(hub.run)`` in a nursery that outlives every
    connection registered; every method is for the trio thread."""

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._callbacks: dict[int, Callback] = {}
        #: Wake-ups of the hub, and callbacks it made: callbacks / wake-ups is how much each wake-up
        #: served (``hot_path`` in /stats, and /metrics).
        self.wakeups = 0
        self.callbacks = 0

    @staticmethod
    def available() -> bool:
        return hasattr(select, "epoll")

    def __len__(self) -> int:
        return len(self._callbacks)

    def watch(self, fd: int, callback: Callback) -> None:
        """Call ``callback`` whenever ``fd`` is readable, until ``forget``."""
        current = self._callbacks.get(fd)
        if current is not None:
            if current == callback:
                return
            # Another owner's number: its socket was closed without a ``forget`` (the kernel
            # dropped it from the set then) and the number was given to this one.
            self._unregister(fd)
        self._epoll.register(fd, select.EPOLLIN)
        self._callbacks[fd] = callback

    def forget(self, fd: int, callback: Callback) -> None:
        """Stop watching ``fd`` for ``callback`` (idempotent; a number since given to another
        owner stays watched for it).  Call before closing the socket."""
        if self._callbacks.get(fd) == callback:
            del self._callbacks[fd]
            self._unregister(fd)

    def _unregister(self, fd: int) -> None:
        try:
            self._epoll.unregister(fd)
        except (OSError, ValueError):  # closed already: the kernel dropped it from the set
            pass

    def watching(self, fd: int) -> bool:
        return fd in self._callbacks

    async def run(self) -> None:
        """Serve until cancelled; the epoll set is closed on the way out."""
        epoll = self._epoll
        callbacks = self._callbacks
        try:
            while True:
                await trio.lowlevel.wait_readable(epoll.fileno())
                self.wakeups += 1
                for fd, _ in epoll.poll(0):
                    callback = callbacks.get(fd)
                    if callback is None:
                        continue
                    self.callbacks += 1
                    try:
                        callback()
                    except Exception:  # noqa: BLE001 - one connection's bug must not stop the rest
                        log.exception("a connection's read callback failed; it is no longer watched")
                        self.forget(fd, callback)
        finally:
            callbacks.clear()
            epoll.close()
