"""The shared pacing timer (duplexrt.client.pacer): one task wakes every paced sender on time, none
early, senders due within one tick share a wake-up, and a cancelled wait leaves cleanly.  Then a
paced ``Conversation`` on a pacer sends each message when it is due, as it does on its own timer.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio

from duplexrt.audio import AudioSpec
from duplexrt.client.conversation import ENDED, Conversation
from duplexrt.client.pacer import Pacer
from duplexrt.client.protocols import DuplexClient
from duplexrt.wire.transport import memory_transport_pair


async def _waiters(pacer: Pacer, times: list[float], woke: list[tuple[int, float]]) -> None:
    async def wait(index: int, when: float) -> None:
        await pacer.wait_until(when)
        woke.append((index, trio.current_time()))

    async with trio.open_nursery() as nursery:
        for index, when in enumerate(times):
            nursery.start_soon(wait, index, when)


async def test_each_waiter_wakes_at_its_time_in_order_and_never_early(autojump_clock):
    pacer = Pacer()
    start = trio.current_time()
    times = [start + t for t in (0.30, 0.10, 0.20, 0.10, 0.05)]
    woke: list[tuple[int, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        await _waiters(pacer, times, woke)
        nursery.cancel_scope.cancel()
    order = [index for index, _ in woke]
    assert order[0] == 4 and set(order[1:3]) == {1, 3} and order[3:] == [2, 0]  # by time
    for index, at in woke:
        assert at == pytest.approx(times[index], abs=1e-9) and at >= times[index]
    assert pacer.statistics().released == 5 and pacer.statistics().waiting == 0


async def test_senders_due_within_one_tick_share_one_wake_up_no_earlier_than_the_last_of_them(autojump_clock):
    pacer = Pacer(tick=0.01)
    start = trio.current_time()
    base = (int(start / 0.01) + 10) * 0.01  # a grid point a little ahead
    times = [base + 0.001 * k for k in range(1, 10)]  # nine senders due within one tick
    woke: list[tuple[int, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        await _waiters(pacer, times, woke)
        nursery.cancel_scope.cancel()
    stats = pacer.statistics()
    assert stats.released == 9 and stats.wakes == 1
    moments = {at for _, at in woke}
    assert len(moments) == 1
    (moment,) = moments
    assert moment >= max(times) and moment - min(times) <= 0.01 + 1e-9  # a tick late at most


async def test_a_later_waiter_that_is_due_first_moves_the_pacers_wake_up_earlier(autojump_clock):
    pacer = Pacer()
    start = trio.current_time()
    woke: list[tuple[int, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        nursery.start_soon(_waiters, pacer, [start + 5.0], woke)
        await trio.testing.wait_all_tasks_blocked()  # the pacer sleeps until start + 5
        await _waiters(pacer, [start + 1.0], woke)  # woken at 1 s, not kept until 5 s
        assert trio.current_time() == pytest.approx(start + 1.0)
        nursery.cancel_scope.cancel()


async def test_a_cancelled_wait_leaves_the_schedule_and_the_others_still_wake(autojump_clock):
    pacer = Pacer()
    start = trio.current_time()
    woke: list[str] = []

    async def waiter(name: str, when: float) -> None:
        await pacer.wait_until(when)
        woke.append(name)

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        with trio.move_on_after(0.5) as scope:
            await waiter("cancelled", start + 1.0)
        assert scope.cancelled_caught and pacer.statistics().waiting == 0
        await waiter("kept", start + 2.0)
        nursery.cancel_scope.cancel()
    assert woke == ["kept"] and pacer.statistics().released == 1


async def test_a_time_already_past_is_a_checkpoint_that_returns_at_once(autojump_clock):
    pacer = Pacer()  # not even running: nothing waits for it
    now = trio.current_time()
    await pacer.wait_until(now - 1.0)
    assert trio.current_time() == now
    with trio.CancelScope() as scope:
        scope.cancel()
        with pytest.raises(trio.Cancelled):
            await pacer.wait_until(now)


def test_a_negative_tick_is_refused():
    with pytest.raises(ValueError):
        Pacer(tick=-0.001)


class _NoDirectPaths:
    """A transport with only the awaited paths (no send_nowait, no receive_nowait or poll)."""

    def __init__(self, transport) -> None:
        self._transport = transport

    async def send(self, message) -> None:
        await self._transport.send(message)

    async def receive(self):
        return await self._transport.receive()

    def receive_nowait(self):
        raise trio.WouldBlock

    async def close(self, *args) -> None:
        await self._transport.close(*args)


@pytest.mark.parametrize("path", ["direct", "woken"])
async def test_a_paced_conversation_on_a_pacer_sends_each_message_when_it_is_due(autojump_clock, path):
    """What paced means, on the shared timer: message i goes out at start + offset + (i + 1) x
    interval, within a tick, never before; over a transport that sends without yielding the
    pacer's task sends it (no wake-up of the sender), otherwise it wakes the sender."""
    client_end, server_end = memory_transport_pair(capacity=16)
    transport = client_end if path == "direct" else _NoDirectPaths(client_end)
    spec = AudioSpec("pcm_f32le", 24000)
    frame = np.zeros(1920, np.float32).tobytes()
    sent_at: list[float] = []
    interval, offset, tick, count = 0.08, 0.013, 0.002, 6

    async def server() -> None:
        for _ in range(count):
            message = await server_end.receive()
            sent_at.append(trio.current_time())
            await server_end.send(message)
        await server_end.receive()  # input.end
        await server_end.send('{"type": "session.end", "reason": "stop", "usage": {"frames_in": 6, "frames_out": 6}}')
        await server_end.close()

    pacer = Pacer(tick=tick)
    conversation = Conversation(transport, DuplexClient(spec, greets=False), on_audio=lambda item, now: None)
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        nursery.start_soon(server)
        start = trio.current_time()
        await conversation.run(count, lambda i: frame, interval=interval, offset=offset, pacer=pacer)
        nursery.cancel_scope.cancel()
    assert conversation.outcome == ENDED and conversation.messages_sent == count
    assert len(conversation.send_times) == count and conversation.input_done
    due = [start + offset + (i + 1) * interval for i in range(count)]
    assert len(sent_at) == count
    for at, when in zip(sent_at, due):
        assert when <= at <= when + tick + 1e-9
    stats = pacer.statistics()
    assert (stats.sent, stats.released) == ((count, 0) if path == "direct" else (0, count))


async def test_a_message_that_cannot_go_at_once_is_sent_by_its_sender_in_order(autojump_clock):
    """send_due: when the transport cannot take a message without waiting, the pacer hands it
    back to the sender's task, which waits to send it; then the pacer goes on with the next."""
    client_end, server_end = memory_transport_pair(capacity=1)
    pacer = Pacer()
    sent: list[int] = []
    refused: list[int] = []

    def send_now(i: int) -> bool:
        try:
            client_end.send_nowait(f"m{i}")
        except trio.WouldBlock:
            refused.append(i)
            return False
        sent.append(i)
        return True

    taken: list[str] = []

    async def slow_server() -> None:
        await trio.sleep(0.35)  # the first messages pile up: the channel holds one
        while len(taken) < 5:
            taken.append(await server_end.receive())

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        nursery.start_soon(slow_server)
        start = trio.current_time()
        i = 0
        while i < 5:
            i = await pacer.send_due(i, 5, lambda k: start + 0.1 * (k + 1), send_now)
            if i < 5:
                await client_end.send(f"m{i}")  # waits for room
                sent.append(i)
                i += 1
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert refused and sent == [0, 1, 2, 3, 4] and taken == [f"m{k}" for k in range(5)]


async def test_what_the_send_raises_reaches_the_sender_and_the_pacer_goes_on(autojump_clock):
    pacer = Pacer()

    def broken(i: int) -> bool:
        raise RuntimeError(f"cannot send {i}")

    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        start = trio.current_time()
        with pytest.raises(RuntimeError, match="cannot send 0"):
            await pacer.send_due(0, 3, lambda k: start + 0.1 * (k + 1), broken)
        await pacer.wait_until(start + 1.0)  # the pacer still runs
        nursery.cancel_scope.cancel()


async def test_a_cancelled_send_due_sends_nothing_more(autojump_clock):
    pacer = Pacer()
    sent: list[int] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        start = trio.current_time()
        with trio.move_on_at(start + 0.25):
            await pacer.send_due(0, 10, lambda k: start + 0.1 * (k + 1), lambda i: sent.append(i) is None)
        await pacer.wait_until(start + 2.0)
        nursery.cancel_scope.cancel()
    assert sent == [0, 1] and pacer.statistics().waiting == 0


async def test_the_pacer_wakes_without_raising_cancelled(autojump_clock, monkeypatch):
    """Its own deadline wakes the pacer quietly: no ``Cancelled`` is made for a wake-up."""
    made: list[str] = []
    create = trio.Cancelled._create

    def counting_create(*args, **kwargs):
        made.append("Cancelled")
        return create(*args, **kwargs)

    pacer = Pacer()
    start = trio.current_time()
    woke: list[tuple[int, float]] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(pacer.run)
        monkeypatch.setattr(trio.Cancelled, "_create", counting_create)
        await _waiters(pacer, [start + 1.0, start + 2.0, start + 3.0], woke)
        assert pacer.statistics().wakes == 3 and made == []
        nursery.cancel_scope.cancel()
    assert made  # the stop itself is a cancellation, raised as ever


async def test_a_cancellation_at_the_moment_of_a_wake_up_still_stops_the_pacer(autojump_clock):
    """The outer cancellation and the pacer's own deadline at one instant: the wake-up is quiet,
    and the cancellation lands at the pacer's next wait all the same."""
    pacer = Pacer()
    start = trio.current_time()
    with trio.CancelScope(deadline=start + 1.0) as outer:
        async with trio.open_nursery() as nursery:
            await nursery.start(pacer.run)
            nursery.start_soon(pacer.wait_until, start + 1.0)
            nursery.start_soon(pacer.wait_until, start + 7.0)
            await trio.sleep_forever()
    assert outer.cancelled_caught
    assert trio.current_time() == pytest.approx(start + 1.0)  # not kept until the next due time
