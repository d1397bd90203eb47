"""The client's paths that do not yield: ``ResumingTransport`` offers ``send_nowait`` and ``poll``
exactly where its connection does (so a caller that finds none pays nothing per message), keeps
what it sends that way for a resume, and hands a dropped connection back to ``send``; a
``Conversation`` reads with ``poll`` when its transport has it (no ``trio.WouldBlock`` raised per
message).  Over in-memory transports: the native WebSocket's own paths are its tests' business.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import trio

from duplexrt.audio import AudioSpec
from duplexrt.client.conversation import ENDED, Conversation
from duplexrt.client.protocols import DuplexClient
from duplexrt.client.resume import ResumingTransport
from duplexrt.reasons import CloseCode
from duplexrt.wire.transport import MemoryTransport, TransportClosed, memory_transport_pair

URL = "ws://127.0.0.1:1/v1/duplex"


class _Polling:
    """A memory transport with ``poll`` (a message already in, or None) and a ``receive_nowait``
    that must not be called."""

    def __init__(self, transport: MemoryTransport) -> None:
        self._transport = transport
        self.polls = 0

    def poll(self):
        self.polls += 1
        try:
            return self._transport.receive_nowait()
        except trio.WouldBlock:
            return None

    def receive_nowait(self):
        raise AssertionError("receive_nowait called where poll is offered")

    async def receive(self):
        return await self._transport.receive()

    async def send(self, message) -> None:
        await self._transport.send(message)

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        await self._transport.close(code, reason)


class _AwaitOnly:
    """A connection with neither ``send_nowait`` nor ``poll``."""

    async def send(self, message) -> None:
        pass

    async def receive(self):
        await trio.sleep_forever()

    def receive_nowait(self):
        raise trio.WouldBlock

    async def close(self, code: int = CloseCode.NORMAL_CLOSURE, reason: str = "") -> None:
        pass


async def _no_connect(url: str):
    raise AssertionError("no reconnect expected")


async def test_the_resuming_transport_offers_the_direct_paths_only_where_its_connection_does():
    plain = ResumingTransport(_AwaitOnly(), URL, _no_connect)
    assert not hasattr(plain, "send_nowait") and not hasattr(plain, "poll")
    client_end, server_end = memory_transport_pair(capacity=4)
    direct = ResumingTransport(_Polling(client_end), URL, _no_connect)
    assert not hasattr(direct, "send_nowait") and hasattr(direct, "poll")
    memory = ResumingTransport(client_end, URL, _no_connect)
    assert hasattr(memory, "send_nowait") and hasattr(memory, "poll")  # the in-memory transport has both


async def test_send_nowait_keeps_what_it_sends_and_refuses_whole_when_the_connection_is_full():
    client_end, server_end = memory_transport_pair(capacity=2)
    resuming = ResumingTransport(client_end, URL, _no_connect)
    resuming.send_nowait("m0")
    resuming.send_nowait("m1")
    try:
        resuming.send_nowait("m2")
    except trio.WouldBlock:
        refused = True
    else:
        refused = False
    assert refused and resuming.sent == 2  # kept for a resume: the two that went, not the third
    assert [server_end.receive_nowait(), server_end.receive_nowait()] == ["m0", "m1"]


async def test_send_nowait_on_a_dropped_connection_leaves_the_message_to_send_which_resumes_it():
    first_client, first_server = memory_transport_pair(capacity=4)
    second_client, second_server = memory_transport_pair(capacity=4)
    connects: list[str] = []

    async def connect(url: str):
        connects.append(url)
        return second_client

    resuming = ResumingTransport(first_client, URL, connect)
    resuming.token = "replica.first"
    resuming.send_nowait("m0")
    await first_server.close(CloseCode.ABNORMAL_CLOSURE)  # dropped: no Close frame
    try:
        resuming.send_nowait("m1")
    except trio.WouldBlock:
        refused = True
    else:
        refused = False
    assert refused and resuming.sent == 1
    await second_server.send(json.dumps({"type": "session.resumed", "resume_token": "replica.next", "received": 0}))
    with trio.fail_after(5):
        await resuming.send("m1")  # resumes: m0 again, then m1
    assert len(connects) == 1 and "resume=replica.first&received=0" in connects[0]
    assert [second_server.receive_nowait(), second_server.receive_nowait()] == ["m0", "m1"]
    assert resuming.resumes == 1 and resuming.sent == 2


async def test_send_nowait_over_a_resumed_connection_without_one_leaves_each_message_to_send():
    """A resume onto a connection that sends only by ``await`` (not one this ``connect`` would
    make, but possible): ``send_nowait`` refuses, keeping nothing, and ``send`` sends it."""
    first_client, first_server = memory_transport_pair(capacity=4)
    second_client, second_server = memory_transport_pair(capacity=4)

    async def connect(url: str):
        return _Polling(second_client)

    resuming = ResumingTransport(first_client, URL, connect)
    resuming.token = "replica.first"
    resuming.send_nowait("m0")
    await first_server.close(CloseCode.ABNORMAL_CLOSURE)
    await second_server.send(json.dumps({"type": "session.resumed", "resume_token": "replica.next", "received": 0}))
    with trio.fail_after(5):
        await resuming.send("m1")  # resumes: m0 again, then m1
    with pytest.raises(trio.WouldBlock):
        resuming.send_nowait("m2")
    assert resuming.sent == 2
    await resuming.send("m2")
    assert [second_server.receive_nowait() for _ in range(3)] == ["m0", "m1", "m2"]
    assert resuming.sent == 3


async def test_poll_counts_what_it_takes_and_finds_the_token_in_it():
    client_end, server_end = memory_transport_pair(capacity=4)
    polling = _Polling(client_end)
    resuming = ResumingTransport(polling, URL, _no_connect)
    assert resuming.poll() is None
    await server_end.send(json.dumps({"type": "session.created", "resume_token": "replica.token"}))
    assert json.loads(resuming.poll())["type"] == "session.created"
    assert resuming.poll() is None
    assert (resuming.received, resuming.token) == (1, "replica.token")
    await server_end.close()
    assert resuming.poll() is None  # an end is receive()'s to tell
    with pytest.raises(TransportClosed):
        await resuming.receive()


async def test_a_conversation_reads_with_poll_where_its_transport_has_it(autojump_clock):
    client_end, server_end = memory_transport_pair(capacity=16)
    polling = _Polling(client_end)
    spec = AudioSpec("pcm_f32le", 24000)
    frame = np.zeros(1920, np.float32).tobytes()
    heard: list = []

    async def server() -> None:
        for _ in range(3):
            await server_end.send(await server_end.receive())
        await server_end.receive()  # input.end
        await server_end.send(json.dumps({"type": "session.end", "reason": "stop",
                                          "usage": {"frames_in": 3, "frames_out": 3}}))
        await server_end.close()

    conversation = Conversation(polling, DuplexClient(spec, greets=False), on_audio=lambda item, now: heard.append(item))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server)
        await conversation.run(3, lambda i: frame, interval=0.08)
    assert conversation.outcome == ENDED and len(heard) == 3 and polling.polls >= 4
