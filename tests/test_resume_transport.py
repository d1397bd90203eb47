"""``ResumableTransport`` alone, over in-memory connections and a virtual clock: the journal's
bound in seconds, the window's expiry, the counts a resume is built on, and the session's state."""

from __future__ import annotations

import json

import pytest
import trio

from duplexrt.client.resume import ResumingTransport
from duplexrt.wire.resume import ResumableTransport, ResumeError, new_token, split_token
from duplexrt.session.lifecycle import SessionState
from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import TransportClosed, memory_transport_pair


def _notice(token: str, taken: int) -> list[str]:
    return [f"resumed {token} {taken}"]


class _Listener:
    def __init__(self) -> None:
        self.events: list[str] = []

    def connection_dropped(self) -> None:
        self.events.append("dropped")

    def connection_resumed(self) -> None:
        self.events.append("resumed")


async def _drop(client) -> None:
    """The client's side goes away with no Close: what a server sees as code 1006."""
    await client.close(CloseCode.ABNORMAL_CLOSURE)


async def _take_one(client, resumable: ResumableTransport) -> None:
    """The session takes one client message: only then is a drop a drop (see the next test)."""
    await client.send("in 0")
    assert await resumable.receive() == "in 0"


async def _detach(client, resumable: ResumableTransport) -> None:
    """The session takes a message, then its client drops: it waits, detached, for a resume."""
    await _take_one(client, resumable)
    await _drop(client)
    with trio.move_on_after(1):
        await resumable.receive()
    assert resumable.detached


async def test_a_drop_before_the_first_message_taken_ends_the_session_at_once(autojump_clock):
    """An upgrade cut before it sent anything holds nothing: no window, no slot kept."""
    client, server = memory_transport_pair()
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=15)
    await _drop(client)
    started = trio.current_time()
    with pytest.raises(TransportClosed) as ended:
        await resumable.receive()
    assert ended.value.code == CloseCode.ABNORMAL_CLOSURE and ended.value.finish_reason is None
    assert trio.current_time() == started and not resumable.detached and resumable.drops == 0


def test_a_token_names_its_replica_and_carries_at_least_128_random_bits():
    token = new_token("gpu.3")
    replica, secret = split_token(token)
    assert replica == "gpu.3" and len(secret) * 6 >= 128
    assert new_token("gpu.3") != token


async def test_the_journal_keeps_its_seconds_and_a_resume_past_them_is_refused(autojump_clock):
    client, server = memory_transport_pair(capacity=100)
    resumable = ResumableTransport(server, "r.x", window_s=10, journal_s=2.0)
    for second in range(5):
        await resumable.send(f"message {second}")
        await trio.sleep(1)
    # Sent at t = 0..4 and now t = 5: only what was sent in the last two seconds is kept.
    await resumable.send("message 5")
    assert resumable.sent == 6
    with pytest.raises(ResumeError) as refused:
        resumable.check(2)
    assert (refused.value.status, refused.value.code) == (410, "journal_exceeded")
    resumable.check(3)
    with pytest.raises(ResumeError, match="has sent 6"):
        resumable.check(7)


async def test_a_drop_detaches_a_resume_replays_what_was_missed_and_counts_what_was_taken(autojump_clock):
    client, server = memory_transport_pair(capacity=100)
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=10)
    listener = _Listener()
    resumable.listener = listener
    await client.send("in 0")
    await client.send("in 1")
    assert [await resumable.receive(), await resumable.receive()] == ["in 0", "in 1"]
    for i in range(3):
        await resumable.send(f"out {i}")
    assert [await client.receive() for _ in range(2)] == ["out 0", "out 1"]  # "out 2" is lost
    await _drop(client)
    async with trio.open_nursery() as nursery:
        got: list[str] = []

        async def read() -> None:
            got.append(await resumable.receive())

        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert resumable.detached and listener.events == ["dropped"]
        await resumable.send("out 3")  # made while away: journal only
        new_client, new_server = memory_transport_pair(capacity=100)
        await resumable.attach(new_server, 2, "r.b", _notice)
        assert [await new_client.receive() for _ in range(3)] == ["resumed r.b 2", "out 2", "out 3"]
        assert listener.events == ["dropped", "resumed"] and resumable.token == "r.b"
        await new_client.send("in 2")
    assert got == ["in 2"] and resumable.taken == 3


async def test_poll_counts_what_it_takes_and_answers_none_while_detached_or_dropped(autojump_clock):
    client, server = memory_transport_pair(capacity=100)
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=10)
    assert resumable.poll() is None
    await client.send("in 0")
    assert resumable.poll() == "in 0" and resumable.poll() is None and resumable.taken == 1
    await _drop(client)
    assert resumable.poll() is None  # receive() tells a drop from an end
    with trio.move_on_after(1):
        await resumable.receive()
    assert resumable.detached and resumable.poll() is None
    new_client, new_server = memory_transport_pair(capacity=100)
    await resumable.attach(new_server, 0, "r.b", _notice)
    await new_client.send("in 1")
    assert resumable.poll() == "in 1" and resumable.taken == 2


async def test_no_resume_within_the_window_ends_the_session_with_resume_expired(autojump_clock):
    client, server = memory_transport_pair()
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=15)
    await _take_one(client, resumable)
    await _drop(client)
    started = trio.current_time()
    with pytest.raises(Exception) as ended:
        await resumable.receive()
    assert ended.value.finish_reason is FinishReason.RESUME_EXPIRED
    assert trio.current_time() - started == pytest.approx(10)
    with pytest.raises(ResumeError, match="ended"):
        resumable.check(0)


async def test_abandon_ends_a_detached_session_at_once_and_a_later_drop_too(autojump_clock):
    """A second shutdown signal: no client will come back, so no window is waited out."""
    client, server = memory_transport_pair()
    detached = ResumableTransport(server, "r.a", window_s=10, journal_s=15)
    await _take_one(client, detached)
    await _drop(client)
    async with trio.open_nursery() as nursery:
        ended = {}

        async def receive() -> None:
            with pytest.raises(TransportClosed) as caught:
                await detached.receive()
            ended["at"], ended["reason"] = trio.current_time(), caught.value.finish_reason

        nursery.start_soon(receive)
        await trio.sleep(3)  # waiting for its client, 7 s of the window left
        abandoned_at = trio.current_time()
        detached.abandon()
    assert ended == {"at": abandoned_at, "reason": FinishReason.RESUME_EXPIRED}
    with trio.fail_after(1):
        await detached.close()  # nothing to wait for
    # Still attached when abandoned: the drop that follows ends it instead of detaching it.
    client, server = memory_transport_pair()
    attached = ResumableTransport(server, "r.b", window_s=10, journal_s=15)
    await _take_one(client, attached)
    attached.abandon()
    await _drop(client)
    started = trio.current_time()
    with pytest.raises(TransportClosed):
        await attached.receive()
    assert trio.current_time() == started and not attached.detached


async def test_a_clean_close_is_the_end_not_a_drop(autojump_clock):
    client, server = memory_transport_pair()
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=15)
    await client.close(CloseCode.NORMAL_CLOSURE)
    with pytest.raises(Exception) as ended:
        await resumable.receive()
    assert ended.value.code == CloseCode.NORMAL_CLOSURE and ended.value.finish_reason is None
    assert not resumable.detached


def test_a_detached_session_counts_as_open_and_states_only_move_forward():
    from duplexrt.session.lifecycle import rank

    assert rank(SessionState.DETACHED) == rank(SessionState.OPEN)
    order = [SessionState.OPENING, SessionState.OPEN, SessionState.STOPPING, SessionState.INPUT_ENDED,
             SessionState.CLOSING, SessionState.CLOSED]
    assert [rank(state) for state in order] == sorted(rank(state) for state in order)
    assert len({rank(state) for state in order}) == len(order)


# -- the client's half ---------------------------------------------------------------------------


class _DroppedConnection:
    """A client's first connection: it takes what is sent until ``drop``, then fails as a dropped
    connection does (code 1006, no finish reason)."""

    def __init__(self) -> None:
        self.dropped = trio.Event()

    async def send(self, message) -> None:
        if self.dropped.is_set():
            raise TransportClosed(CloseCode.ABNORMAL_CLOSURE, "dropped")

    async def receive(self):
        await self.dropped.wait()
        raise TransportClosed(CloseCode.ABNORMAL_CLOSURE, "dropped")

    def receive_nowait(self):
        raise trio.WouldBlock

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        pass


async def test_a_client_resume_with_much_to_send_both_ways_does_not_deadlock(autojump_clock):
    # The server replays its journal while the client sends again what the server missed.  With
    # each side only writing, a replay larger than the buffers between them (here 4 messages
    # each way) used to block both ends for good (seen over loopback as a ping timeout).
    first = _DroppedConnection()
    client_end, server_end = memory_transport_pair(capacity=4)

    async def connect(url: str):
        assert "resume=replica.first&received=0" in url
        return client_end

    resuming = ResumingTransport(first, "ws://127.0.0.1:1/v1/duplex", connect)
    resuming.token = "replica.first"
    for i in range(40):
        await resuming.send(f"up {i}")
    first.dropped.set()
    taken: list = []

    async def server() -> None:
        await server_end.send(json.dumps({"type": "session.resumed", "resume_token": "replica.next", "received": 0}))
        for i in range(40):  # the journal: everything the client missed
            await server_end.send(f"down {i}")
        for _ in range(41):
            taken.append(await server_end.receive())

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server)
            heard = [await resuming.receive() for _ in range(40)]
            await resuming.send("up 40")  # live again, after everything sent again
    assert heard == [f"down {i}" for i in range(40)]
    assert taken == [f"up {i}" for i in range(41)]
    assert (resuming.resumes, resuming.token, resuming.received) == (1, "replica.next", 40)


class _Journaled:
    """Both ways of sending a message through a ``ResumableTransport``, for side-by-side runs."""

    @staticmethod
    async def send(resumable: ResumableTransport, message: str) -> None:
        await resumable.send(message)

    @staticmethod
    async def send_nowait(resumable: ResumableTransport, message: str) -> None:
        while True:
            try:
                resumable.send_nowait(message)
                return
            except trio.WouldBlock:
                await trio.sleep(0.01)  # the client has not read yet: nothing numbered meanwhile


@pytest.mark.parametrize("way", ["send", "send_nowait"])
async def test_send_nowait_numbers_and_journals_exactly_as_send_does_also_when_detached(autojump_clock, way):
    send = getattr(_Journaled, way)
    client, server = memory_transport_pair(capacity=2)
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=10)
    await _take_one(client, resumable)
    for i in range(2):
        await send(resumable, f"out {i}")
    if way == "send_nowait":
        with pytest.raises(trio.WouldBlock):  # the connection holds two: the third is refused ...
            resumable.send_nowait("refused")
        assert resumable.sent == 2  # ... and took no number
    assert [await client.receive() for _ in range(2)] == ["out 0", "out 1"]
    await send(resumable, "out 2")  # lost with the connection
    await _drop(client)
    await send(resumable, "out 3")  # the drop is noticed here: journal only
    assert resumable.detached
    await send(resumable, "out 4")  # made while away: journal only
    assert resumable.sent == 5
    new_client, new_server = memory_transport_pair(capacity=100)
    await resumable.attach(new_server, 2, "r.b", _notice)
    assert [await new_client.receive() for _ in range(4)] == ["resumed r.b 1", "out 2", "out 3", "out 4"]
    await send(resumable, "out 5")
    assert await new_client.receive() == "out 5" and resumable.sent == 6


async def test_send_nowait_over_a_connection_without_one_is_refused_and_numbers_nothing(autojump_clock):
    class NoNowait:
        def __init__(self, inner) -> None:
            self.inner = inner

        async def send(self, message) -> None:
            await self.inner.send(message)

    client, server = memory_transport_pair(capacity=2)
    resumable = ResumableTransport(NoNowait(server), "r.a", window_s=10, journal_s=10)
    assert not resumable.offers_send_nowait
    with pytest.raises(trio.WouldBlock):
        resumable.send_nowait("x")
    assert resumable.sent == 0


async def test_a_claim_holds_the_session_for_one_connection_and_only_its_own_release_frees_it(autojump_clock):
    client, server = memory_transport_pair(capacity=100)
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=10)
    await _detach(client, resumable)
    first = resumable.claim(0)
    with pytest.raises(ResumeError) as refused:
        resumable.claim(0)
    assert (refused.value.status, refused.value.code) == (409, "resume_in_progress")
    new_client, new_server = memory_transport_pair(capacity=100)
    with pytest.raises(ResumeError, match="another connection"):
        await resumable.attach(new_server, 0, "r.b", _notice)  # no claim of its own: refused
    resumable.release(first)
    second = resumable.claim(0)
    resumable.release(first)  # a claim already over releases nothing
    with pytest.raises(ResumeError):
        resumable.claim(0)
    await resumable.attach(new_server, 0, "r.b", _notice, claim=second)
    assert await new_client.receive() == "resumed r.b 1" and not resumable.detached


async def test_a_replay_the_client_does_not_take_is_given_up_at_its_deadline_and_the_session_waits_on(autojump_clock):
    client, server = memory_transport_pair(capacity=100)
    resumable = ResumableTransport(server, "r.a", window_s=10, journal_s=10)
    await _detach(client, resumable)
    for i in range(5):
        await resumable.send(f"out {i}")
    _stalled_client, stalled = memory_transport_pair(capacity=2)  # takes two, never read
    started = trio.current_time()
    with pytest.raises(TransportClosed, match="not taken within 2 s"):
        await resumable.attach(stalled, 0, "r.b", _notice, replay_timeout=2)
    assert trio.current_time() - started == pytest.approx(2)
    assert resumable.detached and resumable.token == "r.a"
    new_client, new_server = memory_transport_pair(capacity=100)
    await resumable.attach(new_server, 0, "r.b", _notice, replay_timeout=2)
    assert [await new_client.receive() for _ in range(6)] == ["resumed r.b 1", *(f"out {i}" for i in range(5))]
