"""The read hub (duplexrt.readhub) over real socket pairs: one task calling back whoever's socket
has something to read, and staying up whatever a callback does."""

from __future__ import annotations

import socket

import pytest
import trio
import trio.testing

from duplexrt.readhub import ReadHub

pytestmark = pytest.mark.skipif(not ReadHub.available(), reason="the read hub needs epoll (Linux)")


class Reader:
    """A callback that reads what is there and keeps it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sock.setblocking(False)
        self.chunks: list[bytes] = []
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        try:
            self.chunks.append(self.sock.recv(65536))
        except BlockingIOError:
            pass


async def _settle() -> None:
    await trio.testing.wait_all_tasks_blocked()


async def test_each_readable_socket_gets_its_callback_and_the_others_do_not():
    hub = ReadHub()
    pairs = [socket.socketpair() for _ in range(3)]
    readers = [Reader(mine) for mine, _ in pairs]
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        for reader in readers:
            hub.watch(reader.sock.fileno(), reader)
        pairs[0][1].send(b"zero")
        pairs[2][1].send(b"two")
        await _settle()
        assert readers[0].chunks == [b"zero"] and readers[2].chunks == [b"two"]
        assert readers[1].calls == 0
        assert hub.callbacks == 2 and 1 <= hub.wakeups <= 2
        nursery.cancel_scope.cancel()
    for mine, theirs in pairs:
        mine.close()
        theirs.close()


async def test_a_forgotten_socket_is_not_called_back_and_forgetting_twice_is_harmless():
    hub = ReadHub()
    mine, theirs = socket.socketpair()
    reader = Reader(mine)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.watch(mine.fileno(), reader)
        hub.forget(mine.fileno(), reader)
        hub.forget(mine.fileno(), reader)
        theirs.send(b"unheard")
        await _settle()
        assert reader.calls == 0 and not hub.watching(mine.fileno()) and len(hub) == 0
        nursery.cancel_scope.cancel()
    mine.close()
    theirs.close()


async def test_a_number_given_to_a_new_socket_is_watched_for_the_new_owner_only():
    """A socket closed without ``forget`` leaves the kernel's set on its own; its number, given to
    the next socket, must reach the new owner's callback, and the old owner's late ``forget``
    must not take it away."""
    hub = ReadHub()
    first, first_peer = socket.socketpair()
    old = Reader(first)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        number = first.fileno()
        hub.watch(number, old)
        first.close()  # no forget
        second, second_peer = socket.socketpair()  # the kernel hands out the lowest free number
        assert second.fileno() == number
        new = Reader(second)
        hub.watch(number, new)
        hub.forget(number, old)  # the first owner, late
        second_peer.send(b"for the new one")
        await _settle()
        assert new.chunks == [b"for the new one"] and old.calls == 0
        nursery.cancel_scope.cancel()
    for sock in (first_peer, second, second_peer):
        sock.close()


async def test_a_callback_that_raises_is_dropped_and_the_hub_serves_the_rest():
    hub = ReadHub()
    bad_pair, good_pair = socket.socketpair(), socket.socketpair()
    good = Reader(good_pair[0])
    calls = []

    def broken() -> None:
        calls.append(1)
        raise RuntimeError("a bug in one connection")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.watch(bad_pair[0].fileno(), broken)
        hub.watch(good_pair[0].fileno(), good)
        bad_pair[1].send(b"x")  # never read: level-triggered, it would call back forever
        await _settle()
        good_pair[1].send(b"still served")
        await _settle()
        assert calls == [1] and not hub.watching(bad_pair[0].fileno())
        assert good.chunks == [b"still served"]
        nursery.cancel_scope.cancel()
    for sock in (*bad_pair, *good_pair):
        sock.close()


async def test_data_left_unread_calls_back_again_until_it_is_read():
    hub = ReadHub()
    mine, theirs = socket.socketpair()
    mine.setblocking(False)
    seen = []

    def one_byte_at_a_time() -> None:
        seen.append(mine.recv(1))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(hub.run)
        hub.watch(mine.fileno(), one_byte_at_a_time)
        theirs.send(b"abc")
        await _settle()
        assert b"".join(seen) == b"abc"
        nursery.cancel_scope.cancel()
    mine.close()
    theirs.close()
