"""The in-memory transport (duplexrt/wire/transport.py) by plain calls: what each end sees when either closes."""

from __future__ import annotations

import pytest
import trio

from duplexrt.wire.transport import TransportClosed, memory_transport_pair, poller


async def test_messages_cross_in_order_both_ways():
    client, server = memory_transport_pair()
    await client.send(b"audio")
    await client.send("text")
    assert await server.receive() == b"audio" and server.receive_nowait() == "text"
    await server.send(b"back")
    assert await client.receive() == b"back"
    with pytest.raises(trio.WouldBlock):
        client.receive_nowait()


async def test_each_direction_holds_capacity_messages():
    client, server = memory_transport_pair(capacity=2)
    client.send_nowait(b"1")
    client.send_nowait(b"2")
    with pytest.raises(trio.WouldBlock):
        client.send_nowait(b"3")
    assert await server.receive() == b"1"
    client.send_nowait(b"3")


async def test_a_close_tells_the_other_end_its_code_and_reason_after_what_was_sent():
    client, server = memory_transport_pair()
    await server.send(b"last")
    await server.close(1008, "policy")
    assert await client.receive() == b"last"  # what was sent before the close still arrives
    with pytest.raises(TransportClosed) as closed:
        await client.receive()
    assert (closed.value.code, closed.value.reason) == (1008, "policy")
    with pytest.raises(TransportClosed):
        await client.send(b"late")
    assert (client.close_code, client.close_reason) == (1008, "policy")


async def test_the_first_close_wins_and_close_is_idempotent():
    client, server = memory_transport_pair()
    await client.close(1000, "bye")
    await server.close(1011, "error")
    await client.close(4000)
    assert (server.close_code, server.close_reason) == (1000, "bye")
    assert (client.close_code, client.close_reason) == (1000, "bye")
    with pytest.raises(TransportClosed) as closed:
        server.receive_nowait()
    assert closed.value.code == 1000


async def test_poll_takes_what_has_arrived_and_answers_none_instead_of_raising():
    client, server = memory_transport_pair()
    assert server.poll() is None
    await client.send(b"one")
    await client.send("two")
    assert server.poll() == b"one" and server.poll() == "two" and server.poll() is None
    await client.close(1000, "bye")
    with pytest.raises(TransportClosed) as closed:  # the end is no "nothing yet"
        server.poll()
    assert closed.value.code == 1000


async def test_poller_turns_receive_nowait_into_poll_for_a_transport_without_poll():
    client, server = memory_transport_pair()

    class OnlyNowait:
        def receive_nowait(self):
            return server.receive_nowait()

    poll = poller(OnlyNowait())
    assert poll() is None
    await client.send(b"x")
    assert poll() == b"x" and poll() is None
    assert poller(server) == server.poll
