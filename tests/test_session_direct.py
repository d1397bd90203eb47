"""A session's output sent straight from the step delivery (``Writer.delivery_done``, over a
transport that is a ``DirectSend``) on a real native WebSocket on a socket pair: no writer task
woken for steady output, and the writer's guarantees kept when it does take over (a full socket,
a slow reader, a journal), or when the path is not taken at all (``offload = "always"``).

Real runtime and scheduler thread, real sockets: no ``autojump_clock``; quiescence is read from
the session's own counters (``settle``), never from sleeps.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio
import trio.testing
import trio_websocket

from conftest import FRAME, INPUT_END, PATIENCE, make_config
from duplexrt.wire.resume import ResumableTransport
from duplexrt.runtime import open_runtime
from duplexrt.protocols.raw import RawTranslator
from duplexrt.server import Server
from duplexrt.wire.transport import TransportClosed, memory_transport_pair
from duplexrt.wire.native import NativeWebSocket

ECHO = ("backend.name=echo", "backend.options.delay_frames=0", "runtime.slots=2")


def _frame(i: int) -> bytes:
    """A frame that says which one it is (echoed back unchanged)."""
    return np.full(FRAME, (i % 200) / 256, dtype=np.float32).tobytes()


def _socket_pair() -> tuple[NativeWebSocket, NativeWebSocket]:
    a, b = trio.socket.socketpair()
    return NativeWebSocket(trio.SocketStream(a)), NativeWebSocket(trio.SocketStream(b), client=True, max_message=1 << 22)


async def _one_session(runtime, nursery: trio.Nursery, transport):
    nursery.start_soon(runtime.serve, transport, RawTranslator(runtime.audio_spec(), announce=True))
    with trio.fail_after(PATIENCE):
        while not runtime.sessions:
            await trio.sleep(0.001)
    (session,) = runtime.sessions
    return session


async def settle(session) -> None:
    """Every trio task blocked and every frame submitted back from the scheduler thread."""
    with trio.fail_after(PATIENCE):
        while True:
            await trio.testing.wait_all_tasks_blocked()
            if session.credits.all_delivered:
                return
            await trio.sleep(0.001)  # the scheduler thread is stepping: let it deliver


async def _read_to_the_end(client: NativeWebSocket) -> tuple[bytes, list[dict]]:
    audio = bytearray()
    events: list[dict] = []
    with trio.fail_after(PATIENCE):
        try:
            while True:
                message = await client.receive()
                if isinstance(message, str):
                    events.append(json.loads(message))
                else:
                    assert not any(e["type"] == "session.end" for e in events), "audio after session.end"
                    audio += message
        except TransportClosed:
            pass
    return bytes(audio), events


@pytest.mark.parametrize("resumable", [False, True], ids=["native", "resumable"])
async def test_steady_output_is_sent_from_the_delivery_and_never_wakes_the_writer(resumable):
    frames = 12
    async with open_runtime(make_config(*ECHO)) as runtime:
        server, client = _socket_pair()
        transport = ResumableTransport(server, "r.x", window_s=10, journal_s=10) if resumable else server
        async with trio.open_nursery() as nursery:
            await _one_session(runtime, nursery, transport)
            with trio.fail_after(PATIENCE):
                assert json.loads(await client.receive())["type"] == "session.created"
                for i in range(frames):
                    await client.send(_frame(i))
                    assert await client.receive() == _frame(i)
            stats = runtime.statistics().frames
            assert (stats.direct_batches, stats.writer_wakeups, stats.frames_out) == (frames, 0, frames)
            await client.send(INPUT_END)
            audio, events = await _read_to_the_end(client)
        assert audio == b""
        assert events[-1]["type"] == "session.end" and events[-1]["usage"]["frames_out"] == frames
        if resumable:  # numbered exactly as the writer would have: created, the frames, the end
            assert transport.sent == frames + 2


async def test_in_process_sessions_over_memory_transports_send_from_the_delivery_too():
    frames = 8
    async with open_runtime(make_config(*ECHO)) as runtime:
        client, server = memory_transport_pair(capacity=4)
        async with trio.open_nursery() as nursery:
            await _one_session(runtime, nursery, server)
            with trio.fail_after(PATIENCE):
                assert json.loads(await client.receive())["type"] == "session.created"
                for i in range(frames):
                    await client.send(_frame(i))
                    assert await client.receive() == _frame(i)
                stats = runtime.statistics().frames
                assert (stats.direct_batches, stats.writer_wakeups) == (frames, 0)
                await client.send(INPUT_END)
                assert json.loads(await client.receive())["usage"]["frames_out"] == frames


async def test_a_client_that_stops_reading_gets_everything_in_order_and_still_stops_its_own_input():
    """The socket fills under direct sends: the rest of a message stays in the transport, the
    writer takes over behind it, credits stop the reader; once the client reads again every frame
    arrives, whole and in order, and the session ends with exact usage."""
    inbox, outbox, total = 4, 4, 300
    config = make_config(*ECHO, f"runtime.inbox_depth={inbox}", f"runtime.outbox_depth={outbox}")
    async with open_runtime(config) as runtime:
        server, client = _socket_pair()
        async with trio.open_nursery() as nursery:
            session = await _one_session(runtime, nursery, server)
            sent = 0

            async def flood() -> None:
                nonlocal sent
                for i in range(total):
                    await client.send(_frame(i))
                    sent += 1
                await client.send(INPUT_END)

            nursery.start_soon(flood)
            await settle(session)
            held = session.frames_in - session.frames_out
            taken = session.frames_in
            stats = runtime.statistics().frames
            assert held <= inbox + outbox, f"{held} frames held for a client that is not reading"
            assert taken < total and sent < total  # its input stopped with its reading
            assert stats.direct_batches > 0 and stats.writer_wakeups > 0  # direct, then the writer
            # The batch the socket took only part of is told but not yet counted as sent.
            assert session.frames_answered > session.frames_out
            audio, events = await _read_to_the_end(client)
    assert audio == b"".join(_frame(i) for i in range(total))
    assert events[0]["type"] == "session.created"
    end = events[-1]
    assert end["type"] == "session.end" and end["reason"] == "stop"
    assert end["usage"]["frames_in"] == end["usage"]["frames_out"] == total


async def test_offload_always_keeps_every_batch_on_the_writer():
    frames = 6
    config = make_config(*ECHO, "runtime.offload=always")
    async with open_runtime(config) as runtime:
        server, client = _socket_pair()
        async with trio.open_nursery() as nursery:
            await _one_session(runtime, nursery, server)
            with trio.fail_after(PATIENCE):
                assert json.loads(await client.receive())["type"] == "session.created"
                for i in range(frames):
                    await client.send(_frame(i))
                    assert await client.receive() == _frame(i)
            stats = runtime.statistics().frames
            assert stats.direct_batches == 0 and stats.writer_wakeups == frames
            await client.send(INPUT_END)
            await _read_to_the_end(client)


async def _lockstep_over_a_server(nursery: trio.Nursery, *overrides: str, frames: int = 5):
    """``frames`` frames through `duplexrt serve`, each sent once the one before came back (a
    trio-websocket client), then the end; returns the server's frame statistics."""
    server = Server(make_config(*ECHO, "server.port=0", *overrides))
    await nursery.start(server.run)
    url = f"ws://127.0.0.1:{server.ports[0]}/v1/duplex"
    with trio.fail_after(PATIENCE):
        async with trio_websocket.open_websocket_url(url) as ws:
            assert json.loads(await ws.get_message())["type"] == "session.created"
            for i in range(frames):
                await ws.send_message(_frame(i))
                assert await ws.get_message() == _frame(i)
            stats = server.statistics().runtime.frames
            await ws.send_message(INPUT_END)
            end = json.loads(await ws.get_message())
    assert end["type"] == "session.end" and end["usage"]["frames_out"] == frames
    return stats


async def test_a_native_server_session_sends_from_the_delivery(nursery):
    # The same through `duplexrt serve` with its defaults (native, resumable).
    stats = await _lockstep_over_a_server(nursery)
    assert stats.direct_batches == 5 and stats.writer_wakeups == 0
