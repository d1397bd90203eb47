"""The native WebSocket transport (duplexrt.wire.native) over a real socket pair: both ends are
``NativeWebSocket``s, or one is a hand-driven peer writing frames laid out by hand."""

from __future__ import annotations

import contextlib
import struct

import pytest
import trio
import trio.testing

from duplexrt.reasons import CloseCode, FinishReason
from duplexrt.wire.transport import TransportClosed
from duplexrt.wire.frames import Close, FrameParser, Opcode, Pong, frame
from duplexrt.wire.connection import PONGS_PER_BURST
from duplexrt.wire.native import NativeWebSocket


def _pair(client_max_message: int = 1 << 20) -> tuple[NativeWebSocket, NativeWebSocket]:
    a, b = trio.socket.socketpair()
    server = NativeWebSocket(trio.SocketStream(a))
    client = NativeWebSocket(trio.SocketStream(b), client=True, max_message=client_max_message)
    return server, client


class HandPeer:
    """A client on a bare socket: it sends exactly the frames the test writes."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.parser = FrameParser(masked=False, max_message=1 << 20)

    async def send(self, opcode: int, payload: bytes, fin: bool = True) -> None:
        data = frame(opcode, payload, masked=True)
        if not fin:
            data = bytes((data[0] & 0x7F,)) + data[1:]
        await self.stream.send_all(data)

    async def next_event(self):
        with trio.fail_after(5):
            while (event := self.parser.next()) is None:
                data = await self.stream.receive_some(65536)
                assert data, "the server hung up"
                self.parser.feed(data)
        return event


def _hand_pair(**server_options) -> tuple[NativeWebSocket, HandPeer]:
    a, b = trio.socket.socketpair()
    return NativeWebSocket(trio.SocketStream(a), **server_options), HandPeer(trio.SocketStream(b))


async def test_messages_that_arrive_together_are_taken_in_one_wake_up():
    server, peer = _hand_pair()
    await peer.stream.send_all(frame(Opcode.BINARY, b"one", masked=True) + frame(Opcode.TEXT, b"two", masked=True)
                               + frame(Opcode.BINARY, b"three", masked=True))
    assert await server.receive() == b"one"
    assert server.receive_nowait() == "two"
    assert server.receive_nowait() == b"three"
    with pytest.raises(trio.WouldBlock):
        server.receive_nowait()
    assert server.received == 3


async def test_poll_takes_parsed_messages_then_answers_none_and_counts_what_it_took():
    server, peer = _hand_pair()
    await peer.stream.send_all(frame(Opcode.BINARY, b"one", masked=True) + frame(Opcode.TEXT, b"two", masked=True))
    assert await server.receive() == b"one"
    assert server.poll() == "two"
    assert server.poll() is None and server.received == 2
    await peer.send(Opcode.CLOSE, struct.pack("!H", 1000))
    with pytest.raises(TransportClosed):
        await server.receive()
    with pytest.raises(TransportClosed) as closed:  # gone: poll says so, as receive_nowait does
        server.poll()
    assert closed.value.code == 1000


async def test_both_ends_exchange_messages_and_a_close_with_its_code_and_reason():
    server, client = _pair()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, b"\x00" * 70000)
        assert await server.receive() == b"\x00" * 70000
        await server.send("hé")
        assert await client.receive() == "hé"

        async def client_reads_until_closed() -> None:
            with pytest.raises(TransportClosed) as closed:
                await client.receive()
            assert (closed.value.code, closed.value.reason, closed.value.finish_reason) == (4001, "bye", None)

        nursery.start_soon(client_reads_until_closed)
        with trio.fail_after(5):
            await server.close(4001, "bye")
    with pytest.raises(TransportClosed):
        await server.send(b"late")


async def test_a_ping_in_the_middle_of_a_fragmented_message_is_answered_and_the_message_arrives():
    server, peer = _hand_pair()
    await peer.send(Opcode.BINARY, b"ab", fin=False)
    await peer.send(Opcode.PING, b"are you there")
    await peer.send(Opcode.CONTINUATION, b"cd")
    assert await server.receive() == b"abcd"
    assert await peer.next_event() == Pong(b"are you there")


async def test_a_peer_close_ends_receive_and_is_answered_with_the_same_code():
    server, peer = _hand_pair()
    await peer.send(Opcode.CLOSE, struct.pack("!H", 1000) + b"done")
    with pytest.raises(TransportClosed) as closed:
        await server.receive()
    assert (closed.value.code, closed.value.reason, closed.value.finish_reason) == (1000, "done", None)
    answer = await peer.next_event()
    assert isinstance(answer, Close) and answer.code == 1000


@pytest.mark.parametrize("opcode, payload, code, finish", [
    (Opcode.TEXT, b"\xff", CloseCode.INVALID_PAYLOAD, FinishReason.PROTOCOL_ERROR),
    (0x3, b"x", CloseCode.PROTOCOL_ERROR, FinishReason.PROTOCOL_ERROR),
    (Opcode.BINARY, b"x" * 2000, CloseCode.MESSAGE_TOO_BIG, FinishReason.MESSAGE_TOO_BIG),
])
async def test_a_broken_frame_closes_with_its_code_and_names_this_ends_reason(opcode, payload, code, finish):
    server, peer = _hand_pair(max_message=1024)
    await peer.send(opcode, payload)
    with pytest.raises(TransportClosed) as closed:
        await server.receive()
    assert (closed.value.code, closed.value.finish_reason) == (code, finish)
    answer = await peer.next_event()
    assert isinstance(answer, Close) and answer.code == code
    with trio.fail_after(5):
        await server.close()  # no Close of the peer's to wait for: it hangs up at once


async def test_keepalive_reads_pongs_itself_while_the_session_is_not_receiving():
    # The session never calls receive (its input ended); the client answers pings as it reads.
    server, client = _pair()
    async with trio.open_nursery() as nursery:
        async def client_reads() -> None:
            with pytest.raises(TransportClosed):
                while True:
                    await client.receive()

        nursery.start_soon(client_reads)
        # Three pong deadlines long: a watch that never read the pongs would have ended it.
        with trio.move_on_after(1.5):
            await server.watch(ping_interval=0.05, ping_timeout=0.5, idle_timeout=0)
        with pytest.raises(trio.WouldBlock):  # not ended: a peer that answers every ping is alive
            server.receive_nowait()
        await server.send(b"still open")
        await server.close()


async def test_a_peer_that_never_answers_pings_is_dropped_with_ping_timeout():
    server, peer = _hand_pair()
    with trio.fail_after(5):
        await server.watch(ping_interval=0.05, ping_timeout=0.1, idle_timeout=0)
    with pytest.raises(TransportClosed) as closed:
        await server.receive()
    assert closed.value.finish_reason == FinishReason.PING_TIMEOUT
    del peer


async def test_frames_that_came_with_the_handshake_are_received_without_more_bytes():
    # A server's 101 and its greeting often arrive in one segment: the client gets the greeting
    # as ``received`` and must not wait for the socket to find it.
    a, b = trio.socket.socketpair()
    client = NativeWebSocket(trio.SocketStream(a), client=True, received=frame(Opcode.TEXT, b"hello"))
    with trio.fail_after(5):
        assert await client.receive() == "hello"
    b.close()


async def test_a_message_larger_than_the_socket_buffer_goes_out_whole_across_partial_writes():
    payload = bytes(range(256)) * 12288  # 3 MiB: several socket buffers, so writev comes back short
    server, client = _pair(client_max_message=len(payload))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send, payload)
        with trio.fail_after(10):
            assert await client.receive() == payload


# -- sending without yielding (the session's direct path) ---------------------------------------------

_BIG = bytes(range(256)) * 12288  # 3 MiB: more than a socket pair's buffers hold, so a write comes back short


async def test_send_nowait_writes_a_whole_message_and_keeps_order_with_send():
    server, client = _pair()
    assert server.offers_send_nowait
    assert server.send_nowait(b"one") is True
    await server.send("two")
    assert server.send_nowait("three") is True
    assert [await client.receive() for _ in range(3)] == [b"one", "two", "three"]


async def test_a_partial_send_nowait_keeps_the_rest_and_drains_it_without_another_send():
    # The peer reads nothing until the write came back short; after that no one on the server
    # side calls anything: the transport writes the rest by itself as the socket takes it.
    server, client = _pair(client_max_message=len(_BIG))
    assert server.send_nowait(_BIG) is False
    with trio.fail_after(10):
        assert await client.receive() == _BIG
        await server.flush()


async def test_after_a_partial_send_nowait_later_messages_wait_behind_the_rest_in_order():
    server, client = _pair(client_max_message=len(_BIG))
    assert server.send_nowait(_BIG) is False
    with pytest.raises(trio.WouldBlock):  # the rest is still being written: nothing jumps it
        server.send_nowait(b"jumps the queue")
    got: list[bytes | str] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.send, "after")  # waits for the rest, then goes out

        async def read() -> None:
            got.append(await client.receive())
            got.append(await client.receive())

        nursery.start_soon(read)
    assert got == [_BIG, "after"]
    assert server.send_nowait(b"again") is True  # the rest is out: direct sends work again
    assert await client.receive() == b"again"


async def test_flush_raises_as_send_would_once_the_peer_is_gone_with_the_rest_unwritten():
    a, b = trio.socket.socketpair()
    server = NativeWebSocket(trio.SocketStream(a))
    assert server.send_nowait(_BIG) is False
    b.close()  # never read: the rest can never go out
    with trio.fail_after(5), pytest.raises(TransportClosed) as closed:
        await server.flush()
    assert closed.value.code == CloseCode.ABNORMAL_CLOSURE
    with pytest.raises(TransportClosed):
        server.send_nowait(b"late")


# -- a reader waiting in receive, and what ends its wait ----------------------------------------------


async def _receive_in_background(nursery: trio.Nursery, server: NativeWebSocket) -> list:
    """Start ``receive()``; the list gets what it returned (or the TransportClosed)."""
    outcome: list = []

    async def receive() -> None:
        try:
            outcome.append(await server.receive())
        except TransportClosed as closed:
            outcome.append(closed)

    nursery.start_soon(receive)
    await trio.testing.wait_all_tasks_blocked()
    return outcome


@contextlib.asynccontextmanager
async def _receiving(**server_options):
    """A server end and a hand-driven peer, the first message (with its deadline) already taken."""
    async with trio.open_nursery() as nursery:
        server, peer = _hand_pair(**server_options)
        await peer.send(Opcode.BINARY, b"first")
        assert await server.receive() == b"first"
        yield server, peer, nursery
        nursery.cancel_scope.cancel()


async def test_a_message_read_with_a_ping_is_received_after_the_pong():
    async with _receiving() as (server, peer, nursery):
        outcome = await _receive_in_background(nursery, server)
        await peer.stream.send_all(frame(Opcode.PING, b"there?", masked=True)
                                   + frame(Opcode.BINARY, b"after the ping", masked=True))
        assert await peer.next_event() == Pong(b"there?")
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == [b"after the ping"] and server.received == 2


async def test_a_vanished_peer_wakes_a_waiting_receive_with_a_drop():
    async with _receiving() as (server, peer, nursery):
        outcome = await _receive_in_background(nursery, server)
        peer.stream.socket.close()
        await trio.testing.wait_all_tasks_blocked()
        assert len(outcome) == 1 and outcome[0].code == CloseCode.ABNORMAL_CLOSURE


async def test_an_abort_wakes_a_waiting_receive_with_a_drop():
    async with _receiving() as (server, peer, nursery):
        outcome = await _receive_in_background(nursery, server)
        server.abort()
        await trio.testing.wait_all_tasks_blocked()
        assert len(outcome) == 1 and outcome[0].code == CloseCode.ABNORMAL_CLOSURE


@pytest.mark.parametrize(("limits", "after", "finish"), [
    ((0, 0, 5.0), 6, FinishReason.IDLE_TIMEOUT),  # silent: the idle limit
    ((1.0, 1.0, 0), 3, FinishReason.PING_TIMEOUT),  # never answers pings
], ids=["idle", "no-pong"])
async def test_a_waiting_receive_ends_with_the_limit_a_silent_peer_ran_into(autojump_clock, limits, after, finish):
    async with _receiving() as (server, peer, nursery):
        nursery.start_soon(server.watch, *limits)
        outcome = await _receive_in_background(nursery, server)
        await trio.sleep(after)
        assert outcome[0].finish_reason == finish


async def test_pongs_read_while_the_reader_waits_reach_the_keepalive(autojump_clock):
    async with _receiving() as (server, peer, nursery):
        nursery.start_soon(server.watch, 1.0, 1.0, 0)
        outcome = await _receive_in_background(nursery, server)
        for _ in range(4):  # answer four pings, each within its deadline
            ping = await peer.next_event()
            await peer.send(Opcode.PONG, bytes(ping))
        await peer.send(Opcode.BINARY, b"alive")
        await trio.testing.wait_all_tasks_blocked()
        assert outcome == [b"alive"]


# -- hostile peers: fragments, trickles and control floods ---------------------------------------------


def _not_final(data: bytes) -> bytes:
    return bytes((data[0] & 0x7F,)) + data[1:]


async def test_a_peer_that_sends_one_header_byte_and_stops_is_idle_one_period_later(autojump_clock):
    # A pending partial frame counted as hearing from the peer for as long as it stayed pending.
    async with _receiving() as (server, peer, nursery):
        nursery.start_soon(server.watch, 0, 0, 5.0)
        outcome = await _receive_in_background(nursery, server)
        await peer.stream.send_all(b"\x82")  # the first byte of a binary frame's header
        await trio.sleep(5.0 * 2 + 1)
        assert len(outcome) == 1 and outcome[0].finish_reason == FinishReason.IDLE_TIMEOUT


async def test_pings_between_fragments_never_finished_do_not_keep_a_connection_alive(autojump_clock):
    async with _receiving() as (server, peer, nursery):
        nursery.start_soon(server.watch, 0, 0, 5.0)
        outcome = await _receive_in_background(nursery, server)
        await peer.stream.send_all(_not_final(frame(Opcode.BINARY, b"", masked=True)))
        started = trio.current_time()
        with contextlib.suppress(trio.BrokenResourceError):  # the server stops reading at the limit
            for _ in range(60):  # every half second: an empty fragment, a ping, a byte of the next header
                if outcome:
                    break
                await peer.stream.send_all(b"\x00\x80\0\0\0\0" + frame(Opcode.PING, b"?", masked=True) + b"\x00")
                assert await peer.next_event() == Pong(b"?")
                await trio.sleep(0.25)
                await peer.stream.send_all(b"\x80\0\0\0\0")  # the rest of that header: an empty fragment
                await trio.sleep(0.25)
        await trio.testing.wait_all_tasks_blocked()  # a send refused at the limit: the receive's end lands
        assert len(outcome) == 1 and outcome[0].finish_reason == FinishReason.IDLE_TIMEOUT
        assert trio.current_time() - started < 5.0 * 2 + 1


async def test_a_flood_of_empty_continuations_is_closed_with_1009():
    async with _receiving() as (server, peer, nursery):
        outcome = await _receive_in_background(nursery, server)
        empty = _not_final(frame(Opcode.CONTINUATION, b"", masked=True))
        await peer.stream.send_all(_not_final(frame(Opcode.BINARY, b"", masked=True)) + empty * 2000)
        close = await peer.next_event()
        assert isinstance(close, Close) and close.code == CloseCode.MESSAGE_TOO_BIG and "fragments" in close.reason
        await trio.testing.wait_all_tasks_blocked()
        assert outcome[0].finish_reason == FinishReason.MESSAGE_TOO_BIG


async def test_a_burst_of_pings_in_one_read_gets_pongs_for_the_latest_few_only():
    async with _receiving() as (server, peer, nursery):
        await _receive_in_background(nursery, server)
        await peer.stream.send_all(b"".join(frame(Opcode.PING, b"%d" % i, masked=True) for i in range(50))
                                   + frame(Opcode.BINARY, b"then this", masked=True))
        for i in range(50 - PONGS_PER_BURST, 50):
            assert await peer.next_event() == Pong(b"%d" % i)
        await trio.testing.wait_all_tasks_blocked()
        await _receive_in_background(nursery, server)  # the first took "then this": one more reads
        await peer.send(Opcode.PING, b"alone")
        assert await peer.next_event() == Pong(b"alone")  # no pong for 0..48 came before it


async def test_a_ping_flood_is_closed_with_1008_and_the_session_is_told_why(autojump_clock):
    async with _receiving() as (server, peer, nursery):
        outcome = await _receive_in_background(nursery, server)
        for i in range(400):  # one at a time, each answered: the rate, not the burst, is the limit
            await peer.send(Opcode.PING, b"%d" % i)
            event = await peer.next_event()
            if isinstance(event, Close):
                break
            assert event == Pong(b"%d" % i)
            await trio.sleep(0.001)
        assert isinstance(event, Close) and event.code == CloseCode.POLICY_VIOLATION and i < 250
        await trio.testing.wait_all_tasks_blocked()
        assert outcome[0].code == CloseCode.POLICY_VIOLATION and outcome[0].finish_reason == FinishReason.PROTOCOL_ERROR


async def test_a_backlog_of_tiny_messages_is_taken_a_bounded_share_per_turn():
    # One connection's backlog must not keep the trio thread: after a turn's share, ``poll``
    # says "nothing now" and the next ``receive`` yields to the other tasks before it takes more.
    async with _receiving() as (server, peer, nursery):
        await peer.stream.send_all(frame(Opcode.BINARY, b"x", masked=True) * 1000)
        other_turns = 0

        async def other_task() -> None:
            nonlocal other_turns
            while True:
                await trio.lowlevel.checkpoint()
                other_turns += 1

        nursery.start_soon(other_task)
        taken = 0
        shares = []
        while taken < 1000:
            assert await server.receive() == b"x"
            share = 1
            while server.poll() is not None:
                share += 1
            shares.append(share)
            taken += share
        assert max(shares) <= 64  # a wake-up takes at most a share ...
        assert other_turns >= 1000 // 64 - 1  # ... and the other task ran between the shares


async def test_a_close_reads_past_a_backlog_the_session_never_took_and_ends():
    # A closing end reads on to the peer's Close through whatever the peer sent before it: the
    # backlog is parsed a batch at a time, and nothing waits for the session to take it.
    async with _receiving(close_timeout=5.0) as (server, peer, nursery):
        await peer.stream.send_all(frame(Opcode.BINARY, b"x", masked=True) * 1000)
        assert await server.receive() == b"x"  # one read: the rest is backlog
        await peer.stream.send_all(frame(Opcode.CLOSE, struct.pack("!H", 1000), masked=True))
        with trio.fail_after(2):
            await server.close()
        close = await peer.next_event()
        assert isinstance(close, Close) and close.code == 1000


# -- pongs never wait for the write turn --------------------------------------------------------------


async def test_a_ping_read_while_a_send_waits_on_a_full_socket_is_answered_after_it_and_reading_goes_on():
    # A client bursting ahead of a real-time model: its send waits on a full socket when the
    # server's ping comes.  Before, the reader waited for the write turn to send the pong, so it
    # stopped reading; the server, its output unread, stopped reading too: neither moved again.
    a, b = trio.socket.socketpair()
    server_side = trio.SocketStream(a)
    client = NativeWebSocket(trio.SocketStream(b), client=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, _BIG)  # more than the socket pair holds: it waits
        await trio.testing.wait_all_tasks_blocked()
        await server_side.send_all(frame(Opcode.PING, b"there?") + frame(Opcode.BINARY, b"after the ping"))
        with trio.fail_after(2):
            assert await client.receive() == b"after the ping"  # read on, though the send still waits
        # The server reads again: the message whole, then the pong (never inside the message).
        parser = FrameParser(masked=True, max_message=len(_BIG))
        events: list = []
        with trio.fail_after(10):
            while len(events) < 2:
                parser.feed(await server_side.receive_some(1 << 16))
                while (event := parser.next()) is not None:
                    events.append(event)
        assert events == [_BIG, Pong(b"there?")]
        await client.send(b"next")  # the turn was passed on
        parser.feed(await server_side.receive_some(1 << 16))
        assert parser.next() == b"next"


async def test_a_pong_waiting_for_a_send_is_dropped_once_this_end_has_sent_its_close():
    a, b = trio.socket.socketpair()
    server_side = trio.SocketStream(a)
    client = NativeWebSocket(trio.SocketStream(b), client=True, close_timeout=5.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(client.send, _BIG)
        await trio.testing.wait_all_tasks_blocked()
        await server_side.send_all(frame(Opcode.PING, b"late"))
        outcome = await _receive_in_background(nursery, client)  # reads the ping: the pong waits
        nursery.start_soon(client.close)  # its Close waits behind the message
        await trio.testing.wait_all_tasks_blocked()
        parser = FrameParser(masked=True, max_message=len(_BIG))
        events: list = []
        with trio.fail_after(10):
            while not any(isinstance(event, Close) for event in events):
                parser.feed(await server_side.receive_some(1 << 16))
                while (event := parser.next()) is not None:
                    events.append(event)
        assert len(events) == 2 and events[0] == _BIG and isinstance(events[1], Close)  # no pong after the Close
        assert outcome == []
        nursery.cancel_scope.cancel()


async def test_messages_that_come_after_this_end_sent_its_close_are_dropped_as_they_are_parsed():
    # RFC 6455 1.4: after sending Close, data may be ignored.  Kept, they were all held until
    # the peer's Close or the close timeout, however many the peer sent.
    async with _receiving(close_timeout=5.0) as (server, peer, nursery):
        nursery.start_soon(server.close)
        close = await peer.next_event()
        assert isinstance(close, Close) and close.code == 1000
        held: list[int] = []
        for _ in range(40):
            await peer.stream.send_all(frame(Opcode.BINARY, bytes(1 << 16), masked=True))
            await trio.testing.wait_all_tasks_blocked()
            held.append(server.held_bytes)
        await peer.send(Opcode.BINARY, b"part", fin=False)  # a message under way is held, then dropped
        await peer.send(Opcode.CONTINUATION, b" and the rest")
        await peer.send(Opcode.CLOSE, struct.pack("!H", 1000))
        with trio.fail_after(2):
            while server.discarded < 41:
                await trio.sleep(0.01)
    assert max(held) < 1 << 17  # one message's bytes at most, never the 40 that came
    assert server.discarded == 41 and server.held_bytes == 0
